"""Ragged prefill attention over paged KV as a Mosaic GPU kernel (Hopper: TMA, wgmma, warp specialization).

Same contract as _ragged.ragged_paged_attention_kernel (a flat batch of query chunks, each causal over its
sequence's whole paged context), for bf16 / fp16 pages, head dim 64 / 128 and page sizes 8..128 that divide the
KV block; no ALiBi, sliding window or fp8 (the Triton kernel serves those).

Tiling. Each sequence's chunk is cut into tiles of 128 tokens (tile_plan, as the Triton kernel); one CTA owns
(query head, tile): two compute warpgroups of 64 query rows each and one memory warpgroup. The memory
warpgroup walks the sequence's block table BK keys at a time and copies each page's K and V ([S, H], one TMA
each) into a ring of steps_in_flight SMEM slots (table entries past the context are clipped into the cache:
their keys are masked and their V rows zeroed, see below). Each compute warpgroup multiplies its q tile by every K block (wgmma into
registers), runs an online softmax in the log2 domain with the causal mask on the diagonal blocks, and
multiplies P by V (wgmma). V rows past the context in the last block are zeroed in SMEM first (they may hold
stale values of a freed sequence, NaN included, and P being 0 there does not make 0 * NaN zero). Both
warpgroups consume every block of the tile (the earlier one's extra diagonal keys are masked), so the ring's
"consumed" barriers always get both arrivals in order.

q is gathered into the tiles' padded row order ([tiles * 128, N, H]) and each warpgroup writes its 64 output
rows to a buffer of that shape with one TMA; the caller gathers the tokens' rows back (TMA boxes into tiled
SMEM need provably aligned row offsets, and a sequence's chunk starts at any token; the two copies cost ~10%
of a 4k chunk's time).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._common import pad_block_tables
from ._ragged import tile_plan

BQ = 64  # query rows per compute warpgroup
TILE = 2 * BQ  # tokens per CTA


def supported(q, k_pages, *, alibi_slopes=None, sliding_window=None, k_scale=1.0, v_scale=1.0, block_kv=128,
              **_) -> bool:
    """The inputs this kernel takes (the others go to the Triton kernel)."""
    K, P, S, H = k_pages.shape
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    unit_scales = all(isinstance(x, (int, float)) and x == 1.0 for x in (k_scale, v_scale))
    return (jnp.dtype(q.dtype) in dtypes and jnp.dtype(k_pages.dtype) == jnp.dtype(q.dtype) and H in (64, 128)
            and q.shape[1] % K == 0 and 8 <= S <= block_kv and block_kv % S == 0 and alibi_slopes is None
            and sliding_window is None and unit_scales)


def _kernel(tseq_ref, tpos_ref, ttok_ref, trows_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, scoped, *,
            num_tiles, group, block_kv, page_size, steps_in_flight, scale_log2, dtype, interpret):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    (q_smem2, k_smem, v_smem), (k_ready, v_ready, q_ready), (k_free, v_free) = scoped
    BK, S = block_kv, page_size
    ppb = BK // S
    P = k_ref.shape[1]
    H = q_ref.shape[-1]
    head = lax.axis_index("heads")
    tile = num_tiles - 1 - lax.axis_index("tiles")  # each sequence's last (longest causal) tiles first
    kvh = head // group
    wg = lax.axis_index("wg")
    seq = tseq_ref[tile]
    pos0 = tpos_ref[tile]
    nrows = trows_ref[tile]
    kv_hi = jnp.where(nrows > 0, pos0 + nrows, 0)  # keys [0, kv_hi) can be visible to this tile
    steps = (kv_hi + BK - 1) // BK

    @pl.when(wg < 2)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")
        q_smem = q_smem2.at[wg]
        row0 = wg * BQ
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(tile * TILE + row0, BQ), head], q_smem, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        # Row r's query position (rows past the tile's tokens are clamped onto its last one: they never see
        # keys the real rows do not).
        last = jnp.maximum(kv_hi - 1, 0)
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

        q_pos = jnp.minimum(pos0 + row0 + iota((BQ, BK), 0), last)
        k_off = iota((BQ, BK), 1)
        full = jnp.where(nrows > 0, jnp.minimum((pos0 + row0 + 1) // BK, steps), 0)  # blocks no row masks

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
        q_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[pl.ds(tile * TILE + row0, BQ), head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")

        def load(step, slot):
            for j in range(ppb):
                page_idx = step * ppb + j
                page = jnp.clip(bt_ref[seq, page_idx], 0, P - 1)  # past the context: any page, zeroed below
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
def ragged_prefill_mgpu(q, k_pages, v_pages, seq_lens, query_start_loc, block_tables, *, scale, block_kv=128,
                        steps_in_flight=2, skip_single=False, interpret=False):
    """q [T, N, H] -> [T, N, H]; see the module docstring. Padding tokens get zeros; with skip_single the
    one-token sequences get no tile and their rows are unspecified (the entry point attends them with the
    decode kernel)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    T, N, H = q.shape
    K, P, S, _ = k_pages.shape
    group = N // K
    ppb = block_kv // S
    lens = seq_lens.astype(jnp.int32)
    tseq, tpos, ttok, trows = tile_plan(query_start_loc, lens, T, TILE, skip_single)
    nt = tseq.shape[0]
    bt = pad_block_tables(block_tables, ppb).astype(jnp.int32)
    dtype = q.dtype
    # q in the tiles' padded row order (tile i's rows are tokens ttok[i] ..; past the end: a zero row): TMA
    # row offsets into the tiled SMEM must be provably aligned, and a sequence's chunk starts anywhere.
    src = jnp.minimum(ttok[:, None] + jnp.arange(TILE, dtype=jnp.int32)[None, :], T).reshape(-1)
    q = jnp.concatenate([q, jnp.zeros((1, N, H), dtype)])[src]
    kernel = functools.partial(
        _kernel, num_tiles=nt, group=group, block_kv=block_kv, page_size=S, steps_in_flight=steps_in_flight,
        scale_log2=scale * math.log2(math.e), dtype=dtype, interpret=interpret)

    def entry(tseq_ref, tpos_ref, ttok_ref, trows_ref, bt_ref, q_ref, k_ref, v_ref, o_ref):
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scoped: kernel(tseq_ref, tpos_ref, ttok_ref, trows_ref, bt_ref, q_ref, k_ref, v_ref, o_ref,
                                   (scoped[0:3], scoped[3:6], scoped[6:8])),
            plgpu.SMEM((2, BQ, H), dtype, transforms=transforms),
            plgpu.SMEM((steps_in_flight, block_kv, H), dtype, transforms=transforms),
            plgpu.SMEM((steps_in_flight, block_kv, H), dtype, transforms=transforms),
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
        entry,
        out_type=jax.ShapeDtypeStruct((nt * TILE, N, H), dtype),
        grid=(N, nt),
        grid_names=("heads", "tiles"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kw,
    )(tseq, tpos, ttok, trows, bt, q, k_pages, v_pages)
    # Token t's row in the padded output: its tile's block of TILE rows, then its offset in the tile.
    qsl = query_start_loc.astype(jnp.int32)
    q_len = qsl[1:] - qsl[:-1]
    per_seq = (q_len + TILE - 1) // TILE
    if skip_single:
        per_seq = jnp.where(q_len == 1, 0, per_seq)
    tile_start = jnp.cumsum(per_seq) - per_seq
    t = jnp.arange(T, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(qsl, t, side="right").astype(jnp.int32) - 1, 0, seq_lens.shape[0] - 1)
    off = t - qsl[b]
    live = t < qsl[-1]
    pad_off = t - qsl[-1]
    tile_of = jnp.where(live, tile_start[b] + off // TILE, tile_start[-1] + per_seq[-1] + pad_off // TILE)
    row = jnp.clip(tile_of * TILE + jnp.where(live, off, pad_off) % TILE, 0, nt * TILE - 1)
    return out[row]
