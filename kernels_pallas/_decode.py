"""Paged decode attention (one query token per sequence), split-K over the context (flash-decoding).

Grid (B, K, splits). A program owns one sequence, one kv head and one contiguous run of that sequence's
live pages (the splits share them evenly, whole blocks each); it serves all G query heads of that kv head
at once, so every KV byte is read from HBM exactly once per step (the MMA needs >= 16 rows: the kernel
stacks copies of the G query rows in registers, so neither q nor the output is padded in HBM). Each
iteration gathers pages_per_block whole pages ([ppb, S, H] contiguous runs in the [K, P, S, H] layout),
computes [Gp, BK] scores with one MMA, and runs the online softmax. Block i + 1's KV loads are issued
before block i's math, and block i + 2's page ids before that (_common.kv_blocks, prefetch 2): Triton's
software pipeliner does not pipeline loads whose addresses come from the block table, and without this
each block's loads wait on the last block's math and on their own block-table load (B64 x 2k: 264 ->
227 us with the KV prefetch, -> 222 with the ids prefetch on an H100, bench/KERNELS_NOTES.md).

With one split the kernel normalizes and writes [B, K, G, H] in q's dtype. With several it writes each
split's normalized f32 output and its (max, sum) in the log2 domain for _splitk.combine_splits, which also
plans the splits (choose_splits) and the block size (default_block_k).

The fused entry point (fused_decode_attention_kernel, the engine's decode-only steps) takes the qkv projection
instead of q: each program reads its kv head's q rows and the new token's k / v ([T, K, G + 2, H], or split-K
partials summed here; _fused_qkv), applies RoPE, reads the cache only below q_pos (another program may be writing that
slot) and starts its online softmax from the new token's score; the program whose pages hold q_pos writes the
new k / v into their slot at the end. One launch instead of the qkv/RoPE/write kernel and this one: 6.2 vs 8.0 us
for the engine's batch-1 bucket, equal at 512 x 600 (bench/KERNELS_NOTES.md, stop 17).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import (
    cap_scores,
    kernel_supported,
    kv_blocks,
    mma,
    next_pow2,
    pad_block_tables,
    scalars,
    softmax_step,
    triton_params,
    whole_blocks_table,
)
from ._fused_qkv import fused_qkv
from ._splitk import choose_splits, combine_splits, default_block_k
from .reference import quantize

FP8_PAGES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
F16_MAX = 65504.0


def _decode_kernel(
    lens_ref,
    bt_ref,
    scal_ref,
    q_ref,
    k_ref,
    v_ref,
    *rest,
    page_size,
    pages_per_block,
    sliding_window,
    has_alibi,
    final,
    prefetch,
    replicas,
    tail_mask,
    fused=None,
    soft_cap=None,
):
    rest = list(rest)
    slope_ref = rest.pop(0) if has_alibi else None
    if fused:  # q_ref is the projection's qkv; the new token's k / v are written here, not read from the cache
        slots_ref, pos_ref, freq_ref = rest[:3]
        *outs, k_out, v_out = rest[3:]
    else:
        outs = rest
    h, split, b = (pl.program_id(i) for i in range(3))  # the grid is (K, splits, B): see _decode
    S, ppb = page_size, pages_per_block
    BK = S * ppb
    P = k_ref.shape[0]
    Gq, H = (fused["Gq"], q_ref.shape[-1]) if fused else q_ref.shape
    R = replicas

    seq_len = lens_ref[b]
    q_pos = seq_len - 1
    n_pages = pl.cdiv(seq_len, S)
    lo_pos = 0 if sliding_window is None else jnp.maximum(q_pos - sliding_window + 1, 0)
    first = lo_pos // S
    # The splits share this sequence's live pages evenly (whole blocks each), not the table's width: a
    # 200-token sequence in a 1024-token table is split as 200 tokens (at most the static pages_per_split each).
    pps = pl.cdiv(pl.cdiv(n_pages - first, pl.num_programs(1)), ppb) * ppb
    lo_page = first + split * pps
    hi_page = jnp.minimum(lo_page + pps, n_pages)
    hi_pos = jnp.minimum(hi_page * S, seq_len)
    num_blocks = jnp.maximum(pl.cdiv(hi_page - lo_page, ppb), 0)
    qk_mult, v_scale = scal_ref[0], scal_ref[1]

    cdt = fused["dt"] if fused else q_ref.dtype
    # fp8 pages with a bfloat16 model: the MMAs run in float16 (q and the probabilities converted once), since
    # e4m3 / e5m2 widen to float16 in one instruction per two values on sm_89+, to bfloat16 only through float32
    mdt = jnp.float16 if jnp.dtype(k_ref.dtype) in FP8_PAGES and jnp.dtype(cdt) == jnp.bfloat16 else cdt
    slopes = slope_ref[...] if has_alibi else None
    Gp = R * Gq
    init = (
        jnp.full((Gp,), -jnp.inf, jnp.float32),
        jnp.zeros((Gp,), jnp.float32),
        jnp.zeros((Gp, H), jnp.float32),
    )

    def to_mma(q):  # q in the MMAs' dtype; float16 saturates where bfloat16 would not (|q| > 65504)
        return q if mdt == cdt else jnp.clip(q.astype(jnp.float32), -F16_MAX, F16_MAX).astype(mdt)

    def stacked(q):  # the MMA needs >= 16 rows: stack R copies of the group (row r is head r % Gq)
        return jnp.broadcast_to(q[None], (R, Gq, H)).reshape(Gp, H) if R > 1 else q

    if fused:
        finish = fused_qkv(q_ref, pos_ref, freq_ref, b, h, Gq=Gq, group=fused["group"], rope=fused["rope"], dt=cdt)
        # The program whose pages hold q_pos writes the new token's slot (at the end) and takes its key from
        # registers; every program reads the cache only below q_pos (another program may be writing it).
        own = (seq_len > 0) & (lo_page * S <= q_pos) & (q_pos < hi_page * S)
        hi_pos = jnp.minimum(hi_pos, q_pos)
        new_kv, q = [], None  # set by start()

        def start(state):  # after the first KV loads are issued: q, the new token's k / v, and its score
            nonlocal q
            q, k_new, v_new = finish()
            q = to_mma(stacked(q))
            new_kv[:] = [quantize(k_new, scal_ref[2], k_out.dtype), quantize(v_new, v_scale, v_out.dtype)]
            kn, vn = (x.astype(cdt).astype(jnp.float32) for x in new_kv)
            # the new token first: its score is the running max, its weight exp2(0) = 1 (ALiBi bias 0)
            s_new = cap_scores((q.astype(jnp.float32) * kn[None, :]).sum(axis=1) * qk_mult, soft_cap)
            return (
                jnp.where(own, s_new, state[0]),
                jnp.where(own, 1.0, state[1]),
                jnp.where(own, jnp.broadcast_to(vn[None, :], (Gp, H)), state[2]),
            )
    else:
        q, start = to_mma(stacked(q_ref[...])), None

    def ids(i):  # page ids of block i; -1 for pages past this split's last one
        first = lo_page + i * ppb
        live = first + jnp.arange(ppb, dtype=jnp.int32) < hi_page
        return jnp.where(live, jnp.clip(bt_ref[pl.ds(first, ppb)], 0, P - 1), -1)

    def fetch(ids):
        if not tail_mask:
            ids = jnp.maximum(ids, 0)
            return k_ref[ids].reshape(BK, H), v_ref[ids].reshape(BK, H)
        # pages past the end are not read at all: the last block of a short sequence would
        # otherwise read up to ppb - 1 pages for nothing. Their values never matter (step masks every
        # position >= hi_pos), so interpret mode, which has no masked gather, reads them instead.
        from jax.experimental.pallas import triton as plgpu

        live = jnp.broadcast_to((ids >= 0)[:, None, None], (ppb, S, H))
        ids = jnp.maximum(ids, 0)
        # no `other`: masked lanes are undefined, which step() masks anyway (Triton cannot splat a
        # fill value into an fp8 tensor)
        k = plgpu.load(k_ref.at[ids], mask=live)
        v = plgpu.load(v_ref.at[ids], mask=live)
        return k.reshape(BK, H), v.reshape(BK, H)

    def step(i, state, k, v, masked):
        k, v = k.astype(mdt), v.astype(mdt)
        p0 = lo_page + i * ppb
        kv_pos = p0 * S + jnp.arange(BK, dtype=jnp.int32)
        s = cap_scores(mma(q, k, trans_b=True) * qk_mult, soft_cap)  # [Gp, BK]
        if has_alibi:
            s = s + slopes[:, None] * (kv_pos - q_pos).astype(jnp.float32)[None, :]
        if masked:
            valid = (kv_pos < hi_pos) & (kv_pos >= lo_pos)
            s = jnp.where(valid[None, :], s, -jnp.inf)
            v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # pages past the end may hold NaN
        return softmax_step(state, s, v, mdt)

    # Blocks wholly inside [lo_pos, hi_pos) skip the mask; only the last (and, with a window, all) pay it.
    if sliding_window is None:
        num_full = jnp.clip((hi_pos - lo_page * S) // BK, 0, num_blocks)
    else:
        num_full = 0
    m, l, acc = kv_blocks(ids, fetch, step, init, 0, num_full, num_blocks, prefetch=prefetch, start=start)
    if fused:
        slot = slots_ref[b]

        @pl.when(own & (slot >= 0))
        def _():
            k_out[slot // S, slot % S, :] = new_kv[0]
            v_out[slot // S, slot % S, :] = new_kv[1]

    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    if R > 1:  # the copies are bitwise equal; max (not sum) keeps them exact
        out, m, l = out.reshape(R, Gq, H).max(0), m.reshape(R, Gq).max(0), l.reshape(R, Gq).max(0)
    if final:
        (o_ref,) = outs
        o_ref[...] = (out * v_scale).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = outs
        o_ref[...] = out * v_scale
        m_ref[...] = m
        l_ref[...] = l


_STATIC = (
    "scale",
    "sliding_window",
    "soft_cap",
    "interpret",
    "block_k",
    "num_splits",
    "num_warps",
    "num_stages",
    "prefetch",
    "min_split_tokens",
    "tail_mask",
    "combine_block_h",
    "combine_warps",
    "plan_seqs",
)


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_decode_attention_kernel(
    q,
    k_pages,
    v_pages,
    seq_lens,
    block_tables,
    *,
    scale,
    k_scale=1.0,
    v_scale=1.0,
    alibi_slopes=None,
    sliding_window=None,
    soft_cap=None,
    interpret=False,
    **tuning,
):
    """q [B, N, H] over the paged cache -> [B, N, H]. tuning: block_k, num_splits, num_warps, num_stages,
    prefetch, min_split_tokens, tail_mask, combine_block_h, combine_warps, plan_seqs (static; defaults by
    measurement)."""
    B, N, H = q.shape
    G = N // k_pages.shape[0]
    return _decode(
        q,
        None,
        k_pages,
        v_pages,
        seq_lens,
        block_tables,
        B=B,
        G=G,
        dtype=q.dtype,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
        **tuning,
    )


@functools.partial(jax.jit, static_argnames=_STATIC + ("dtype",))
def fused_decode_attention_kernel(
    qkv,
    positions,
    inv_freq,
    k_pages,
    v_pages,
    slot_mapping,
    seq_lens,
    block_tables,
    *,
    scale,
    k_scale=1.0,
    v_scale=1.0,
    alibi_slopes=None,
    sliding_window=None,
    soft_cap=None,
    dtype=None,
    interpret=False,
    **tuning,
):
    """The decode step's attention from the projection's output: qkv [B, K, G + 2, H] (token b is sequence
    b's one new token), or its split-K partials [S, B, K, G + 2, H] (f32; dtype: the model's). RoPE on q and
    k, the new k / v written into slot_mapping's slots and attention over the cache plus that token, in one
    launch: what reference.qkv_write_kv followed by paged_decode_attention does. -> (out [B, N, H], k_pages,
    v_pages); in place where the pages are donated."""
    B, K, G2, H = qkv.shape[-4:]
    dt = jnp.dtype(qkv.dtype if qkv.ndim == 4 else dtype)
    rope = inv_freq is not None
    freq = jnp.tile(jnp.asarray(inv_freq if rope else jnp.zeros((H // 2,)), jnp.float32), 2)
    extra = (slot_mapping.astype(jnp.int32), positions.astype(jnp.int32), freq)
    return _decode(
        qkv,
        (extra, dict(group=G2 - 2, rope=rope, dt=dt)),
        k_pages,
        v_pages,
        seq_lens,
        block_tables,
        B=B,
        G=G2 - 2,
        dtype=dt,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
        **tuning,
    )


def _decode(
    q,
    fused,
    k_pages,
    v_pages,
    seq_lens,
    block_tables,
    *,
    B,
    G,
    dtype,
    scale,
    k_scale,
    v_scale,
    alibi_slopes,
    sliding_window,
    interpret,
    soft_cap=None,
    block_k=None,
    num_splits=None,
    num_warps=4,
    num_stages=1,
    prefetch=2,
    min_split_tokens=128,
    tail_mask=True,
    combine_block_h=32,
    combine_warps=1,
    plan_seqs=None,
):
    """The pallas_call of either entry point. q is [B, N, H], or with fused = ((slots, positions, freq), static
    settings) the projection's qkv, which the kernel reads whole and indexes by (b, h). plan_seqs: the live
    sequences the block size and split-K are planned for (default B; padding sequences' programs exit at once)."""
    K, P, S, H = k_pages.shape
    M = block_tables.shape[1]
    Gq = next_pow2(G)  # q rows per program in HBM (== G unless G is not a power of two)
    R = max(1, 16 // Gq)  # copies stacked in-kernel for the MMA: no padded q or output in HBM
    planned = plan_seqs or B
    if block_k is None:
        block_k = default_block_k(planned, K)
    ppb = max(1, block_k // S)
    splits, pps = choose_splits(planned, K, M, ppb, S, num_splits, min_split_tokens)
    final = splits == 1

    # The splits' blocks start at multiples of ppb (block tables are read a block at a time and never past the
    # block of a split's last page) unless a window moves the first page: the bench's B1 x 32k call spent
    # 1.2 us of its ~54 in XLA's pad of the table (H100 XProf at ebd9225, bench/KERNELS_NOTES.md "Stop 22").
    bt = whole_blocks_table(block_tables, ppb) if sliding_window is None else pad_block_tables(block_tables, pps + ppb)
    lens = seq_lens.astype(jnp.int32)
    scal = scalars(scale, k_scale, v_scale)
    has_alibi = alibi_slopes is not None

    full = lambda shape: pl.BlockSpec(shape, lambda h, s, b: (0,) * len(shape))  # noqa: E731
    pages = pl.BlockSpec((None, P, S, H), lambda h, s, b: (h, 0, 0, 0))
    if fused:
        (slots, positions, freq), settings = fused
        settings = dict(settings, Gq=Gq)
        scal = jnp.concatenate([scal, jnp.asarray(k_scale, jnp.float32).reshape(1)])
        q_spec = full(q.shape)
    else:
        settings = None
        q = q.reshape(B, K, G, H)
        if Gq != G:
            q = jnp.pad(q, ((0, 0), (0, 0), (0, Gq - G), (0, 0)))
        q_spec = pl.BlockSpec((None, None, Gq, H), lambda h, s, b: (b, h, 0, 0))
    in_specs = [
        full((B,)),
        pl.BlockSpec((None, bt.shape[1]), lambda h, s, b: (b, 0)),
        full(scal.shape),
        q_spec,
        pages,
        pages,
    ]
    args = [lens, bt, scal, q, k_pages, v_pages]
    if has_alibi:
        slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(K, G) * (1.0 / jnp.log(2.0))
        slopes = jnp.tile(jnp.pad(slopes, ((0, 0), (0, Gq - G))), (1, R))  # row r: head r % Gq
        in_specs.append(pl.BlockSpec((None, R * Gq), lambda h, s, b: (h, 0)))
        args.append(slopes)
    if fused:
        in_specs += [full((B,)), full((B,)), full((H,))]
        args += [slots, positions, freq]
    if final:
        out_shape = [jax.ShapeDtypeStruct((B, K, Gq, H), dtype)]
        out_specs = [pl.BlockSpec((None, None, Gq, H), lambda h, s, b: (b, h, 0, 0))]
    else:  # SP >= splits slots (a power of two for the combine kernel); the extra ones stay unwritten
        SP = next_pow2(splits)
        out_shape = [
            jax.ShapeDtypeStruct((B, K, SP, Gq, H), jnp.float32),
            jax.ShapeDtypeStruct((B, K, SP, Gq), jnp.float32),
            jax.ShapeDtypeStruct((B, K, SP, Gq), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, Gq, H), lambda h, s, b: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, Gq), lambda h, s, b: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, Gq), lambda h, s, b: (b, h, s, 0)),
        ]
    aliases = {}
    if fused:
        aliases = {4: len(out_shape), 5: len(out_shape) + 1}
        out_shape += [
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ]
        out_specs += [pages, pages]
    kernel = functools.partial(
        _decode_kernel,
        page_size=S,
        pages_per_block=ppb,
        sliding_window=sliding_window,
        has_alibi=has_alibi,
        final=final,
        prefetch=prefetch,
        replicas=R,
        tail_mask=tail_mask and not interpret,
        fused=settings,
        soft_cap=soft_cap,
    )
    outs = pl.pallas_call(
        kernel,
        # Sequences outermost: the GPU dispatches programs in grid order (the first axis fastest), so every live
        # sequence's programs start before the padding rows' (last in the engine's batches), which exit at once.
        # With (B, K, splits) a batch-1 step's 2-row bucket interleaved the two rows' programs and the live
        # row's second half waited for padding programs to leave the wave. H100, one sequence at 32k context in
        # the engine: 52.9 us a layer against 58.8, ITL 7.13 vs 7.39 ms in one call, each with its own cache
        # (bench/results/long32k_h100_83092d7_grid{,_old}.json); 128 tokens in an 8k table: ITL 5.55 vs 5.54 ms.
        grid=(K, splits, B),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"paged_decode_{S=}_{ppb=}_{splits=}" + ("_fused" if fused else ""),
    )(*args)
    if fused:
        *outs, k_pages, v_pages = outs
    out = (
        outs[0]
        if final
        else combine_splits(*outs, splits, dtype, interpret=interpret, block_h=combine_block_h, num_warps=combine_warps)
    )
    out = out[:, :, :G].reshape(B, K * G, H)
    return (out, k_pages, v_pages) if fused else out


def supported(q, k_pages) -> bool:
    return kernel_supported(q, k_pages)
