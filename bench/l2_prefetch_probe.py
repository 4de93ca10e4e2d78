"""Probe: does a batch-1 decode GEMM run faster when its weight was read into the 50 MB L2 just before?
Measured on an H100 (bench/results/l2_prefetch_probe_h100_*.json): no. The GEMM takes ~13 us cold and ~7 us
when the previous call used the same weight, but ~13 us after a Pallas kernel or XLA reduction read it.

At batch 1 each layer spends ~20 us in latency-bound kernels (attention, norms, small fusions) during which
HBM is nearly idle. If a GEMM's weight could be pulled into L2 during that time (by extra programs in those
kernels), the GEMM would read it from L2. This measures the premise on its own: the o projection's shape
(x [8, 4096] @ W [4096, 4096] bf16), calls rotating over 8 weight copies (268 MB, so each starts cold), with
and without a Pallas kernel before each GEMM that reads a fraction of that weight (eviction_policy
evict_last or none) and a data dependency that orders the GEMM after it. Times: summed kernel durations of an
XProf trace, per kernel name.

  python bench/l2_prefetch_probe.py --out OUT.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from bench.common import environment, write_result  # noqa: E402
from kernels_pallas._common import triton_params  # noqa: E402

COPIES = 8


def _read_kernel(w_ref, o_ref, *, rows, block_rows, eviction):
    from jax.experimental.pallas import triton as plgpu

    p = pl.program_id(0)
    N = w_ref.shape[1]

    def body(i, acc):
        blk = plgpu.load(w_ref.at[pl.ds(p * rows + i * block_rows, block_rows), :], eviction_policy=eviction)
        return acc + blk.astype(jnp.float32)

    acc = jax.lax.fori_loop(0, rows // block_rows, body, jnp.zeros((block_rows, N), jnp.float32))
    o_ref[...] = jnp.full((16,), acc.sum(), jnp.float32)


def read_into_l2(w, frac, programs=128, block_rows=2, eviction="evict_last", num_warps=8):
    """Reads the first frac of w's rows (programs share them evenly); returns [programs, 16] f32 to depend on."""
    rows = int(w.shape[0] * frac) // programs
    rows -= rows % block_rows
    return pl.pallas_call(
        functools.partial(_read_kernel, rows=rows, block_rows=block_rows, eviction=eviction),
        grid=(programs,),
        in_specs=[pl.BlockSpec(w.shape, lambda p: (0, 0))],
        out_specs=pl.BlockSpec((None, 16), lambda p: (p, 0)),
        out_shape=jax.ShapeDtypeStruct((programs, 16), jnp.float32),
        compiler_params=triton_params(num_warps, 1),
        name=f"l2_read_{int(frac * 100)}pct",
    )(w)


def xprof(fn, args):
    from bench.profile_summary import summarize

    jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _ in range(3):
            jax.block_until_ready(fn(*args))
    s = summarize(d, top=20)
    ks = s["devices"][0]["top_kernels"] if s.get("devices") else []
    return {k["name"][:40]: round(k["us_per_run"], 2) for k in ks}, s["devices"][0].get("busy_ms") if ks else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=16)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    D = 4096
    ws = [jnp.asarray(rng.standard_normal((D, D), np.float32) * 0.02, jnp.bfloat16) for _ in range(COPIES)]
    x = jnp.asarray(rng.standard_normal((8, D)), jnp.bfloat16)
    rows = []
    variants = [dict(frac=0.0)] + [dict(frac=f, eviction=e) for f in (0.5, 1.0) for e in ("evict_last", None)]
    variants += [dict(frac=1.0, eviction="evict_last", programs=256), dict(frac=0.0), dict(frac=0.0, hot=True),
                 dict(frac=1.0, xla=True)]
    for v in variants:
        v = dict(v)
        frac, hot, xla = v.pop("frac"), v.pop("hot", False), v.pop("xla", False)

        def chain(x, *ws, frac=frac, v=v, hot=hot, xla=xla):
            for i in range(a.n):
                w = ws[0] if hot else ws[i % COPIES]  # hot: one copy, which stays in L2
                if xla:  # XLA's reduction reads the whole weight
                    x = x + (w.astype(jnp.float32).sum() * 0).astype(x.dtype)
                elif frac:
                    dep = read_into_l2(w, frac, **v)
                    x = x + (dep[0, 0] * 0).astype(x.dtype)  # (XLA drops an unused barrier operand)
                x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16) * 0.5
            return x

        fn = jax.jit(chain)
        try:
            kernels, busy_ms = xprof(fn, (x, *ws))
            row = dict(frac=frac, hot=hot, xla_reader=xla, **v, kernels_us=kernels,
                       busy_us_per_call=busy_ms * 1e3 / (3 * a.n))
        except Exception as e:  # noqa: BLE001
            row = dict(frac=frac, **v, error=f"{type(e).__name__}: {str(e)[:400]}")
        print(row, flush=True)
        rows.append(row)
    write_result("l2_prefetch_probe", dict(env=environment(), shape="x[8,4096] @ W[4096,4096] bf16", rows=rows),
                 a.out)


if __name__ == "__main__":
    main()
