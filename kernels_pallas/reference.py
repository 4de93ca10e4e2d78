"""Pure-jnp paged attention: the reference every kernel is tested against, and the CPU path.

Shape letters (used across jaxllm): T tokens in the flat batch, B sequences, N query heads, K kv heads,
G = N // K query heads per kv head, H head dim, P pages in the cache, S page (block) size, M pages per
sequence in the block table.

KV layout, one pair of arrays per layer: k_pages, v_pages: [K, P, S, H]. A page of one kv head is one
contiguous S*H run, so a kernel program that owns (sequence, kv head) reads whole pages with unit stride,
and sharding kv heads over tensor-parallel devices splits axis 0.

Batch layout: the new tokens of all sequences are concatenated into one ragged batch of T tokens.
Sequence b owns tokens query_start_loc[b] : query_start_loc[b+1]; they are the last
q_len_b = query_start_loc[b+1] - query_start_loc[b] tokens of its context of seq_lens[b] tokens, so the
token at offset j of the chunk sits at position seq_lens[b] - q_len_b + j and attends causally to keys
0..position (fewer with a sliding window). Padding sequences have q_len 0 and seq_len 0; padding tokens
(t >= query_start_loc[B]) produce zeros and are never written to the cache (slot -1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.float8_e5m2): 57344.0}


def write_kv(k_pages, v_pages, k, v, slot_mapping, *, k_scale=1.0, v_scale=1.0, kv_dtype=None):
    """Scatters the new tokens' k, v ([T, K, H]) into their slots (page * S + offset); slot -1 is dropped.

    kv_dtype: the values' dtype where the pages hold its bit patterns as uint8 (fp8 on CPU: XLA's CPU backend
    widens a whole fp8 scatter operand to float32 and back, so each step rewrote every layer's cache; a uint8
    scatter is in place). None: the pages' own dtype."""
    K, P, S, H = k_pages.shape
    slots = jnp.where(slot_mapping < 0, P * S, slot_mapping)  # out of range -> dropped by mode="drop"

    def scatter(pages, x, scale):
        x = quantize(x, scale, kv_dtype or pages.dtype)
        if kv_dtype is not None:
            x = jax.lax.bitcast_convert_type(x, pages.dtype)
        flat = pages.reshape(K, P * S, H).at[:, slots].set(x.transpose(1, 0, 2), mode="drop")
        return flat.reshape(K, P, S, H)

    return scatter(k_pages, k, k_scale), scatter(v_pages, v, v_scale)


def apply_rope(x, positions, inv_freq):
    """x: [T, heads, H], HF's rotate-half layout (first half / second half of each head). cos and sin are
    rounded to x's dtype and every product and sum is rounded to it, as HF does in bf16/fp16."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos = jnp.cos(freqs).astype(x.dtype)[:, None, :]
    sin = jnp.sin(freqs).astype(x.dtype)[:, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def qkv_write_kv(
    qkv,
    positions,
    inv_freq,
    k_pages,
    v_pages,
    slot_mapping,
    *,
    k_scale=1.0,
    v_scale=1.0,
    write=None,
    dtype=None,
    **write_kwargs,
):
    """The fused projection's output qkv [T, K, G + 2, H] (per kv head: its G query heads, then k, v) ->
    q [T, K * G, H] with RoPE applied (inv_freq [H / 2]; None: no rotation, e.g. ALiBi models), and the
    rotated k and v written into their slots by write (default write_kv). Returns (q, k_pages, v_pages).
    qkv may instead be the projection's split-K partials [S, T, K, G + 2, H] (float32): they are summed and
    rounded to dtype first. write_kwargs go to write (write_kv's kv_dtype)."""
    if qkv.ndim == 5:
        qkv = qkv.sum(0).astype(dtype)
    T, K, G2, H = qkv.shape
    q = qkv[:, :, :-2].reshape(T, K * (G2 - 2), H)
    k, v = qkv[:, :, -2], qkv[:, :, -1]
    if inv_freq is not None:
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    write = write or write_kv
    return (q, *write(k_pages, v_pages, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale, **write_kwargs))


def quantize(x, scale, dtype):
    """x as stored in a cache of dtype: fp8 caches hold x / scale clipped to the format's range."""
    dtype = jnp.dtype(dtype)
    if dtype in FP8_MAX:
        limit = FP8_MAX[dtype]
        return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)
    return x.astype(dtype)


def widen(pages, kv_dtype=None):
    """Pages (a gathered slice of them) as float32; kv_dtype as in write_kv: pages hold its bit patterns."""
    if kv_dtype is not None:
        pages = jax.lax.bitcast_convert_type(pages, kv_dtype)
    return pages.astype(jnp.float32)


