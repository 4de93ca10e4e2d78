"""RMSNorm rounded to e4m3 with dynamic per-token scales, in one pass (Pallas, Triton lowering): the input of an fp8
W8A8 projection (qkv, gate / up) straight from the residual stream (quant.rms_norm_fp8).

    n = x * rsqrt(mean(x^2) + eps) in float32, h = w * n rounded to x's dtype (HF's RMSNorm; plus_one: n * (1 + w)
    in float32, rounded once: Gemma's), s = max(max|h| / 448, min_scale) per row, xq = round_e4m3(clip(h / s, +-448))

One program per row of x [T, D] (16-bit; 16 warps by default), the row's values held in registers in tiles of
`block` columns from the load to the stores (H100, 8B widths, 500 rows: 4.0 us a call in the engine's decode steps,
bench/results/throughput_fp8_h100_d3d7775_prof.json). XLA runs the norm and the token quantization of its output
as separate fusions, which write h and read it back twice (the row's amax, then the rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import triton_params
from ._silu_mul_fp8 import FP8, FP8_MAX, block_for

MAX_D = 16384  # a row's float32 values in registers: D / (32 * num_warps) values a thread


def supported(dtype, d: int) -> bool:
    """16-bit x and D a multiple of 128, up to MAX_D."""
    ok_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return ok_dtype and d <= MAX_D and block_for(d) is not None


def _kernel(x_ref, w_ref, xq_ref, s_ref, *, block, eps, min_scale, plus_one):
    D = x_ref.shape[-1]
    cols = [pl.ds(i * block, block) for i in range(D // block)]
    xs = [x_ref[c].astype(jnp.float32) for c in cols]
    store_e4m3(
        normed_tiles(xs, w_ref, cols, eps=eps, dtype=x_ref.dtype, plus_one=plus_one), cols, xq_ref, s_ref, min_scale
    )


def store_e4m3(hs, cols, xq_ref, s_ref, min_scale):
    """One row's values, held as tiles hs (columns cols), stored as e4m3 with their token scale: s = max(max|h| / 448,
    min_scale) into s_ref, round_e4m3(clip(h / s, +-448)) into xq_ref (quantize_activations' "token"). Shared with
    _add_rms_norm's kernel."""
    hs = [h.astype(jnp.float32) for h in hs]
    s = jnp.maximum(functools.reduce(jnp.maximum, [jnp.abs(h) for h in hs]).max() / FP8_MAX, min_scale)
    for h, c in zip(hs, cols, strict=True):
        xq_ref[c] = jnp.clip(h / s, -FP8_MAX, FP8_MAX).astype(FP8)
    s_ref[...] = jnp.full(s_ref.shape, s, jnp.float32)


def normed_tiles(xs, w_ref, cols, *, eps, dtype, plus_one):
    """The RMSNorm of one row held as float32 tiles xs (columns cols of w_ref): n = x * rsqrt(mean(x^2) + eps) in
    float32; HF: n rounded to dtype, times w in w's and dtype's common dtype; plus_one (Gemma): n * (1 + w) in float32,
    rounded once to dtype. Shared with _add_rms_norm's kernel."""
    f32 = jnp.float32
    inv = jax.lax.rsqrt(sum(jnp.sum(x * x) for x in xs) / sum(x.size for x in xs) + eps)
    if plus_one:
        return [(x * inv * (1.0 + w_ref[c].astype(f32))).astype(dtype) for x, c in zip(xs, cols, strict=True)]
    return [w_ref[c] * (x * inv).astype(dtype) for x, c in zip(xs, cols, strict=True)]


_STATIC = ("eps", "min_scale", "plus_one", "block", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def rms_norm_fp8_kernel(
    x, weight, *, eps, min_scale, plus_one=False, block=None, num_warps=16, num_stages=2, interpret=False
):
    """x [T, D] (16-bit), weight [D] (16-bit or float32) -> (xq [T, D] float8_e4m3fn, scales [T, 1] float32).
    Tuning (static): block (columns a tile, block_for(D) by default), num_warps, num_stages."""
    T, D = x.shape
    if not supported(x.dtype, D) or weight.shape != (D,):
        raise ValueError(
            f"rms_norm_fp8_kernel takes 16-bit [T, D] with D a multiple of 128 up to {MAX_D} and weight [D]; got "
            f"{x.dtype} {x.shape}, weight {weight.shape}"
        )
    block = block or block_for(D)
    return pl.pallas_call(
        functools.partial(_kernel, block=block, eps=eps, min_scale=min_scale, plus_one=plus_one),
        grid=(T,),
        in_specs=[pl.BlockSpec((None, D), lambda t: (t, 0)), pl.BlockSpec((D,), lambda t: (0,))],
        out_specs=[pl.BlockSpec((None, D), lambda t: (t, 0)), pl.BlockSpec((None, 1), lambda t: (t, 0))],
        out_shape=[jax.ShapeDtypeStruct((T, D), FP8), jax.ShapeDtypeStruct((T, 1), jnp.float32)],
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"rms_norm_fp8_{block=}",
    )(x, weight)
