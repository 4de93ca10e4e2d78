"""Ragged prefill attention over paged KV as a Mosaic GPU kernel (Hopper: TMA, wgmma, warp specialization).

Same contract as _ragged.ragged_paged_attention_kernel (a flat batch of query chunks, each causal over its
sequence's whole paged context), for bf16 / fp16 pages, head dim 64 / 128 and page sizes 8..128 that divide the
KV block; no ALiBi, sliding window or fp8 (the Triton kernel serves those).

Tiling. A CTA owns (query head, tile): two compute warpgroups of 64 query rows each and one memory warpgroup.
A sequence's tiles are 128-row boxes of q ([T, N, H], read in place) starting at its first token rounded down
to a multiple of 8 (Mosaic GPU's layout inference must see that TMA row offsets into the tiled SMEM are
multiples of 8; a chunk starts at any token): the first box may hold up to 7 rows of the sequence before, and
the last one rows after it. Those rows are computed and not stored: each warpgroup stores only its own
sequence's rows, from an untiled SMEM buffer in power-of-two TMA pieces. Tiles after the live ones write zeros
over the padding tokens after the last sequence; the rest of the static grid exits at once.
The memory warpgroup walks the sequence's block table BK keys at a time and copies each page's K and V ([S, H],
one TMA each) into a ring of steps_in_flight SMEM slots (table entries past the context are clipped into the
cache: their keys are masked and their V rows zeroed, see below). Each compute warpgroup multiplies its q tile
by every K block (wgmma into registers), runs an online softmax in the log2 domain with the causal mask on the
diagonal blocks, and multiplies P by V (wgmma). V rows past the context in the last block are zeroed in SMEM
first (they may hold stale values of a freed sequence, NaN included, and P being 0 there does not make 0 * NaN
zero). Both warpgroups consume every block of the tile (the earlier one's extra diagonal keys are masked), so
the ring's "consumed" barriers always get both arrivals in order.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._common import kernel_named, pad_block_tables

BQ = 64  # query rows per compute warpgroup
TILE = 2 * BQ  # tokens per CTA


def supported(
    q, k_pages, *, alibi_slopes=None, sliding_window=None, soft_cap=None, k_scale=1.0, v_scale=1.0, block_kv=128, **_
) -> bool:
    """The inputs this kernel takes (the others go to the Triton kernel)."""
    K, P, S, H = k_pages.shape
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    unit_scales = all(isinstance(x, (int, float)) and x == 1.0 for x in (k_scale, v_scale))
    return (
        jnp.dtype(q.dtype) in dtypes
        and jnp.dtype(k_pages.dtype) == jnp.dtype(q.dtype)
        and H in (64, 128)
        and q.shape[1] % K == 0
        and 8 <= S <= block_kv
        and block_kv % S == 0
        and alibi_slopes is None
        and sliding_window is None
        and soft_cap is None
        and unit_scales
    )


def tile_plan_aligned(query_start_loc, seq_lens, num_tokens, skip_single=False):
    """Static-size tile list for the kernel: per tile its sequence, first row / 8 (box rows [8u, 8u + TILE)),
    the query position of the box's row 0, the box rows [lo, hi) it stores and the keys it may see (kv_hi; 0
    for the tiles that only zero padding tokens, and lo = hi = 0 for the unused rest)."""
    B = seq_lens.shape[0]
    T = num_tokens
    qsl = query_start_loc.astype(jnp.int32)
    lens = seq_lens.astype(jnp.int32)
    q_len = qsl[1:] - qsl[:-1]
    a = qsl[:-1] // 8 * 8  # each sequence's first box row
    per_seq = jnp.where(q_len > 0, (qsl[1:] - a + TILE - 1) // TILE, 0)
    if skip_single:
        per_seq = jnp.where(q_len == 1, 0, per_seq)
    a_pad = qsl[-1] // 8 * 8  # padding tokens [qsl[-1], T): zeroed by their own boxes
    n_pad = jnp.where(qsl[-1] < T, (T - a_pad + TILE - 1) // TILE, 0)
    n_tiles = 2 * (-(-T // TILE)) + B + 1  # >= sum(per_seq) + n_pad for any batch
    tile_end = jnp.cumsum(per_seq)
    live_end = tile_end[-1]
    i = jnp.arange(n_tiles, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(tile_end, i, side="right"), 0, B - 1).astype(jnp.int32)
    j = i - (tile_end[b] - per_seq[b])
    live = i < live_end
    pad = ~live & (i < live_end + n_pad)
    jp = i - live_end
    row0 = jnp.where(live, a[b] + j * TILE, a_pad + jp * TILE)
    lo_tok = jnp.where(live, qsl[b], qsl[-1])
    hi_tok = jnp.where(live, qsl[b + 1], T)
    lo = jnp.where(live | pad, jnp.clip(lo_tok - row0, 0, TILE), 0)
    hi = jnp.where(live | pad, jnp.clip(hi_tok - row0, 0, TILE), 0)
    pos = lens[b] - q_len[b] + (row0 - qsl[b])  # query position of the box's row 0 (negative: rows before)
    kv_hi = jnp.where(live & (hi > lo), pos + hi, 0)
    unit = jnp.where(live | pad, row0 // 8, 0)
    return (
        b,
        unit.astype(jnp.int32),
        pos.astype(jnp.int32),
        lo.astype(jnp.int32),
        hi.astype(jnp.int32),
        kv_hi.astype(jnp.int32),
    )


def _kernel(
    tseq_ref,
    tunit_ref,
    tpos_ref,
    tlo_ref,
    thi_ref,
    tkv_ref,
    bt_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    scoped,
    *,
    num_tiles,
    group,
    block_kv,
    page_size,
    steps_in_flight,
    scale_log2,
    dtype,
    interpret,
):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    (q_smem2, o_smem2, k_smem, v_smem), (k_ready, v_ready, q_ready), (k_free, v_free) = scoped
    BK, S = block_kv, page_size
    ppb = BK // S
    P = k_ref.shape[1]
    H = q_ref.shape[-1]
    head = lax.axis_index("heads")
    tile = num_tiles - 1 - lax.axis_index("tiles")  # each sequence's last (longest causal) tiles first
    kvh = head // group
    wg = lax.axis_index("wg")
    seq = tseq_ref[tile]
    row0 = tunit_ref[tile] * 8  # a multiple of 8, visibly so
    pos0 = tpos_ref[tile]
    lo, hi = tlo_ref[tile], thi_ref[tile]
    kv_hi = tkv_ref[tile]  # keys [0, kv_hi) can be visible to this tile
    steps = (kv_hi + BK - 1) // BK

    @pl.when((wg < 2) & (hi > lo))
    def _compute():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")
        q_smem, o_smem = q_smem2.at[wg], o_smem2.at[wg]
        r0 = wg * BQ
        layout = plgpu.Layout.WGMMA

        # Register layouts are Mosaic GPU's; the CPU interpreter takes plain arrays.
        def iota(shape, dim):
            if interpret:
                return lax.broadcasted_iota(jnp.int32, shape, dim)
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)

        def cast(x, lay):
            return x if interpret else plgpu.layout_cast(x, lay)

        def mma(a, b_ref, shape, trans_b=False):
            """a @ b (b.T with trans_b) into a fresh float32 accumulator: wgmma on the GPU; plain dots in
            the CPU interpreter (it has no transposed wgmma operands)."""
            if interpret:
                a = a[...] if hasattr(a, "at") else a
                b = b_ref[...]
                return jnp.dot(a, b.T if trans_b else b, preferred_element_type=jnp.float32)

            def scope(acc_ref):
                plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b_ref, (1, 0)) if trans_b else b_ref)
                return acc_ref[...]

            return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))

        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0 + r0, BQ), head], q_smem, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        # Row r's query position, clamped onto the tile's last token (the rows after it are not stored and
        # must not see keys the stored rows do not).
        last = jnp.maximum(kv_hi - 1, 0)
        q_pos = jnp.minimum(pos0 + r0 + iota((BQ, BK), 0), last)
        k_off = iota((BQ, BK), 1)
        first = jnp.maximum(pos0 + r0 + jnp.maximum(lo - r0, 0), 0)  # this warpgroup's first stored row's position
        full = jnp.minimum((first + 1) // BK, steps)  # blocks no stored row masks (rows before may: not stored)

        def block(step, carry, masked):
            acc, m_i, l_i = carry
            slot = lax.rem(step, steps_in_flight)
            plgpu.barrier_wait(k_ready.at[slot])
            s = mma(q_smem, k_smem.at[slot], (BQ, BK), trans_b=True) * scale_log2
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                s = jnp.where(step * BK + k_off <= q_pos, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m_i - m_safe)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_ready.at[slot])
            if masked:  # the last block's V rows past the context: zeros (stale or NaN otherwise)

                @pl.when(step == steps - 1)
                def _zero_tail():
                    rows = iota((BK, H), 0)
                    v_blk = v_smem.at[slot]
                    v_blk[...] = jnp.where(step * BK + rows < kv_hi, v_blk[...], jnp.zeros((), dtype))
                    plgpu.commit_smem()

            acc = acc + mma(p.astype(dtype), v_smem.at[slot], (BQ, H))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        carry = (
            cast(jnp.zeros((BQ, H), jnp.float32), layout),
            cast(jnp.full((BQ,), -jnp.inf, jnp.float32), layout.reduce(1)),
            cast(jnp.zeros((BQ,), jnp.float32), layout.reduce(1)),
        )
        carry = lax.fori_loop(0, full, functools.partial(block, masked=False), carry)
        acc, _, l_i = lax.fori_loop(full, steps, functools.partial(block, masked=True), carry)
        l_i = jnp.where(l_i > 0, l_i, 1.0)
        o_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        # This warpgroup's stored rows [a, b) of its 64, in power-of-two pieces (their offsets are dynamic:
        # the SMEM buffer is untiled for that).
        a = jnp.clip(lo - r0, 0, BQ)
        n = jnp.clip(hi - r0, 0, BQ) - a
        at = a
        for size in (64, 32, 16, 8, 4, 2, 1):

            @pl.when((n & size) != 0)
            def _store(at=at, size=size):
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(at, size)], o_ref.at[pl.ds(row0 + r0 + at, size), head])

            at = at + (n & size)
        plgpu.wait_smem_to_gmem(0)

    @pl.when((wg == 2) & (hi > lo))
    def _memory():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")

        def load(step, slot):
            for j in range(ppb):
                page = jnp.clip(bt_ref[seq, step * ppb + j], 0, P - 1)  # past the context: any page, see above
                dst = pl.ds(j * S, S)
                plgpu.copy_gmem_to_smem(k_ref.at[kvh, page], k_smem.at[slot, dst], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[kvh, page], v_smem.at[slot, dst], v_ready.at[slot])

        @pl.loop(0, steps)
        def _(step):
            slot = lax.rem(step, steps_in_flight)

            @pl.when(step >= steps_in_flight)
            def _():
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            load(step, slot)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "steps_in_flight", "skip_single", "interpret"))
def ragged_prefill_mgpu(
    q,
    k_pages,
    v_pages,
    seq_lens,
    query_start_loc,
    block_tables,
    *,
    scale,
    block_kv=128,
    steps_in_flight=2,
    skip_single=False,
    interpret=False,
):
    """q [T, N, H] -> [T, N, H]; see the module docstring. Padding tokens get zeros; with skip_single the
    one-token sequences get no tile and their rows are unspecified (the entry point attends them with the
    decode kernel)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    T, N, H = q.shape
    K, P, S, _ = k_pages.shape
    group = N // K
    ppb = block_kv // S
    plan = tile_plan_aligned(query_start_loc, seq_lens, T, skip_single)
    nt = plan[0].shape[0]
    bt = pad_block_tables(block_tables, ppb).astype(jnp.int32)
    dtype = q.dtype
    # TMA reads rows past the end as zeros, but wants the row count a multiple of its 8-row tiling (the engine's
    # token buckets are); the CPU interpreter raises on reads past the end.
    rows = TILE if interpret else -T % 8
    if rows:
        q = jnp.pad(q, ((0, rows), (0, 0), (0, 0)))
    kernel = functools.partial(
        _kernel,
        num_tiles=nt,
        group=group,
        block_kv=block_kv,
        page_size=S,
        steps_in_flight=steps_in_flight,
        scale_log2=scale * math.log2(math.e),
        dtype=dtype,
        interpret=interpret,
    )

    def entry(*refs):
        tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scoped: kernel(*refs, (scoped[0:4], scoped[4:7], scoped[7:9])),
            plgpu.SMEM((2, BQ, H), dtype, transforms=tiled),
            plgpu.SMEM((2, BQ, H), dtype),  # output staging: untiled (stored at any row)
            plgpu.SMEM((steps_in_flight, block_kv, H), dtype, transforms=tiled),
            plgpu.SMEM((steps_in_flight, block_kv, H), dtype, transforms=tiled),
            plgpu.Barrier(num_arrivals=ppb, num_barriers=steps_in_flight),
            plgpu.Barrier(num_arrivals=ppb, num_barriers=steps_in_flight),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=2, num_barriers=steps_in_flight),
            plgpu.Barrier(num_arrivals=2, num_barriers=steps_in_flight),
            collective_axes="wg",
        )

    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        kw["interpret"] = InterpretGPUParams()
    out = plgpu.kernel(
        kernel_named(entry, "ragged_prefill_mgpu"),
        out_type=jax.ShapeDtypeStruct((T + (-T % 8), N, H), dtype),
        grid=(N, nt),
        grid_names=("heads", "tiles"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kw,
    )(*plan, bt, q, k_pages, v_pages)
    return out[:T] if T % 8 else out
