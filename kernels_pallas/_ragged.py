"""Ragged paged attention: a flat batch of query chunks, each causal over its sequence's whole paged context.

Tiling. Each sequence's chunk of q_len tokens is cut into tiles of BQ tokens; a tile never spans two
sequences. A tile's rows are (token, query head of one kv group) pairs, BM = BQ * Gp rows, so the GQA
group shares every KV load and the MMA M dimension is full even for G = 8 (BQ = 16) or G = 1 (BQ = 128).
A program reads its tile's q rows straight from q viewed as [T * K * Gp, H] (row (t * K + h) * Gp + g: BQ
tokens x the Gp heads of its kv head, by row index) and writes its output rows the same way (masked stores:
a tile writes only its own tokens), so no gathered copy of q or of the output exists. The number of tiles
is static (T // BQ + B bounds it), so one compiled kernel serves every mix of chunk lengths in a token
bucket; the tiles past the last real one write zeros over the padding tokens.

Grid (tiles, K), the tiles in reverse order: each sequence's last (longest causal) tiles start first. A
program walks its sequence's block table BK tokens (BK / S whole pages) at a time:
first the blocks that lie wholly before the tile's first token (no mask), then the diagonal blocks with the
causal mask. The next block's loads are issued before this block's math (prefetch, _common.kv_blocks): 4k
chunk 608 -> 528 us, 512 chunk over an 8k prefix 343 -> 281 us on an H100. Decode tokens mixed into the
batch become one-row tiles; an all-decode batch should use the decode kernel (decode_only=True).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import cap_scores, kv_blocks, mma, next_pow2, pad_block_tables, scalars, softmax_step, triton_params


def _ragged_kernel(
    tseq_ref,
    tpos_ref,
    ttok_ref,
    trows_ref,
    bt_ref,
    scal_ref,
    q_ref,
    k_ref,
    v_ref,
    *rest,
    page_size,
    pages_per_block,
    block_q,
    group,
    rows_per_token,
    sliding_window,
    has_alibi,
    prefetch,
    num_tokens,
    interpret,
    soft_cap=None,
):
    if has_alibi:
        slope_ref, o_ref = rest
    else:
        slope_ref, (o_ref,) = None, rest
    # The longest causal tiles (each sequence's last) are launched first: 4k chunk 482 -> 455 us, 4k over a
    # 4k prefix 1298 -> 1183 us on an H100 (bench/results/kernels_h100_50e0ebf_causal_b1.json).
    i = pl.num_programs(0) - 1 - pl.program_id(0)
    h = pl.program_id(1)
    S, ppb, BQ, Gp = page_size, pages_per_block, block_q, group
    BK = S * ppb
    P = k_ref.shape[0]
    H = q_ref.shape[1]
    BM = BQ * Gp
    KGp = rows_per_token  # K * Gp

    seq = tseq_ref[i]
    pos0 = tpos_ref[i]
    tok0 = ttok_ref[i]
    nrows = trows_ref[i]
    kv_hi = jnp.where(nrows > 0, pos0 + nrows, 0)  # keys [kv_lo, kv_hi) can be visible to this tile
    # Rows past the tile's last token (padding) are clamped onto it, so they never reach unwritten keys.
    row_pos = jnp.minimum(pos0 + jnp.arange(BM, dtype=jnp.int32) // Gp, kv_hi - 1)

    # The tile's q rows are read from, and its output rows written to, q and the output viewed as
    # [T * K * Gp, H] (row (t * K + h) * Gp + g) by row index: no gathered copies, and plain 2-D tiles (a
    # [BQ, Gp, H] slice reshaped to [BM, H] measured 15% slower). A live tile writes its first nrows tokens
    # (the rows after them belong to the next sequence's tiles); a dead one (nrows 0) writes zeros over BQ
    # padding tokens.
    t = jnp.arange(BM, dtype=jnp.int32) // Gp
    head_row = h * Gp + jnp.arange(BM, dtype=jnp.int32) % Gp
    tok = tok0 + t
    mine = (tok < num_tokens) & ((t < nrows) | (nrows == 0))
    q = q_ref[jnp.minimum(tok, num_tokens - 1) * KGp + head_row]
    qk_mult, v_scale = scal_ref[0], scal_ref[1]
    slopes = slope_ref[...] if has_alibi else None
    cdt = q.dtype

    def ids(blk):
        return jnp.clip(bt_ref[seq, pl.ds(blk * ppb, ppb)], 0, P - 1)

    def fetch(ids):
        return k_ref[ids].reshape(BK, H), v_ref[ids].reshape(BK, H)

    def block(blk, state, k, v, masked):
        k, v = k.astype(cdt), v.astype(cdt)
        kv_pos = blk * BK + jnp.arange(BK, dtype=jnp.int32)
        s = cap_scores(mma(q, k, trans_b=True) * qk_mult, soft_cap)  # [BM, BK]
        if has_alibi:
            s = s + slopes[:, None] * (kv_pos[None, :] - row_pos[:, None]).astype(jnp.float32)
        if masked:
            rel = kv_pos[None, :] - row_pos[:, None]
            vis = rel <= 0
            if sliding_window is not None:
                vis &= rel > -sliding_window
            s = jnp.where(vis, s, -jnp.inf)
            v = jnp.where((kv_pos < kv_hi)[:, None], v, jnp.zeros_like(v))  # NaN-safe past the end
        return softmax_step(state, s, v, cdt)

    if sliding_window is None:
        lo_blk = 0
        full_blk = jnp.where(nrows > 0, (pos0 + 1) // BK, 0)  # blocks every row sees whole
    else:
        lo_blk = jnp.maximum(pos0 - sliding_window + 1, 0) // BK
        full_blk = lo_blk
    end_blk = pl.cdiv(kv_hi, BK)

    carry = (
        jnp.full((BM,), -jnp.inf, jnp.float32),
        jnp.zeros((BM,), jnp.float32),
        jnp.zeros((BM, H), jnp.float32),
    )
    _, l, acc = kv_blocks(ids, fetch, block, carry, lo_blk, full_blk, end_blk, prefetch=prefetch)
    out = (acc * (v_scale / jnp.where(l > 0, l, 1.0))[:, None]).astype(o_ref.dtype)
    if interpret:  # no masked scatter there: the rows that are not this tile's go to a spare token's rows
        o_ref[jnp.where(mine, tok, num_tokens) * KGp + head_row] = out
    else:
        plgpu.store(o_ref.at[tok * KGp + head_row], out, mask=jnp.broadcast_to(mine[:, None], (BM, H)))


def tile_plan(query_start_loc, seq_lens, num_tokens, block_q, skip_single=False):
    """Static-size tile list: per tile its sequence, first query position, first token and valid rows.
    Tiles past the last live one have 0 rows and cover the padding tokens after the last sequence, block_q
    each (there are always enough of them: n_tiles - live >= (num_tokens - last token) / block_q).
    skip_single: sequences with one query token get no tile (the caller attends them another way)."""
    B = seq_lens.shape[0]
    qsl = query_start_loc.astype(jnp.int32)
    q_len = qsl[1:] - qsl[:-1]
    n_tiles = -(-num_tokens // block_q) + B
    per_seq = (q_len + block_q - 1) // block_q
    if skip_single:
        per_seq = jnp.where(q_len == 1, 0, per_seq)
    tile_end = jnp.cumsum(per_seq)
    tile_start = tile_end - per_seq
    i = jnp.arange(n_tiles, dtype=jnp.int32)
    tseq = jnp.clip(jnp.searchsorted(tile_end, i, side="right"), 0, B - 1).astype(jnp.int32)
    j = i - tile_start[tseq]
    live = i < tile_end[-1]
    tpos = seq_lens[tseq] - q_len[tseq] + j * block_q
    ttok = jnp.where(live, qsl[tseq] + j * block_q, qsl[-1] + (i - tile_end[-1]) * block_q)
    trows = jnp.where(live, jnp.clip(q_len[tseq] - j * block_q, 0, block_q), 0)
    return tseq, tpos.astype(jnp.int32), ttok.astype(jnp.int32), trows.astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "interpret",
        "block_m",
        "block_k",
        "num_warps",
        "num_stages",
        "prefetch",
        "skip_single",
    ),
)
def ragged_paged_attention_kernel(
    q,
    k_pages,
    v_pages,
    seq_lens,
    query_start_loc,
    block_tables,
    *,
    scale,
    k_scale=1.0,
    v_scale=1.0,
    alibi_slopes=None,
    sliding_window=None,
    soft_cap=None,
    interpret=False,
    block_m=128,
    block_k=128,
    num_warps=8,
    num_stages=1,
    prefetch=1,
    skip_single=False,
):
    """skip_single: one-token sequences get no tile and their output rows are unspecified (the entry point
    attends them with the decode kernel instead). Padding tokens (past the last sequence) get zeros."""
    T, N, H = q.shape
    K, P, S, _ = k_pages.shape
    G = N // K
    Gp = next_pow2(G)
    BQ = max(1, block_m // Gp)
    BM = BQ * Gp
    ppb = max(1, block_k // S)
    lens = seq_lens.astype(jnp.int32)

    tseq, tpos, ttok, trows = tile_plan(query_start_loc, lens, T, BQ, skip_single)
    nt = tseq.shape[0]
    qg = q if Gp == G else jnp.pad(q.reshape(T, K, G, H), ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    qg = qg.reshape(T * K * Gp, H)
    To = T + 1 if interpret else T  # interpret mode: one spare token for the rows a tile does not own

    bt = pad_block_tables(block_tables, ppb)
    scal = scalars(scale, k_scale, v_scale)
    has_alibi = alibi_slopes is not None
    full = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))
    in_specs = [
        full((nt,)),
        full((nt,)),
        full((nt,)),
        full((nt,)),
        full(bt.shape),
        full((2,)),
        full(qg.shape),
        pl.BlockSpec((None, P, S, H), lambda i, h: (h, 0, 0, 0)),
        pl.BlockSpec((None, P, S, H), lambda i, h: (h, 0, 0, 0)),
    ]
    args = [tseq, tpos, ttok, trows, bt, scal, qg, k_pages, v_pages]
    if has_alibi:
        slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(K, G) * (1.0 / jnp.log(2.0))
        slopes = jnp.pad(slopes, ((0, 0), (0, Gp - G)))
        slopes = jnp.tile(slopes, (1, BQ))  # row r = token r // Gp, head r % Gp
        in_specs.append(pl.BlockSpec((None, BM), lambda i, h: (h, 0)))
        args.append(slopes)
    kernel = functools.partial(
        _ragged_kernel,
        page_size=S,
        pages_per_block=ppb,
        block_q=BQ,
        group=Gp,
        rows_per_token=K * Gp,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        has_alibi=has_alibi,
        prefetch=prefetch,
        num_tokens=T,
        interpret=interpret,
    )
    out = pl.pallas_call(
        kernel,
        grid=(nt, K),
        in_specs=in_specs,
        out_specs=full((To * K * Gp, H)),
        out_shape=jax.ShapeDtypeStruct((To * K * Gp, H), q.dtype),
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"ragged_paged_{S=}_{BM=}_{ppb=}",
    )(*args)
    out = out.reshape(To, K, Gp, H)
    if Gp != G or To != T:
        out = out[:T, :, :G]
    return out.reshape(T, N, H)
