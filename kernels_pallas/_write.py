"""KV write: the new tokens' k and v ([T, K, H]) into their cache slots, in place (Pallas, Triton lowering).

Grid (T,): a program owns one token and writes its K rows of H into both caches at
[h, slot // S, slot % S, :] (256 contiguous bytes per head for bf16 H=128). The page arrays are aliased
input -> output, so nothing but the new rows is written; a padding token (slot -1) writes nothing. fp8
caches are quantized on the way in (x / scale, clipped to the format's range), as reference.write_kv does.

One launch writes K and V; XLA's scatter needs one per cache and, for [K, P, S, H] pages, runs far under
bandwidth (bench/KERNELS_NOTES.md has both measured).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import triton_params
from .reference import quantize


def _write_kernel(slots_ref, scale_ref, k_ref, v_ref, _k_in, _v_in, k_out, v_out, *, page_size):
    t = pl.program_id(0)
    slot = slots_ref[t]
    num_heads = k_ref.shape[0]

    @pl.when(slot >= 0)
    def _():
        page, off = slot // page_size, slot % page_size
        k_scale, v_scale = scale_ref[0], scale_ref[1]
        for h in range(num_heads):  # static: one row of H per kv head
            k_out[h, page, off, :] = quantize(k_ref[h, :], k_scale, k_out.dtype)
            v_out[h, page, off, :] = quantize(v_ref[h, :], v_scale, v_out.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def write_kv_kernel(k_pages, v_pages, k, v, slot_mapping, *, k_scale=1.0, v_scale=1.0, interpret=False,
                    num_warps=1):
    """Same contract as reference.write_kv: k, v [T, K, H]; slot_mapping [T] (-1 = padding, dropped).
    In place only where the caller's pages are donated (the engine's step donates the KV cache)."""
    K, P, S, H = k_pages.shape
    T = k.shape[0]
    scales = jnp.stack([jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)])
    pages = pl.BlockSpec((K, P, S, H), lambda t: (0, 0, 0, 0))
    row = pl.BlockSpec((None, K, H), lambda t: (t, 0, 0))

    return pl.pallas_call(
        functools.partial(_write_kernel, page_size=S),
        grid=(T,),
        in_specs=[pl.BlockSpec((T,), lambda t: (0,)), pl.BlockSpec((2,), lambda t: (0,)), row, row, pages, pages],
        out_specs=[pages, pages],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={4: 0, 5: 1},
        interpret=interpret,
        compiler_params=triton_params(num_warps, 1),
        name=f"write_kv_{S=}",
    )(slot_mapping.astype(jnp.int32), scales, k, v, k_pages, v_pages)
