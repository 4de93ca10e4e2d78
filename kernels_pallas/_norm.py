"""Split-K reduction + residual add + RMSNorm in one launch (Pallas, Triton lowering).

For the decoder's small token batches (decode steps) the o and down projections are computed as split-K
partials [S, T, D] (float32) by one batched XLA GEMM (decoder.py). XLA's own split-K GEMM needs a
reduction kernel after it (fused with the residual add), and the RMSNorm after the add is one more
kernel: its row reduction cannot join the split reduction's fusion. Here one program per token row does
all three: sum the partials, round to the model dtype (+ bias), add the residual, then normalise. At
batch 1 each of those kernels is ~1.7 us on an H100 whatever its size, so this saves one launch per
projection (bench/KERNELS_NOTES.md has the measurement).

Roundings are those of reference.add_rms_norm (the unsplit projection in the model dtype, then the add).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import triton_params


def _add_norm_kernel(parts_ref, x_ref, w_ref, *rest, eps, has_bias, block_load):
    if has_bias:
        b_ref, x_out, h_out = rest
    else:
        (x_out, h_out), b_ref = rest, None
    dt = x_ref.dtype
    if block_load:  # one [S, D] load: every split's bytes in flight at once
        acc = parts_ref[...].sum(axis=0)
    else:
        acc = parts_ref[0, :]
        for s in range(1, parts_ref.shape[0]):  # static: a handful of splits
            acc = acc + parts_ref[s, :]
    y = acc.astype(dt)
    if has_bias:
        y = (y.astype(jnp.float32) + b_ref[...].astype(jnp.float32)).astype(dt)
    x = (x_ref[...].astype(jnp.float32) + y.astype(jnp.float32)).astype(dt)
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32) + eps)
    x_out[...] = x
    h_out[...] = (w_ref[...].astype(jnp.float32) * (x32 * r).astype(dt).astype(jnp.float32)).astype(h_out.dtype)


def supported(parts, x) -> bool:
    D = x.shape[-1]
    return x.ndim == 2 and parts.ndim == 3 and D >= 16 and D & (D - 1) == 0


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps", "block_load"))
def add_rms_norm_kernel(parts, x, weight, bias=None, *, eps, interpret=False, num_warps=8, block_load=False):
    """Same contract as reference.add_rms_norm: parts [S, T, D] f32, x [T, D], weight [D] (bias [D] | None)
    -> (x + y, rms_norm(x + y) * weight), both in x's dtype. Grid (T,)."""
    S, T, D = parts.shape
    has_bias = bias is not None
    vec = pl.BlockSpec((D,), lambda t: (0,))
    row = pl.BlockSpec((None, D), lambda t: (t, 0))
    args = [parts, x, weight] + ([bias] if has_bias else [])
    return pl.pallas_call(
        functools.partial(_add_norm_kernel, eps=eps, has_bias=has_bias, block_load=block_load),
        grid=(T,),
        in_specs=[pl.BlockSpec((S, None, D), lambda t: (0, t, 0)), row, vec] + ([vec] if has_bias else []),
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, jnp.result_type(weight, x))],
        interpret=interpret,
        compiler_params=triton_params(num_warps, 1),
        name=f"add_rms_norm_{S=}",
    )(*args)