def token_sequence_ids(query_start_loc, num_tokens):
    """Sequence index of each token of the flat batch ([T] int32) and whether it belongs to any sequence."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    b = jnp.searchsorted(query_start_loc, t, side="right").astype(jnp.int32) - 1
    num_seqs = query_start_loc.shape[0] - 1
    valid = t < query_start_loc[-1]
    return jnp.clip(b, 0, num_seqs - 1), valid


def ragged_paged_attention_ref(
    q,  # [T, N, H]
    k_pages,  # [K, P, S, H]
    v_pages,  # [K, P, S, H]
    seq_lens,  # [B] int32
    query_start_loc,  # [B+1] int32
    block_tables,  # [B, M] int32
    *,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    alibi_slopes=None,  # [N] f32 or None
    sliding_window: int | None = None,
    soft_cap: float | None = None,  # Gemma 2: scores -> soft_cap * tanh(scores / soft_cap)
    pages_per_step: int | None = None,
    kv_dtype=None,  # pages hold this dtype's bit patterns (write_kv)
):
    """Causal attention of every new token over its sequence's paged context. Returns [T, N, H] in q.dtype.

    Walks the block table pages_per_step pages at a time with an online softmax, so memory stays at
    T * pages_per_step * S * K * H whatever the context length (None: all pages in one step).
    """
    T, N, H = q.shape
    K, _, S, _ = k_pages.shape
    M = block_tables.shape[1]
    G = N // K
    step = M if pages_per_step is None else min(pages_per_step, M)
    num_steps = -(-M // step)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_steps * step - M)))

    seq, valid = token_sequence_ids(query_start_loc, T)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    q_pos = seq_lens[seq] - q_len + (jnp.arange(T, dtype=jnp.int32) - query_start_loc[seq])  # [T]
    ctx_len = jnp.where(valid, seq_lens[seq], 0)  # [T]
    qg = q.astype(jnp.float32).reshape(T, K, G, H) * scale
    slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32).reshape(K, G)

    def body(i, carry):
        m_run, l_run, acc = carry  # [T, K, G], [T, K, G], [T, K, G, H]
        pages = jax.lax.dynamic_slice_in_dim(tables, i * step, step, axis=1)[seq]  # [T, step]
        k = widen(k_pages[:, pages], kv_dtype) * k_scale  # [K, T, step, S, H]
        v = widen(v_pages[:, pages], kv_dtype) * v_scale
        k = k.reshape(K, T, step * S, H)
        v = v.reshape(K, T, step * S, H)
        kv_pos = i * step * S + jnp.arange(step * S, dtype=jnp.int32)  # [C]
        s = jnp.einsum("tkgh,ktch->tkgc", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        rel = kv_pos[None, :] - q_pos[:, None]  # [T, C], <= 0 where visible
        if slopes is not None:
            s = s + slopes[None, :, :, None] * rel[:, None, None, :].astype(jnp.float32)
        mask = (rel <= 0) & (kv_pos[None, :] < ctx_len[:, None])
        if sliding_window is not None:
            mask &= rel > -sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_run, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m_run), m_run, -jnp.inf) - m_safe)
        l_new = alpha * l_run + p.sum(-1)
        # A masked-out key holds whatever the page held (NaN in tests); p is exactly 0 there, so zero v too.
        v = jnp.where(mask[None, :, :, None], v, 0.0)
        acc = alpha[..., None] * acc + jnp.einsum("tkgc,ktch->tkgh", p, v)
        return m_new, l_new, acc

    init = (
        jnp.full((T, K, G), -jnp.inf, jnp.float32),
        jnp.zeros((T, K, G), jnp.float32),
        jnp.zeros((T, K, G, H), jnp.float32),
    )
    # Only the steps that hold some token's context run (a traced trip count): the work follows the longest
    # live sequence, not the block table's width (max_model_len).
    live_steps = jnp.minimum(num_steps, -(-jnp.max(ctx_len) // (step * S)))
    _, l_fin, acc = jax.lax.fori_loop(0, live_steps, body, init)
    out = acc / jnp.where(l_fin > 0, l_fin, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(T, N, H).astype(q.dtype)


def paged_decode_attention_ref(q, k_pages, v_pages, seq_lens, block_tables, **kwargs):
    """One query token per sequence (q: [B, N, H]): the ragged case with query_start_loc = 0..B. A padding
    sequence (seq_len 0), wherever it sits, owns its token too and sees no key: zeros."""
    B = q.shape[0]
    query_start_loc = jnp.arange(B + 1, dtype=jnp.int32)
    return ragged_paged_attention_ref(q, k_pages, v_pages, seq_lens, query_start_loc, block_tables, **kwargs)
