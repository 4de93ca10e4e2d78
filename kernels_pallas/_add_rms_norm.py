"""The residual add of a projection's split-K partials and the RMSNorm after it, in one pass (Pallas, Triton lowering):
the decode step's o / down output into the residual stream and the next projection's input (quant.add_rms_norm).

    y = sum_s parts[s] (float32) rounded to x's dtype, r = x + y rounded to x's dtype (the new residual stream),
    n = r * rsqrt(mean(r^2) + eps) in float32, h = w * n rounded to x's dtype (HF's RMSNorm; plus_one: n * (1 + w)
    in float32, rounded once: Gemma's)

With min_scale (quant.add_rms_norm(fp8=True): an fp8 W8A8 projection of the decode step's 1-2 rows next), h is
stored in e4m3 with its token scale as _rms_norm_fp8 rounds it, and that projection's GEMV (_fp8_gemv) skips its own
pass over the row in every program.

One program per row of x [T, D], the row's values held in registers in tiles of `block` columns. XLA runs this as
three kernels when the partials come from a Pallas or Mosaic GPU call: the sum with the add, the norm's reduction,
and its scaling. Each kernel is a node of the step's CUDA graph, and each node costs the host time to update and
launch it every step, which at batch 1 is about what the device spends on the step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import triton_params
from ._rms_norm_fp8 import normed_tiles, store_e4m3
from ._silu_mul_fp8 import FP8, block_for

MAX_D = 16384  # a row's float32 values in registers: D / (32 * num_warps) values a thread
MAX_SPLITS = 32  # the partials' loads are unrolled


def supported(dtype, d: int, splits: int) -> bool:
    """16-bit x, D a multiple of 128 up to MAX_D, 1 to MAX_SPLITS partials."""
    ok_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return ok_dtype and d <= MAX_D and block_for(d) is not None and 1 <= splits <= MAX_SPLITS


def _kernel(x_ref, p_ref, w_ref, r_ref, *h_refs, block, eps, plus_one, min_scale):
    S, D = p_ref.shape
    f32, dtype = jnp.float32, x_ref.dtype
    cols = [pl.ds(i * block, block) for i in range(D // block)]
    rs = []
    for c in cols:
        y = p_ref[0, c]
        for s in range(1, S):
            y = y + p_ref[s, c]
        r = (x_ref[c].astype(f32) + y.astype(dtype).astype(f32)).astype(dtype)
        r_ref[c] = r
        rs.append(r.astype(f32))
    hs = normed_tiles(rs, w_ref, cols, eps=eps, dtype=dtype, plus_one=plus_one)
    if min_scale is not None:  # h in e4m3 with its token scale (the next projection's fp8 W8A8 input)
        store_e4m3(hs, cols, *h_refs, min_scale)
        return
    (h_ref,) = h_refs
    for h, c in zip(hs, cols, strict=True):
        h_ref[c] = h.astype(h_ref.dtype)


_STATIC = ("eps", "plus_one", "min_scale", "block", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def add_rms_norm_kernel(
    x,
    parts,
    weight,
    *,
    eps,
    plus_one=False,
    min_scale=None,
    block=None,
    num_warps=16,
    num_stages=2,
    interpret=False,
):
    """x [T, D] (16-bit), parts [S, T, D] float32, weight [D] -> (r [T, D] in x's dtype, h [T, D]: x's dtype, or
    weight's and x's common dtype without plus_one). min_scale given: h rounded to e4m3 with its token scales,
    (r, hq [T, D] float8_e4m3fn, sh [T, 1] float32) as _rms_norm_fp8 rounds it. Tuning (static): block (columns a
    tile, block_for(D) by default), num_warps, num_stages."""
    T, D = x.shape
    S = parts.shape[0]
    if not supported(x.dtype, D, S) or parts.shape != (S, T, D) or weight.shape != (D,):
        raise ValueError(
            f"add_rms_norm_kernel takes 16-bit x [T, D] with D a multiple of 128 up to {MAX_D}, float32 parts "
            f"[S <= {MAX_SPLITS}, T, D] and weight [D]; got x {x.dtype} {x.shape}, parts {parts.shape}, weight "
            f"{weight.shape}"
        )
    block = block or block_for(D)
    h_dtype = x.dtype if plus_one else jnp.result_type(weight.dtype, x.dtype)
    row = pl.BlockSpec((None, D), lambda t: (t, 0))
    out_specs, out_shape = [row, row], [jax.ShapeDtypeStruct((T, D), x.dtype), jax.ShapeDtypeStruct((T, D), h_dtype)]
    if min_scale is not None:
        out_specs.append(pl.BlockSpec((None, 1), lambda t: (t, 0)))
        out_shape[1:] = [jax.ShapeDtypeStruct((T, D), FP8), jax.ShapeDtypeStruct((T, 1), jnp.float32)]
    return pl.pallas_call(
        functools.partial(_kernel, block=block, eps=eps, plus_one=plus_one, min_scale=min_scale),
        grid=(T,),
        in_specs=[row, pl.BlockSpec((S, None, D), lambda t: (0, t, 0)), pl.BlockSpec((D,), lambda t: (0,))],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"add_rms_norm_S{S}_b{block}" + ("_e4m3" if min_scale is not None else ""),
    )(x, parts.astype(jnp.float32), weight)
