"""Probe: can a Pallas (Triton) GEMV with one program per (kv head, q/k/v row of the fused qkv projection)
stream the qkv weights as fast as XLA's autotuned split-K GEMM (+ its reduce) at decode batch sizes?
Times come from an XProf trace (kernel time per call), the bytes are the weight's.

  python bench/gemv_probe.py --out OUT.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from kernels_pallas._common import mma, triton_params  # noqa: E402


def _kernel(h_ref, w_ref, o_ref, *, BD, steps_per_split):
    s = pl.program_id(2)
    R, H = o_ref.shape

    def body(i, acc):
        d = (s * steps_per_split + i) * BD
        return acc + mma(h_ref[:, pl.ds(d, BD)], w_ref[pl.ds(d, BD), :])

    acc = jax.lax.fori_loop(0, steps_per_split, body, jnp.zeros((R, H), jnp.float32))
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("BD", "warps", "stages", "splits", "interpret"))
def gemv(h, w, *, BD=128, warps=4, stages=3, splits=1, interpret=False):
    T, D = h.shape
    _, K, C, H = w.shape
    R = 16
    hp = jnp.pad(h, ((0, R - T), (0, 0)))
    steps = D // BD // splits
    out = pl.pallas_call(
        functools.partial(_kernel, BD=BD, steps_per_split=steps),
        grid=(K, C, splits),
        in_specs=[pl.BlockSpec((R, D), lambda k, c, s: (0, 0)),
                  pl.BlockSpec((D, None, None, H), lambda k, c, s: (0, k, c, 0))],
        out_specs=pl.BlockSpec((None, R, None, None, H), lambda k, c, s: (s, 0, k, c, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, R, K, C, H), jnp.float32),
        compiler_params=triton_params(warps, stages),
        name=f"gemv_{BD=}_{warps=}_{stages=}_{splits=}", interpret=interpret,
    )(hp, w)
    return out


def xla(h, w):
    return jnp.einsum("TD,DKGH->TKGH", h, w)


def trace_us(fn, args, calls=30):
    from bench.profile_summary import summarize

    jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
    s = summarize(d)
    ks = s["devices"][0]["top_kernels"] if s.get("devices") else []
    return [(k["name"], k["us_per_run"], k["runs"]) for k in ks if k["runs"] >= calls][:6]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows = []
    for (T, D, K, C, H) in ((8, 4096, 8, 6, 128), (1, 4096, 8, 6, 128)):
        h = jax.random.normal(jax.random.key(0), (T, D), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (D, K, C, H), jnp.bfloat16) * 0.02
        nbytes = w.size * 2
        ref = xla(h, w).astype(jnp.float32)
        variants = [("xla", jax.jit(xla), {})]
        for cfg in (dict(BD=128, warps=4, stages=3), dict(BD=128, warps=4, stages=4), dict(BD=256, warps=4, stages=3),
                    dict(BD=256, warps=8, stages=3), dict(BD=64, warps=4, stages=4), dict(BD=128, warps=4, stages=3, splits=2),
                    dict(BD=128, warps=4, stages=3, splits=4), dict(BD=256, warps=8, stages=2, splits=2)):
            variants.append(("pallas", functools.partial(gemv, **cfg), cfg))
        for name, fn, cfg in variants:
            row = dict(T=T, D=D, K=K, C=C, H=H, impl=name, cfg=cfg)
            try:
                out = fn(h, w)
                if name == "pallas":
                    out = out.sum(0)[:T]
                row["max_err"] = float(jnp.abs(out.astype(jnp.float32) - ref).max())
                ks = trace_us(fn, (h, w))
                row["kernels"] = ks
                total = sum(us for _, us, _ in ks)
                row["kernel_us"] = total
                row["TB_s"] = nbytes / total / 1e6 if total else None
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    info = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, git_commit=os.environ.get("GIT_COMMIT"),
                command=" ".join(sys.argv))
    with open(a.out, "w") as f:
        json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
