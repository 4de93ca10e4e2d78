"""The fused decode kernel's prologue, run inside each program: its query rows and the new token's k / v read
from the qkv projection's output, with RoPE applied in registers.

Separate from _decode because it is the one part of that kernel that reproduces another computation
(reference.apply_rope's roundings) rather than attention; _decode.fused_decode_attention_kernel is its caller.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from ._common import sum_partials


def fused_qkv(qkv_ref, pos_ref, freq_ref, b, h, *, Gq, group, rope, dt):
    """The fused path's inputs of program (b, h): the G query rows of kv head h ([Gq, H], rows past G repeat
    the last one) and the new token's k and v ([H]) from the projection's output qkv [T, K, G + 2, H] (or its
    split-K partials [S, T, K, G + 2, H], f32, summed and rounded to dt), RoPE applied to q and k with the
    same roundings as reference.apply_rope. Rotate-half reads each row twice, the second time with its
    halves swapped (a gather load), so no register tile has to be split or joined.

    Issues the loads now and returns finish() -> (q, k, v), the math: the kernel calls it once its first
    KV loads are issued, so these L2 reads overlap the block-table -> KV round trips instead of preceding
    them."""
    H = qkv_ref.shape[-1]
    half = H // 2
    cols = jnp.arange(H, dtype=jnp.int32)
    swapped = jnp.where(cols < half, cols + half, cols - half)

    def load(rows, cols):  # the partials, each loaded (summed in finish)
        if len(qkv_ref.shape) == 4:
            return [qkv_ref[b, h, rows, cols]]
        return [qkv_ref[s, b, h, rows, cols] for s in range(qkv_ref.shape[0])]  # static: a handful of splits

    rows = jnp.broadcast_to(jnp.minimum(jnp.arange(Gq, dtype=jnp.int32), group - 1)[:, None], (Gq, H))
    q_cols, q_swapped = jnp.broadcast_to(cols[None, :], (Gq, H)), jnp.broadcast_to(swapped[None, :], (Gq, H))
    raw = dict(q=load(rows, q_cols), k=load(group, cols), v=load(group + 1, cols))
    if rope:
        raw.update(q_sw=load(rows, q_swapped), k_sw=load(group, swapped), pos=pos_ref[b], freq=freq_ref[...])

    def finish():
        summed = functools.partial(sum_partials, dtype=dt)

        def rotated(name):  # x1 cos - x2 sin | x2 cos + x1 sin, each product rounded to dt
            x = summed(raw[name])
            if not rope:
                return x
            return (x * cos).astype(dt) + (summed(raw[name + "_sw"]) * sign * sin).astype(dt)

        if rope:
            freqs = raw["pos"].astype(jnp.float32) * raw["freq"]  # [H]: inv_freq twice
            cos, sin = jnp.cos(freqs).astype(dt), jnp.sin(freqs).astype(dt)
            sign = jnp.where(cols < half, -1.0, 1.0).astype(dt)
        return rotated("q"), rotated("k"), summed(raw["v"])

    return finish
