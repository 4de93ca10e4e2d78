"""FP8 W8A8 GEMV for the decode step's few rows (Pallas, Triton lowering): the whole of quant.fp8_matmul for M <= 2
rows in one kernel, with the residual add after it.

    y = residual + ((round_e4m3(x / s) @ W^T) * s * w_scale), s = max(max|x_m| / 448, FP8_MIN_SCALE) per row

Grid (N / BN,). A program owns BN output columns (BN rows of the [N, K] e4m3 weight) over the whole of K:
1. the per-token scales: max |x_m| over x's whole row (x is a few KB, read from L2 by every program);
2. per K tile: x's [M, BK] slice divided by its scale, clipped, rounded to e4m3 and widened again (every e4m3
   value is a bfloat16: exact), times the [BN, BK] weight tile widened to x's dtype (exact too), products summed in
   float32 on the CUDA cores ("fma": an [M, BN, BK] accumulator summed over BK at the end) or the tensor cores
   ("mma": the weight tile as the MMA's 16+-row operand, x's rows stacked to 16 columns);
3. the float32 sums times the token scale, then the channel (or tensor) scale, rounded to the output dtype once
   and added to the residual in that dtype: the rounding order of quant.fp8_matmul followed by `residual + y`.

What it replaces at the engine's batch-1 bucket (H100 trace, 8B fp8, b42ec8a): per projection an XLA reduce for
the token scales, a convert that writes the rounded x, the GEMM, and the residual add after o and down: three
launches of ~1.2-1.7 us each around every GEMM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import mma, triton_params

MAX_ROWS = 2  # the engine's batch-1 decode bucket (2 rows); more rows take quant.fp8_matmul's dot
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
VARIANTS = ("fma", "mma")


def supported(x_dtype, m: int, n: int, k: int) -> bool:
    """Inputs the kernel takes: 16-bit x of at most MAX_ROWS rows, N a multiple of 16, K of 128."""
    return (
        jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and 1 <= m <= MAX_ROWS
        and n % 16 == 0
        and k % 128 == 0
    )


def default_tiling(n: int, k: int) -> dict:
    """block_n, block_k, variant, num_warps, num_stages by default (see bench/quant_kernels.py fp8_gemv rows)."""
    bn = next(b for b in (32, 16) if n % b == 0)
    bk = next(b for b in (512, 256, 128) if k % b == 0)
    return dict(block_n=bn, block_k=bk, variant="fma", num_warps=4, num_stages=3)


def _kernel(x_ref, w_ref, ws_ref, *rest, nk, bk, min_scale, per_tensor, has_residual, variant):
    res_ref = rest[0] if has_residual else None
    o_ref = rest[-1]
    M = x_ref.shape[0]
    BN = w_ref.shape[0]
    cdt = x_ref.dtype
    f32 = jnp.float32

    # the token scales (a scalar per row): every program reads x's whole row, a static unroll of independent loads
    s = []
    for m in range(M):
        amax = jnp.float32(0.0)
        for i in range(nk):
            amax = jnp.maximum(amax, jnp.abs(x_ref[m, pl.ds(i * bk, bk)].astype(f32)).max())
        s.append(jnp.maximum(amax / FP8_MAX, min_scale))

    def rounded(v, scale):  # W8A8's x: v / scale clipped to e4m3's range, rounded to e4m3, widened again (exact)
        return jnp.clip(v.astype(f32) / scale, -FP8_MAX, FP8_MAX).astype(FP8).astype(cdt)

    def wt(k0):  # the [BN, BK] weight tile widened to x's dtype (exact)
        return w_ref[:, pl.ds(k0, bk)].astype(cdt)

    ws = ws_ref[0] if per_tensor else ws_ref[...].astype(f32)

    if variant == "fma":  # [BN, BK] float32 accumulators per row, summed over BK once at the end

        def body(i, acc):
            k0 = i * bk
            w = wt(k0).astype(f32)
            return tuple(acc[m] + w * rounded(x_ref[m, pl.ds(k0, bk)], s[m]).astype(f32)[None, :] for m in range(M))

        acc = jax.lax.fori_loop(0, nk, body, tuple(jnp.zeros((BN, bk), f32) for _ in range(M)))
        for m in range(M):
            y = ((acc[m].sum(axis=1) * s[m]) * ws).astype(o_ref.dtype)
            if has_residual:
                y = (res_ref[m, :].astype(f32) + y.astype(f32)).astype(o_ref.dtype)
            o_ref[m, :] = y
        return

    # mma: the weight tile is the MMA's row operand; x's M rows stacked R times fill its 16 columns
    R = 16 // M
    rows = jax.lax.broadcasted_iota(jnp.int32, (M, 1), 0)
    s_col = s[0] if M == 1 else jnp.where(rows == 0, s[0], s[1])  # [M, 1]

    def body(i, acc):
        k0 = i * bk
        x = rounded(x_ref[:, pl.ds(k0, bk)], s_col)
        x16 = jnp.broadcast_to(x[None], (R, M, bk)).reshape(R * M, bk)
        return acc + mma(wt(k0), x16, trans_b=True)

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((BN, 16), f32))  # column c is row c % M's product
    y = acc.reshape(BN, R, M).max(axis=1).T  # the copies are bitwise equal: max keeps them exact
    y = ((y * s_col) * (ws if per_tensor else ws[None, :])).astype(o_ref.dtype)
    if has_residual:
        y = (res_ref[...].astype(f32) + y.astype(f32)).astype(o_ref.dtype)
    o_ref[...] = y


_STATIC = ("min_scale", "block_n", "block_k", "variant", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_gemv_kernel(
    x,
    w,
    w_scale,
    residual=None,
    *,
    min_scale,
    block_n=None,
    block_k=None,
    variant=None,
    num_warps=None,
    num_stages=None,
    interpret=False,
):
    """x [M, K] (16-bit, M <= MAX_ROWS), w [N, K] float8_e4m3fn, w_scale [N] or [1] (per tensor) float32, residual
    [M, N] or None -> [M, N] in x's dtype (see the module docstring). Tuning (static): block_n, block_k, variant
    ("fma" | "mma"), num_warps, num_stages."""
    M, K = x.shape
    N = w.shape[0]
    if not supported(x.dtype, M, N, K) or w.shape[1] != K or jnp.dtype(w.dtype) != jnp.dtype(FP8):
        raise ValueError(f"fp8_gemv_kernel does not take x {x.dtype} {x.shape} with w {w.dtype} {w.shape}")
    t = default_tiling(N, K)
    BN, BK = block_n or t["block_n"], block_k or t["block_k"]
    variant = variant or t["variant"]
    if variant not in VARIANTS or N % BN or K % BK:
        raise ValueError(f"variant={variant!r} must be one of {VARIANTS}, N={N} a multiple of {BN}, K={K} of {BK}")
    per_tensor = w_scale.size == 1
    ws = jnp.asarray(w_scale, jnp.float32).reshape(-1)
    in_specs = [
        pl.BlockSpec((M, K), lambda n: (0, 0)),
        pl.BlockSpec((BN, K), lambda n: (n, 0)),
        pl.BlockSpec((1,), lambda n: (0,)) if per_tensor else pl.BlockSpec((BN,), lambda n: (n,)),
    ]
    args = [x, w, ws]
    if residual is not None:
        in_specs.append(pl.BlockSpec((M, BN), lambda n: (0, n)))
        args.append(residual.astype(x.dtype))
    kernel = functools.partial(
        _kernel,
        nk=K // BK,
        bk=BK,
        min_scale=min_scale,
        per_tensor=per_tensor,
        has_residual=residual is not None,
        variant=variant,
    )
    return pl.pallas_call(
        kernel,
        grid=(N // BN,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((M, BN), lambda n: (0, n)),
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        interpret=interpret,
        compiler_params=triton_params(num_warps or t["num_warps"], num_stages or t["num_stages"]),
        name=f"fp8_gemv_{variant}_{BN=}_{BK=}" + ("_res" if residual is not None else ""),
    )(*args)
