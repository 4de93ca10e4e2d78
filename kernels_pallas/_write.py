"""KV write: the new tokens' k and v ([T, K, H]) into their cache slots, in place (Pallas, Triton lowering);
and the same write fused with what comes before it in a layer (qkv_write_kv_kernel, below).

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

from ._common import sum_partials, triton_params
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
def write_kv_kernel(k_pages, v_pages, k, v, slot_mapping, *, k_scale=1.0, v_scale=1.0, interpret=False, num_warps=1):
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
        out_shape=[
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ],
        input_output_aliases={4: 0, 5: 1},
        interpret=interpret,
        compiler_params=triton_params(num_warps, 1),
        name=f"write_kv_{S=}",
    )(slot_mapping.astype(jnp.int32), scales, k, v, k_pages, v_pages)


def _qkv_write_kernel(
    slots_ref, pos_ref, freq_ref, scale_ref, qkv_ref, _k_in, _v_in, q_out, k_out, v_out, *, page_size, group, rope, dt
):
    """Program (t, h): token t, kv head h. Its G query rows -> q_out (rotated); its k (rotated) and v rows
    -> their cache slot. Rows are read and written as two halves, which is what rotate-half RoPE pairs.
    qkv_ref is [T, K, G + 2, H] in dt, or split-K partials [S, T, K, G + 2, H] (f32) summed here."""
    t, h = pl.program_id(0), pl.program_id(1)
    H = qkv_ref.shape[-1]
    half = H // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    if rope:
        freqs = pos_ref[t].astype(jnp.float32) * freq_ref[...]  # [H / 2]
        cos, sin = jnp.cos(freqs).astype(dt), jnp.sin(freqs).astype(dt)

    def load(row, part):
        if len(qkv_ref.shape) == 4:
            return qkv_ref[t, h, row, part]
        return sum_partials([qkv_ref[s, t, h, row, part] for s in range(qkv_ref.shape[0])], dt)  # a few splits

    def rotated(row):  # rounded to the input dtype after every op, as reference.apply_rope is
        x1, x2 = load(row, lo), load(row, hi)
        if not rope:
            return x1, x2
        return (x1 * cos).astype(dt) - (x2 * sin).astype(dt), (x2 * cos).astype(dt) + (x1 * sin).astype(dt)

    for g in range(group):  # static
        r1, r2 = rotated(g)
        q_out[t, h * group + g, lo] = r1.astype(q_out.dtype)
        q_out[t, h * group + g, hi] = r2.astype(q_out.dtype)
    slot = slots_ref[t]

    @pl.when(slot >= 0)
    def _():
        page, off = slot // page_size, slot % page_size
        k_scale, v_scale = scale_ref[0], scale_ref[1]
        k1, k2 = rotated(group)
        k_out[h, page, off, lo] = quantize(k1, k_scale, k_out.dtype)
        k_out[h, page, off, hi] = quantize(k2, k_scale, k_out.dtype)
        v_out[h, page, off, lo] = quantize(load(group + 1, lo), v_scale, v_out.dtype)
        v_out[h, page, off, hi] = quantize(load(group + 1, hi), v_scale, v_out.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "dtype"))
def qkv_write_kv_kernel(
    qkv,
    positions,
    inv_freq,
    k_pages,
    v_pages,
    slot_mapping,
    *,
    k_scale=1.0,
    v_scale=1.0,
    dtype=None,
    interpret=False,
    num_warps=1,
):
    """Same contract as reference.qkv_write_kv: one launch splits the fused projection's output into q,
    applies RoPE to q and k, and writes k and v into their slots (in place where the pages are donated).
    Replaces XLA's RoPE fusions for q and k, the slice for v and the separate write. With split-K partials
    (qkv [S, T, K, G + 2, H], float32) it also replaces the reduction kernel after XLA's split-K GEMM."""
    T, K, G2, H = qkv.shape[-4:]
    G = G2 - 2
    _, P, S, _ = k_pages.shape
    dt = jnp.dtype(qkv.dtype if qkv.ndim == 4 else dtype)
    rope = inv_freq is not None
    freq = jnp.asarray(inv_freq if rope else jnp.zeros((H // 2,)), jnp.float32)
    scales = jnp.stack([jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)])
    full = lambda shape: pl.BlockSpec(shape, lambda t, h: (0,) * len(shape))  # noqa: E731
    q, k_pages, v_pages = pl.pallas_call(
        functools.partial(_qkv_write_kernel, page_size=S, group=G, rope=rope, dt=dt),
        grid=(T, K),
        in_specs=[
            full((T,)),
            full((T,)),
            full((H // 2,)),
            full((2,)),
            full(qkv.shape),
            full(k_pages.shape),
            full(v_pages.shape),
        ],
        out_specs=[full((T, K * G, H)), full(k_pages.shape), full(v_pages.shape)],
        out_shape=[
            jax.ShapeDtypeStruct((T, K * G, H), dt),
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ],
        input_output_aliases={5: 1, 6: 2},
        interpret=interpret,
        compiler_params=triton_params(num_warps, 1),
        name=f"qkv_write_kv_{S=}_{G=}" + ("" if qkv.ndim == 4 else f"_splits={qkv.shape[0]}"),
    )(slot_mapping.astype(jnp.int32), positions.astype(jnp.int32), freq, scales, qkv, k_pages, v_pages)
    return q, k_pages, v_pages
