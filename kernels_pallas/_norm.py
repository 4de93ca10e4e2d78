"""Residual add + RMSNorm in one launch (Pallas, Triton lowering): x_new = x + delta, h = norm(x_new) * w.

Grid (T,): a program owns one token's row of D. Rounds as jaxllm.models.decoder.rms_norm (and HF) do: the
sum in the activation dtype, the normalization in float32, cast back, then the weight multiply in the
activation dtype. XLA makes two to three kernels per norm of this (the add, the reduction, the scaling);
at batch 1 each is launch-bound (~2-3 us on an H100), and a decoder layer has two norms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import triton_params


def _add_rms_norm_kernel(x_ref, d_ref, w_ref, x_out, h_out, *, eps):
    x = x_ref[...] + d_ref[...]
    x_out[...] = x
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32) + eps)
    h_out[...] = w_ref[...] * (x32 * inv).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def add_rms_norm_kernel(x, delta, weight, *, eps, interpret=False, num_warps=4):
    """x, delta: [T, D]; weight: [D] -> (x + delta, rms_norm(x + delta) * weight). D a power of two."""
    T, D = x.shape
    row = pl.BlockSpec((None, D), lambda t: (t, 0))
    return pl.pallas_call(
        functools.partial(_add_rms_norm_kernel, eps=eps),
        grid=(T,),
        in_specs=[row, row, pl.BlockSpec((D,), lambda t: (0,))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((T, D), x.dtype), jax.ShapeDtypeStruct((T, D), x.dtype)],
        interpret=interpret,
        compiler_params=triton_params(num_warps, 1),
        name="add_rms_norm",
    )(x, delta, weight.astype(x.dtype))
