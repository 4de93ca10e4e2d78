"""RMSNorm, and the residual add + RMSNorm of a decode step's few rows in one Pallas (Triton) launch.

    rms_norm(x, weight, eps) / gemma_rms_norm(x, weight, eps): HF's roundings (the models' norms; pure jnp)
    add_rms_norm(x [T, D], delta, weight [D], *, eps, plus_one=False, interpret=False) -> (r [T, D], h [T, D])
        r = x + delta in x's dtype, h = the norm of r (plus_one: Gemma's (1 + weight)). delta is [T, D], or float32
        split-K partials [S, T, D] (a quantized projection's, quant_matmul.split_k), summed and rounded to x's dtype
        first as the projection that made them rounds its output. The kernel for rows add_rms_norm_supported takes,
        on a GPU or in interpret mode; else add_rms_norm_ref, the same function in XLA.

Why: in the batch-1 decode step each layer's two residual adds and two norms were four XLA kernels of ~1.5 us each
on an H100 (bench/results/long32k_h100_83092d7_grid.json's trace: loop_add_fusion, then the norm's fusion, twice a
layer), latency-bound on 8 KB rows. The decoder carries each block's output as a pending delta and adds it here, in
the launch of the norm that reads the sum (jaxllm/models/decoder.py).

Kernel: grid (T,), one program of 16 warps a row, D in power-of-two chunks held in registers: every load is issued
first (x, the partials, the weight), then the sums and r^2, then r and h are stored. Rows of up to MAX_ROWS only: a program reads its
whole row alone, which suits a few rows, not a prefill's thousands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import on_gpu, triton_params

MAX_ROWS = 16
MAX_CHUNK = 4096  # elements of D per chunk (D is cut into D / chunk of them, each a power of two)


def rms_norm(x, weight, eps):
    # Same rounding as HF: normalise in float32, cast back, then scale in the weight dtype.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def gemma_rms_norm(x, weight, eps):
    # Gemma: normalise and scale by (1 + w) in float32, rounded once (HF's Gemma2RMSNorm / Gemma3RMSNorm).
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _delta(x, delta):
    """delta in x's dtype: split-K partials [S, T, D] summed in float32 first."""
    return (delta.sum(axis=0) if delta.ndim == 3 else delta).astype(x.dtype)


def add_rms_norm_ref(x, delta, weight, *, eps, plus_one=False):
    r = x + _delta(x, delta)
    return r, (gemma_rms_norm if plus_one else rms_norm)(r, weight, eps)


def _chunk(d: int) -> int:
    return next(c for c in (MAX_CHUNK, 2048, 1024, 512, 256, 128, 64, 32) if d % c == 0)


def add_rms_norm_supported(x, delta) -> bool:
    """Inputs the kernel takes: x [T, D] 16-bit or float32 with T <= MAX_ROWS and D a multiple of 32; delta [T, D]
    or float32 partials [S, T, D]."""
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] % 32:
        return False
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return False
    return delta.shape[-2:] == x.shape and (delta.ndim == 2 or (delta.ndim == 3 and delta.dtype == jnp.float32))


def _kernel(x_ref, d_ref, w_ref, r_ref, h_ref, *, chunk, parts, eps, plus_one):
    f32 = jnp.float32
    D = x_ref.shape[-1]
    cuts = [pl.ds(c * chunk, chunk) for c in range(D // chunk)]
    # Every load first, then the math, then every store: loads after a store could not be moved above it (the
    # refs may alias), and each chunk would wait a full memory latency of its own.
    xs = [x_ref[cols] for cols in cuts]
    ds = [[d_ref[s, cols] for s in range(parts)] if parts else [d_ref[cols]] for cols in cuts]
    ws = [w_ref[cols] for cols in cuts]
    rs, sq = [], jnp.zeros((chunk,), f32)
    for x, d in zip(xs, ds):
        total = d[0]
        for p in d[1:]:  # float32 partials, summed then rounded as the projection's output would be
            total = total + p
        r = (x.astype(f32) + total.astype(r_ref.dtype).astype(f32)).astype(r_ref.dtype)
        rs.append(r)
        sq = sq + r.astype(f32) * r.astype(f32)
    inv = jax.lax.rsqrt(jnp.sum(sq) / D + eps)
    for cols, r, w in zip(cuts, rs, ws):
        r_ref[cols] = r
        if plus_one:
            h_ref[cols] = (r.astype(f32) * inv * (1.0 + w.astype(f32))).astype(h_ref.dtype)
        else:
            h_ref[cols] = w * (r.astype(f32) * inv).astype(r_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "plus_one", "num_warps", "interpret"))
def add_rms_norm_kernel(x, delta, weight, *, eps, plus_one=False, num_warps=16, interpret=False):
    """See the module docstring: x [T, D], delta [T, D] or float32 partials [S, T, D], weight [D]."""
    if not add_rms_norm_supported(x, delta) or weight.shape != x.shape[1:]:
        raise ValueError(
            f"add_rms_norm_kernel does not take x {x.dtype} {x.shape}, delta {delta.shape}, weight {weight.shape}"
        )
    T, D = x.shape
    parts = delta.shape[0] if delta.ndim == 3 else 0
    row = pl.BlockSpec((None, D), lambda t: (t, 0))
    d_spec = pl.BlockSpec((parts, None, D), lambda t: (0, t, 0)) if parts else row
    kernel = functools.partial(_kernel, chunk=_chunk(D), parts=parts, eps=float(eps), plus_one=plus_one)
    h_dtype = x.dtype if plus_one else jnp.result_type(weight.dtype, x.dtype)
    return pl.pallas_call(
        kernel,
        grid=(T,),
        in_specs=[row, d_spec, pl.BlockSpec((D,), lambda t: (0,))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((T, D), x.dtype), jax.ShapeDtypeStruct((T, D), h_dtype)],
        interpret=interpret,
        compiler_params=triton_params(num_warps, 1),
        name=f"add_rms_norm_S_{parts}",
    )(x, delta, weight)


def add_rms_norm(x, delta, weight, *, eps, plus_one=False, interpret=False):
    """See the module docstring."""
    if (interpret or on_gpu()) and add_rms_norm_supported(x, delta) and weight.shape == x.shape[1:]:
        r, h = add_rms_norm_kernel(x, delta, weight, eps=eps, plus_one=plus_one, interpret=interpret)
        return r, h
    return add_rms_norm_ref(x, delta, weight, eps=eps, plus_one=plus_one)


def add_delta(x, delta):
    """x + delta in x's dtype (delta [T, D], or float32 split-K partials [S, T, D]): add_rms_norm's r alone."""
    return x + _delta(x, delta)
