"""Decode-time projections as one GEMV kernel each, with the small ops around them fused in.

At decode batch sizes (T <= 16 token rows) a decoder layer's projections stream their weights once, and
XLA makes each of them a split-K GEMM plus a reduction, with the RMSNorm, the residual add and SwiGLU's
silu(gate) * up as kernels of their own: nine ~1.7 us launches per layer around four weight streams
(bench/step_probe.py). Here one program owns BN output columns over the whole contraction (no split-K, so
no reduction pass), and

  prologue "norm": x is the residual stream; the RMSNorm is applied on the fly: the MMA takes
      bf16(x * norm_weight) and the accumulator is scaled by rsqrt(mean(x^2) + eps), whose sum of squares
      is gathered in the same loop (one pass over x);
  prologue "silu": x is [T, 2, F] (gate, up), read as [T, 2F]; the MMA takes bf16(silu(gate) * up);
  epilogue "residual": out = bf16(bf16(acc) + residual), the residual add of `x + proj(...)`.

The rounding points differ from the unfused ops (the norm scale is applied after the MMA instead of before
the bf16 rounding of its operand), so results agree with them to bf16 rounding, not bitwise.
Rows: the MMA needs >= 16; T < 16 rows are stacked R = 16 / T times in registers (no padding in HBM).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import mma, triton_params


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
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        x = norm_weight * x32.astype(x.dtype)
    elif prologue == "silu":
        x = jax.nn.silu(x[:, 0]) * x[:, 1]
    y = jnp.einsum("TD,DN->TN", x, w)
    return y + residual if epilogue == "residual" else y
