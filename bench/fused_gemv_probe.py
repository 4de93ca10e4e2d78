"""Probe: kernels_pallas fused_gemv (one program per BN columns, the norm / silu prologue and the residual
epilogue fused in) against what XLA makes of the same unfused ops (its split-K GEMM, reduce, norm, add and
silu * mul kernels), at decode row counts, on a decoder layer's four projections (Llama-3-8B shapes).
Times: summed kernel durations of an XProf trace per call; calls rotate over 4 weight copies so the weights
come from HBM as in a real step (the qkv and o weights would otherwise sit in the 50 MB L2).

  python bench/fused_gemv_probe.py --out OUT.json [--rows 8,16] [--quick]
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

from kernels_pallas._gemv import fused_gemv, fused_gemv_ref  # noqa: E402

COPIES = 4
# name -> (D, N, prologue, epilogue)
SHAPES = {
    "qkv": (4096, 6144, "norm", None),
    "o": (4096, 4096, None, "residual"),
    "gate_up": (4096, 28672, "norm", None),
    "down": (14336, 4096, "silu", "residual"),
    "down_plain": (14336, 4096, None, None),
}
CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
           for bn, bk, w, s in ((32, 256, 4, 4), (64, 256, 4, 4), (64, 256, 4, 3), (64, 256, 4, 5), (64, 512, 4, 3),
                                (128, 256, 4, 3), (128, 128, 4, 4), (32, 256, 4, 3), (32, 512, 4, 2), (64, 128, 4, 3))]


def trace_us(fn, calls=40):
    from bench.profile_summary import summarize

    jax.block_until_ready(fn(0))
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        jax.block_until_ready([fn(i) for i in range(calls)])
    s = summarize(d)
    ks = s["devices"][0]["top_kernels"] if s.get("devices") else []
    ks = [k for k in ks if k["runs"] >= calls]
    return sum(k["ms"] for k in ks) * 1e3 / calls, [(k["name"][:60], round(k["us_per_run"], 2)) for k in ks]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="8")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--quick", action="store_true", help="the first 3 configs only")
    a = p.parse_args()
    rows = []
    key = jax.random.key(0)
    for T in map(int, a.rows.split(",")):
        for name in a.shapes.split(","):
            D, N, pro, epi = SHAPES[name]
            ks = jax.random.split(key, COPIES + 3)
            ws = [(jax.random.normal(ks[i], (D, N), jnp.float32) * 0.02).astype(jnp.bfloat16) for i in range(COPIES)]
            x = jax.random.normal(ks[-1], (T, 2, D) if pro == "silu" else (T, D), jnp.bfloat16)
            nw = (1 + 0.1 * jax.random.normal(ks[-2], (D,))).astype(jnp.bfloat16)
            res = jax.random.normal(ks[-3], (T, N), jnp.bfloat16)
            kw = dict(prologue=pro, epilogue=epi, eps=1e-5)
            ref_fn = jax.jit(functools.partial(fused_gemv_ref, **kw))
            want = ref_fn(x, ws[0], nw, res).astype(jnp.float32)
            nbytes = D * N * 2
            base, kern = trace_us(lambda i: ref_fn(x, ws[i % COPIES], nw, res))
            row = dict(T=T, shape=name, D=D, N=N, impl="xla", us=base, TB_s=nbytes / base / 1e6, kernels=kern)
            rows.append(row)
            print(json.dumps(row), flush=True)
            for cfg in CONFIGS[: 3 if a.quick else None]:
                row = dict(T=T, shape=name, D=D, N=N, impl="fused_gemv", cfg=cfg)
                try:
                    fn = jax.jit(functools.partial(fused_gemv, **kw, **cfg))
                    got = fn(x, ws[0], nw, res).astype(jnp.float32)
                    row["rel_err"] = float(jnp.abs(got - want).max() / jnp.abs(want).max())
                    us, kern = trace_us(lambda i: fn(x, ws[i % COPIES], nw, res))
                    row.update(us=us, TB_s=nbytes / us / 1e6, vs_xla=base / us, kernels=kern)
                except Exception as e:  # noqa: BLE001 - a config that fails to compile must not lose the rest
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
            del ws
    info = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, git_commit=os.environ.get("GIT_COMMIT"),
                command=" ".join(sys.argv))
    with open(a.out, "w") as f:
        json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
