"""The fused qkv projection of a small batch, its RoPE and its KV write in one launch (decode steps).

At batch 1 the qkv projection is weight-bandwidth-bound: XLA runs it as a split-K GEMM, a reduce of the
partials, and then qkv_write_kv_kernel rotates q and k and writes k and v (~19 + 1.6 + 3.3 us per layer
on an H100 for Llama-3-8B). Here grid (K, G + 2): a program owns one kv head's q head (or its k, or its v):
it streams that [D, H] column block of w_qkv once, for all T tokens (T <= 16: the rows are stacked to the
MMA's 16), then rotates and stores q, or rotates k / takes v and writes each token's row into its cache
slot. One program per (kv head, row) streamed the 50 MB of Llama-3-8B's w_qkv in 20.3 us, like XLA's GEMM
plus its reduce (bench/gemv_probe.py), so the two small kernels after it are what this saves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import mma, triton_params
from .reference import quantize

MAX_TOKENS = 16  # the MMA's rows; larger batches take XLA's GEMM


def _kernel(slots_ref, pos_ref, freq_ref, scale_ref, h_ref, w_ref, *rest, page_size, group, rope, has_bias,
            block_d):
    if has_bias:  # the pages' input refs (aliased to k_out / v_out) come before the outputs
        b_ref, _, _, q_out, k_out, v_out = rest
    else:
        b_ref, (_, _, q_out, k_out, v_out) = None, rest
    kh, c = pl.program_id(0), pl.program_id(1)
    T, D = h_ref.shape
    H = w_ref.shape[-1]
    half = H // 2
    copies = MAX_TOKENS // T  # stacked copies of the T rows (bitwise equal results; max() folds them)
    dt = h_ref.dtype
    lo, hi = pl.ds(0, half), pl.ds(half, half)

    def body(i, acc):
        d = pl.ds(pl.multiple_of(i * block_d, block_d), block_d)
        x = h_ref[:, d]
        if copies > 1:
            x = jnp.broadcast_to(x[None], (copies, T, block_d)).reshape(MAX_TOKENS, block_d)
        return acc[0] + mma(x, w_ref[d, lo]), acc[1] + mma(x, w_ref[d, hi])

    zero = jnp.zeros((MAX_TOKENS, half), jnp.float32)
    y1, y2 = jax.lax.fori_loop(0, D // block_d, body, (zero, zero))
    if copies > 1:
        y1, y2 = (y.reshape(copies, T, half).max(0) for y in (y1, y2))
    y1, y2 = y1.astype(dt), y2.astype(dt)  # rounded as XLA's GEMM output is
    if has_bias:
        y1, y2 = y1 + b_ref[lo][None, :], y2 + b_ref[hi][None, :]

    def rotated():  # rounded to the input dtype after every op, as reference.apply_rope is
        if not rope:
            return y1, y2
        freqs = pos_ref[...].astype(jnp.float32)[:, None] * freq_ref[...][None, :]  # [T, H / 2]
        cos, sin = jnp.cos(freqs).astype(dt), jnp.sin(freqs).astype(dt)
        return (y1 * cos).astype(dt) - (y2 * sin).astype(dt), (y2 * cos).astype(dt) + (y1 * sin).astype(dt)

    @pl.when(c < group)
    def _():
        r1, r2 = rotated()
        q_out[:, kh * group + c, lo] = r1.astype(q_out.dtype)
        q_out[:, kh * group + c, hi] = r2.astype(q_out.dtype)

    def write(out_ref, x1, x2, scale):
        rows = jnp.arange(T, dtype=jnp.int32)[:, None]
        for t in range(T):  # static: each token's row into its slot (a one-hot sum picks row t)
            slot = slots_ref[t]

            @pl.when(slot >= 0)
            def _():
                page, off = slot // page_size, slot % page_size
                out_ref[kh, page, off, lo] = quantize(jnp.where(rows == t, x1, 0).sum(0), scale, out_ref.dtype)
                out_ref[kh, page, off, hi] = quantize(jnp.where(rows == t, x2, 0).sum(0), scale, out_ref.dtype)

    @pl.when(c == group)
    def _():
        write(k_out, *rotated(), scale_ref[0])

    @pl.when(c == group + 1)
    def _():
        write(v_out, y1, y2, scale_ref[1])


def supported(h, w_qkv) -> bool:
    T, D = h.shape
    H = w_qkv.shape[-1]
    return T <= MAX_TOKENS and MAX_TOKENS % T == 0 and H in (64, 128, 256) and D % min(D, 256) == 0 and D >= 16


@functools.partial(jax.jit, static_argnames=("interpret", "block_d", "num_warps", "num_stages"))
def qkv_proj_write_kv_kernel(h, w_qkv, b_qkv, positions, inv_freq, k_pages, v_pages, slot_mapping, *, k_scale=1.0,
                             v_scale=1.0, interpret=False, block_d=256, num_warps=4, num_stages=3):
    """h [T, D] (T <= 16 dividing 16), w_qkv [D, K, G + 2, H], b_qkv [K, G + 2, H] | None -> the same
    (q [T, K * G, H], k_pages, v_pages) as reference.qkv_write_kv(einsum(h, w_qkv) + b_qkv, ...)."""
    T, D = h.shape
    _, K, G2, H = w_qkv.shape
    G = G2 - 2
    _, P, S, _ = k_pages.shape
    block_d = min(block_d, D)
    rope = inv_freq is not None
    freq = jnp.asarray(inv_freq if rope else jnp.zeros((H // 2,)), jnp.float32)
    scales = jnp.stack([jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)])
    full = lambda shape: pl.BlockSpec(shape, lambda k, c: (0,) * len(shape))  # noqa: E731
    in_specs = [full((T,)), full((T,)), full((H // 2,)), full((2,)), full((T, D)),
                pl.BlockSpec((D, None, None, H), lambda k, c: (0, k, c, 0))]
    args = [slot_mapping.astype(jnp.int32), positions.astype(jnp.int32), freq, scales, h, w_qkv]
    if b_qkv is not None:
        in_specs.append(pl.BlockSpec((None, None, H), lambda k, c: (k, c, 0)))
        args.append(b_qkv.astype(h.dtype))
    in_specs += [full(k_pages.shape), full(v_pages.shape)]
    args += [k_pages, v_pages]
    n = len(args)
    return pl.pallas_call(
        functools.partial(_kernel, page_size=S, group=G, rope=rope, has_bias=b_qkv is not None, block_d=block_d),
        grid=(K, G2),
        in_specs=in_specs,
        out_specs=[full((T, K * G, H)), full(k_pages.shape), full(v_pages.shape)],
        out_shape=[jax.ShapeDtypeStruct((T, K * G, H), h.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={n - 2: 1, n - 1: 2},
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"qkv_proj_write_kv_{S=}_{G=}",
    )(*args)
