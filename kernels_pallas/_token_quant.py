"""Per-token fp8 quantization of a GEMM's activations in one pass (Pallas, Triton lowering): quant.quantize_activations'
dynamic per-token function for the fp8 W8A8 GEMMs of more than two rows (fp8_gemv does it inside the GEMM for 1-2).

    s_t = max(max_k |x[t, k]| / 448, min_scale),  xq[t] = e4m3(clip(x[t] / s_t, -448, 448))

One program per row: the row's chunks are read once for the elementwise max (one row reduction at the end), then read
again (from L1 / L2) for the division, rounding and the e4m3 store. XLA computes the same as a reduce fusion and a
convert fusion, each reading x from memory: at the throughput workload's 500 rows (H100 trace, 954e374) the pair
took 8-10 us for the 4096-wide inputs, and the down projection's input, fused with silu * up into the reduce, 35 us
plus a 9.6 us convert (bench/KERNELS_NOTES.md "Measured in stop 48").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import triton_params

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
MAX_CHUNK = 2048


def chunk(d: int) -> int:
    """The columns a step reads: the largest power of two up to MAX_CHUNK dividing d (0: none of at least 128)."""
    c = MAX_CHUNK
    while c >= 128:
        if d % c == 0:
            return c
        c //= 2
    return 0


def supported(x_dtype, d: int) -> bool:
    return jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and chunk(d) > 0


def _kernel(x_ref, q_ref, s_ref, *, c, min_scale):
    D = x_ref.shape[-1]
    f32 = jnp.float32
    amax = jnp.abs(x_ref[:, pl.ds(0, c)].astype(f32))
    for i in range(1, D // c):
        amax = jnp.maximum(amax, jnp.abs(x_ref[:, pl.ds(i * c, c)].astype(f32)))
    s = jnp.maximum(amax.max(axis=1, keepdims=True) / FP8_MAX, min_scale)  # [1, 1]
    for i in range(D // c):
        v = x_ref[:, pl.ds(i * c, c)].astype(f32) / s
        q_ref[:, pl.ds(i * c, c)] = jnp.clip(v, -FP8_MAX, FP8_MAX).astype(FP8)
    s_ref[...] = s


@functools.partial(jax.jit, static_argnames=("min_scale", "num_warps", "interpret"))
def token_quant_kernel(x, *, min_scale, num_warps=8, interpret=False):
    """x [T, D] (16-bit; supported) -> (xq [T, D] float8_e4m3fn, scales [T, 1] float32)."""
    T, D = x.shape
    if not supported(x.dtype, D):
        raise ValueError(f"token_quant_kernel takes 16-bit x with a power-of-two chunk of >= 128 dividing D; got {x.dtype} {x.shape}")
    c = chunk(D)
    return pl.pallas_call(
        functools.partial(_kernel, c=c, min_scale=min_scale),
        grid=(T,),
        in_specs=[pl.BlockSpec((1, D), lambda t: (t, 0))],
        out_specs=[pl.BlockSpec((1, D), lambda t: (t, 0)), pl.BlockSpec((1, 1), lambda t: (t, 0))],
        out_shape=[jax.ShapeDtypeStruct((T, D), FP8), jax.ShapeDtypeStruct((T, 1), jnp.float32)],
        interpret=interpret,
        compiler_params=triton_params(num_warps, 1),
        name=f"token_quant_fp8_{c=}",
    )(x)
