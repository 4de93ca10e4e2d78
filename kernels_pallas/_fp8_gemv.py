"""FP8 W8A8 GEMV for the decode step's few rows (Pallas, Triton lowering): quant.fp8_matmul's function for M <= 2
rows with the activation quantization inside the GEMM's kernel.

    y = (round_e4m3(x / s) @ W^T) * s * w_scale, s = max(max|x_m| / 448, FP8_MIN_SCALE) per row

Grid (N / BN, splits). A program owns BN output columns and one contiguous run of K (split-K):
1. the token scales: max |x_m| over x's whole row (a few KB, read from L2 by every program);
2. per K tile: x's [M, BK] slice divided by its scale, clipped to e4m3's range, rounded to e4m3 and widened to
   float16 (every e4m3 value is a float16: exact), its M rows stacked to the MMA's 16; the [BN, BK] e4m3 weight tile
   widened to float16 (one conversion per two values on sm_89+, exact); one MMA into a float32 [16, BN] accumulator
   (the products are exact, the sums float32);
3. the split's sums times the token scale, then the channel (or tensor) scale, written as float32 partials
   [splits, M, N]; the caller sums them in x's dtype's rounding (in a fusion with whatever comes next: a residual
   add, silu * up, or the fused qkv/RoPE/write kernel, which takes split-K partials).

What it replaces at the engine's batch-1 bucket (H100 trace, 8B fp8, b42ec8a): per projection an XLA reduce for
the token scales and a convert that writes the rounded x before XLA's GEMM (~1.2-1.6 us each). Measured on an H100
(bench/results/quant_kernels_h100_6755320_fp8_gemv.json, M 2, the call with its partials' sum): qkv 13.4, o 10.4,
gate_up 44.8, down 27.3 us against 15.3 / 12.3 / 46.9 / 27.4 for XLA's widened dot with the residual add; engine
batch-1 ITL 3.54 vs 3.65 ms (bench/KERNELS_NOTES.md "Measured in stop 47").
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
NUM_SMS = 132  # H100 / H200: sizes split-K statically


def supported(x_dtype, m: int, n: int, k: int) -> bool:
    """Inputs the kernel takes: 16-bit x of at most MAX_ROWS rows, N a multiple of 16, K of 128."""
    return (
        jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and 1 <= m <= MAX_ROWS
        and n % 16 == 0
        and k % 128 == 0
    )


def plan(n: int, k: int, block_n=None, block_k=None, splits=None):
    """Static (block_n, block_k, splits, tiles per split): ~4 programs an SM unless splits is given; 32 columns a
    program where that alone gives them (no split-K), else 64 and split-K. H100, M 2, 8B shapes, whole call incl.
    the partials' sum (bench/results/quant_kernels_h100_6755320_fp8_gemv.json): gate_up BN 32 one split 44.8 us vs
    BN 64 two splits 49.5; qkv / o / down BN 64 13.4 / 10.4 / 27.3 vs BN 32 13.9 / 11.1 / 28.4. H200, M 2, 16
    other tilings of qkv / o / down (bench/results/quant_kernels_fp8gemv_h200_dd2a220_sweep.json): none more than
    3 % faster than these."""
    bk = block_k or next(b for b in (256, 128) if k % b == 0)
    bn = block_n or (32 if n // 32 >= 4 * NUM_SMS and n % 32 == 0 else next(b for b in (64, 32, 16) if n % b == 0))
    tiles = k // bk
    if splits is None:
        splits = max(1, min(tiles, -(-4 * NUM_SMS // (n // bn))))
    per = -(-tiles // splits)
    return bn, bk, -(-tiles // per), per


def _kernel(x_ref, w_ref, ws_ref, o_ref, *, bk, per_split, tiles, min_scale, per_tensor):
    M, K = x_ref.shape
    f32, op = jnp.float32, jnp.float16

    # the token scales over the whole row: a static unroll of independent loads into an elementwise max, then one
    # row reduction (a reduction per tile costs a shared-memory round trip and a barrier each: ~0.5 us a tile)
    amax = jnp.abs(x_ref[:, pl.ds(0, bk)].astype(f32))
    for i in range(1, K // bk):
        amax = jnp.maximum(amax, jnp.abs(x_ref[:, pl.ds(i * bk, bk)].astype(f32)))
    s = jnp.maximum(amax.max(axis=1, keepdims=True) / FP8_MAX, min_scale)  # [M, 1]
    R = 16 // M

    def body(t, acc):
        k0 = t * bk
        v = jnp.clip(x_ref[:, pl.ds(k0, bk)].astype(f32) / s, -FP8_MAX, FP8_MAX)
        x = v.astype(FP8).astype(op)  # W8A8's x: rounded to e4m3 (exact in float16)
        x16 = jnp.broadcast_to(x[None], (R, M, bk)).reshape(16, bk)
        return acc + mma(x16, w_ref[:, pl.ds(k0, bk)].astype(op), trans_b=True)

    lo = pl.program_id(1) * per_split
    acc = jax.lax.fori_loop(lo, jnp.minimum(lo + per_split, tiles), body, jnp.zeros((16, o_ref.shape[-1]), f32))
    y = acc.reshape(R, M, -1).max(axis=0)  # the copies are bitwise equal: max keeps them exact
    ws = ws_ref[0] if per_tensor else ws_ref[...].astype(f32)[None, :]
    o_ref[...] = (y * s) * ws


_STATIC = ("min_scale", "block_n", "block_k", "splits", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_gemv_kernel(
    x,
    w,
    w_scale,
    *,
    min_scale,
    block_n=None,
    block_k=None,
    splits=None,
    num_warps=4,
    num_stages=3,
    interpret=False,
):
    """x [M, K] (16-bit, M <= MAX_ROWS), w [N, K] float8_e4m3fn, w_scale [N] or [1] (per tensor) float32 ->
    float32 partials [splits, M, N] whose sum is the scaled product (see the module docstring). Tuning (static):
    block_n, block_k, splits (plan()), num_warps, num_stages."""
    M, K = x.shape
    N = w.shape[0]
    if not supported(x.dtype, M, N, K) or w.shape[1] != K or jnp.dtype(w.dtype) != jnp.dtype(FP8):
        raise ValueError(f"fp8_gemv_kernel does not take x {x.dtype} {x.shape} with w {w.dtype} {w.shape}")
    BN, BK, S, per = plan(N, K, block_n, block_k, splits)
    if N % BN or K % BK:
        raise ValueError(f"N={N} must be a multiple of block_n={BN} and K={K} of block_k={BK}")
    per_tensor = w_scale.size == 1
    ws = jnp.asarray(w_scale, jnp.float32).reshape(-1)
    kernel = functools.partial(_kernel, bk=BK, per_split=per, tiles=K // BK, min_scale=min_scale, per_tensor=per_tensor)
    return pl.pallas_call(
        kernel,
        grid=(N // BN, S),
        in_specs=[
            pl.BlockSpec((M, K), lambda n, s: (0, 0)),
            pl.BlockSpec((BN, K), lambda n, s: (n, 0)),
            pl.BlockSpec((1,), lambda n, s: (0,)) if per_tensor else pl.BlockSpec((BN,), lambda n, s: (n,)),
        ],
        out_specs=pl.BlockSpec((None, M, BN), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((S, M, N), jnp.float32),
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"fp8_gemv_{BN=}_{BK=}_{S=}",
    )(x, w, ws)
