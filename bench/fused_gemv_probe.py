"""Probe: a fused decode GEMV (one program per BN columns over the whole contraction, no split-K; the RMSNorm
or silu(gate) * up prologue and the residual-add epilogue fused in) against what XLA makes of the same unfused
ops (its split-K GEMM, reduce, norm, add and silu * mul kernels), at decode row counts, on a decoder layer's
four projections (Llama-3-8B shapes).
Times: summed kernel durations of an XProf trace per call; calls rotate over 4 weight copies so the weights
come from HBM as in a real step (the qkv and o weights would otherwise sit in the 50 MB L2).

  python bench/fused_gemv_probe.py --out OUT.json [--rows 8,16] [--quick]

Measured on an H100 (bench/results/fused_gemv_probe_h100_*.json, KERNELS_NOTES "Stop 13"): the norm + qkv and
the o + residual kernels beat XLA's kernels by 1.3 and ~1 us, gate_up and down lose; inside the decode step
(bench/step_probe.py) the two winners saved 19 us of 5.69 ms and the engine's batch-1 ITL did not move
(5.71 vs 5.73 ms), so the decoder does not use them. The prologue "norm" applies the norm scale after the
MMA (the MMA takes bf16(x * norm_weight)), so results match the unfused ops to bf16 rounding.
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

from bench.common import environment, write_result  # noqa: E402
from jaxllm.models.decoder import rms_norm  # noqa: E402
from kernels_pallas._common import mma, triton_params  # noqa: E402


def _gemv_kernel(x_ref, w_ref, *rest, prologue, epilogue, eps, block_k, replicas):
    refs = list(rest)
    nw_ref = refs.pop(0) if prologue == "norm" else None
    res_ref = refs.pop(0) if epilogue == "residual" else None
    (o_ref,) = refs
    D, BN = w_ref.shape
    T = o_ref.shape[0]
    BK, R = block_k, replicas
    cdt = w_ref.dtype

    def rows(a):  # [T, BK] -> [R * T, BK]: stacked copies for the MMA
        return a if R == 1 else jnp.broadcast_to(a[None], (R,) + a.shape).reshape((R * a.shape[0],) + a.shape[1:])

    def body(i, carry):
        acc, ss = carry
        cols = pl.ds(i * BK, BK)
        if prologue == "silu":  # x_ref [T, 2 * D]: gate columns, then up columns
            g = x_ref[:, cols].astype(jnp.float32)
            u = x_ref[:, pl.ds(D + i * BK, BK)].astype(jnp.float32)
            a = (g / (1.0 + jnp.exp(-g)) * u).astype(cdt)
        else:
            x = x_ref[:, cols]
            if prologue == "norm":
                x32 = x.astype(jnp.float32)
                ss = ss + (x32 * x32).sum(axis=1)
                a = (x32 * nw_ref[cols].astype(jnp.float32)[None, :]).astype(cdt)
            else:
                a = x.astype(cdt)
        return acc + mma(rows(a), w_ref[cols, :]), ss

    init = (jnp.zeros((R * T, BN), jnp.float32), jnp.zeros((T,), jnp.float32))
    acc, ss = jax.lax.fori_loop(0, D // BK, body, init)
    if R > 1:  # the copies are bitwise equal
        acc = acc.reshape(R, T, BN).max(0)
    if prologue == "norm":
        acc = acc * jax.lax.rsqrt(ss / D + eps)[:, None]
    out = acc.astype(o_ref.dtype)
    if epilogue == "residual":
        out = (out.astype(jnp.float32) + res_ref[...].astype(jnp.float32)).astype(o_ref.dtype)
    o_ref[...] = out


@functools.partial(jax.jit, static_argnames=("prologue", "epilogue", "eps", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def fused_gemv(x, w, norm_weight=None, residual=None, *, prologue=None, epilogue=None, eps=1e-6, block_n=32,
               block_k=256, num_warps=4, num_stages=4, interpret=False):
    """x [T, D] (prologue "silu": [T, 2, D]) @ w [D, N] -> [T, N] in x's dtype, T a power of two <= 16.
    prologue: None | "norm" (norm_weight [D]) | "silu"; epilogue: None | "residual" (residual [T, N])."""
    T = x.shape[0]
    D, N = w.shape
    if prologue == "silu":
        x = x.reshape(T, 2 * D)
    if T & (T - 1) or T > 16:
        raise ValueError(f"fused_gemv takes 1..16 rows (a power of two), got {T}.")
    BN, BK = min(block_n, N), min(block_k, D)
    if N % BN or D % BK:
        raise ValueError(f"fused_gemv: N={N} and D={D} must divide by block_n={BN} and block_k={BK}.")
    full = lambda a: pl.BlockSpec(a.shape, lambda j: (0,) * a.ndim)  # noqa: E731
    in_specs = [full(x), pl.BlockSpec((D, BN), lambda j: (0, j))]
    args = [x, w]
    if prologue == "norm":
        in_specs.append(full(norm_weight))
        args.append(norm_weight)
    if epilogue == "residual":
        in_specs.append(pl.BlockSpec((T, BN), lambda j: (0, j)))
        args.append(residual)
    kernel = functools.partial(_gemv_kernel, prologue=prologue, epilogue=epilogue, eps=eps, block_k=BK,
                               replicas=max(1, 16 // T))
    return pl.pallas_call(
        kernel,
        grid=(N // BN,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((T, BN), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((T, N), x.dtype),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name=f"gemv_{prologue}_{epilogue}_{BN=}_{BK=}",
    )(*args)


def fused_gemv_ref(x, w, norm_weight=None, residual=None, *, prologue=None, epilogue=None, eps=1e-6):
    """The unfused ops, as the decoder writes them (HF's rounding)."""
    if prologue == "norm":
        x = rms_norm(x, norm_weight, eps)
    elif prologue == "silu":
        x = jax.nn.silu(x[:, 0]) * x[:, 1]
    y = jnp.einsum("TD,DN->TN", x, w)
    return y + residual if epilogue == "residual" else y


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
            ws = None  # frees the weight copies before the next shape
    write_result("fused_gemv_probe", dict(env=environment(), rows=rows), a.out)


if __name__ == "__main__":
    main()
