"""Paged decode attention as a Mosaic GPU kernel (Hopper: TMA, wgmma, warp specialization).

The same contract as _decode.paged_decode_attention_kernel (one query token per sequence, split-K over the
context, the splits combined by _splitk.combine_splits) for bf16 / fp16 pages, head dim 64 / 128, G = N / K
query heads per kv head in 1..16, blocks of 64 or 128 keys (the wgmma tile's rows for the V mask), pages of
8..block_kv tokens; no ALiBi, window or fp8 (the Triton kernel
serves those). It exists to choose the decode backend by measurement (bench/kernels.py, `mgpu_decode` stage).

Tiling. A CTA owns (sequence, kv head, split) with one compute warpgroup and one memory warpgroup. wgmma needs
64 rows, so the compute warpgroup multiplies a 64-row q tile in shared memory: its rows are q viewed as
[B * N, H], copied by TMA from the row (b * K + h) * G rounded down to a multiple of 8 (Mosaic GPU's layout
inference needs TMA row offsets into tiled shared memory that are visibly multiples of its 8-row tiling), so
the G rows of this kv head sit at rows r0 .. r0 + G - 1 of the tile. The other rows are whatever the copy or
the shared memory held: every operation on the tile is row-wise (scores, softmax, P.V), so they never reach
the stored rows, and only those rows are stored. The memory warpgroup copies each page's K and V ([S, H], one
TMA each) of the split's blocks into a ring of `slots` shared-memory slots; table entries past the split are
clipped into the cache, their keys masked and their V rows zeroed in shared memory before the P.V wgmma (stale
pages may hold NaN). With one split the kernel writes the output in q's dtype; with several each split writes
its normalized float32 output and its (max, sum) in the log2 domain for _splitk.combine_splits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._common import kernel_named, next_pow2, whole_blocks_table
from ._splitk import NUM_SMS, combine_splits

BQ = 64  # wgmma rows


def supported(
    q, k_pages, *, alibi_slopes=None, sliding_window=None, soft_cap=None, k_scale=1.0, v_scale=1.0, block_kv=64, **_
) -> bool:
    """The inputs this kernel takes (the others go to the Triton kernel)."""
    B, N, H = q.shape
    K, P, S, _ = k_pages.shape
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    unit_scales = all(isinstance(x, (int, float)) and x == 1.0 for x in (k_scale, v_scale))
    return (
        jnp.dtype(q.dtype) in dtypes
        and jnp.dtype(k_pages.dtype) == jnp.dtype(q.dtype)
        and H in (64, 128)
        and N % K == 0
        and N // K <= 16
        and block_kv in (64, 128)
        and 8 <= S <= block_kv
        and block_kv % S == 0
        and alibi_slopes is None
        and sliding_window is None
        and soft_cap is None
        and unit_scales
    )


def choose_splits(B, K, M, pages_per_block, page_size, ctas_per_sm=2, min_split_tokens=128):
    """Splits per (sequence, kv head) for about ctas_per_sm CTAs per SM, >= min_split_tokens tokens each."""
    want = max(1, ctas_per_sm * NUM_SMS // (B * K))
    min_pages = max(pages_per_block, min_split_tokens // page_size)
    return max(1, min(want, -(-M // min_pages)))


def _q_rows(G):
    """Rows of q copied per CTA: the G rows start anywhere in the first 8."""
    return 8 * (-(-(7 + G) // 8))


def _kernel(
    lens_ref,
    bt_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    G,
    num_splits,
    block_kv,
    page_size,
    slots,
    scale_log2,
    dtype,
    regs,
    interpret,
):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    *outs, scoped = refs
    final = num_splits == 1
    o_ref, m_ref, l_ref = outs if not final else (outs[0], None, None)

    (q_smem, k_smem, v_smem, o_smem, m_smem, l_smem), (q_ready, k_ready, v_ready), (k_free, v_free) = scoped
    BK, S = block_kv, page_size
    ppb = BK // S
    K, P, _, H = k_ref.shape
    b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    wg = lax.axis_index("wg")
    seq_len = lens_ref[b]
    n_pages = (seq_len + S - 1) // S
    # The splits share the live pages evenly, whole blocks each (as the Triton kernel's do).
    pps = ((n_pages + num_splits - 1) // num_splits + ppb - 1) // ppb * ppb
    lo_page = split * pps
    hi_page = jnp.minimum(lo_page + pps, n_pages)
    steps = jnp.maximum((hi_page - lo_page + ppb - 1) // ppb, 0)
    lo_pos = lo_page * S
    hi_pos = jnp.minimum(hi_page * S, seq_len)

    @pl.when(wg == 0)
    def _compute():
        if regs and not interpret:
            plgpu.set_max_registers(regs[0], action="increase")
        layout = plgpu.Layout.WGMMA

        def iota(shape, dim):
            if interpret:
                return lax.broadcasted_iota(jnp.int32, shape, dim)
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)

        def cast(x, lay):
            return x if interpret else plgpu.layout_cast(x, lay)

        def mma(a, b_ref, shape, trans_b=False):
            if interpret:  # the CPU interpreter has no transposed wgmma operands
                a = a[...] if hasattr(a, "at") else a
                b = b_ref[...]
                return jnp.dot(a, b.T if trans_b else b, preferred_element_type=jnp.float32)

            def scope(acc_ref):
                plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b_ref, (1, 0)) if trans_b else b_ref)
                return acc_ref[...]

            return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))

        row = (b * K + h) * G
        a = row // 8 * 8
        r0 = row - a
        n_rows = _q_rows(G)
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(a, n_rows)], q_smem.at[pl.ds(0, n_rows)], q_ready.at[0])
        plgpu.barrier_wait(q_ready.at[0])
        k_off = iota((BQ, BK), 1)
        full = jnp.clip((hi_pos - lo_pos) // BK, 0, steps)

        def block(step, carry, masked):
            acc, m_i, l_i = carry
            slot = lax.rem(step, slots)
            plgpu.barrier_wait(k_ready.at[slot])
            s = mma(q_smem, k_smem.at[slot], (BQ, BK), trans_b=True) * scale_log2
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                s = jnp.where(lo_pos + step * BK + k_off < hi_pos, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m_i - m_safe)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_ready.at[slot])
            if masked:  # V rows past the split's end: zeros (stale pages may hold NaN; 0 * NaN is NaN)
                rows = iota((BK, H), 0)
                v_blk = v_smem.at[slot]
                v_blk[...] = jnp.where(lo_pos + step * BK + rows < hi_pos, v_blk[...], jnp.zeros((), dtype))
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
        acc, m_i, l_i = lax.fori_loop(full, steps, functools.partial(block, masked=True), carry)
        out = acc / lax.broadcast_in_dim(jnp.where(l_i > 0, l_i, 1.0), acc.shape, [0])
        if final:  # one split: the output itself, in q's dtype
            o_smem[...] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(r0, G)], o_ref.at[b, h])
        else:
            o_smem[...] = out
            m_smem[...] = m_i
            l_smem[...] = l_i
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(r0, G)], o_ref.at[b, h, split])
            plgpu.copy_smem_to_gmem(m_smem.at[pl.ds(r0, G)], m_ref.at[b, h, split])
            plgpu.copy_smem_to_gmem(l_smem.at[pl.ds(r0, G)], l_ref.at[b, h, split])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        if regs and not interpret:
            plgpu.set_max_registers(regs[1], action="decrease")

        @pl.loop(0, steps)
        def _(step):
            slot = lax.rem(step, slots)

            @pl.when(step >= slots)
            def _():
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            for j in range(ppb):
                page = jnp.clip(bt_ref[b, lo_page + step * ppb + j], 0, P - 1)  # past the split: masked, see above
                dst = pl.ds(j * S, S)
                plgpu.copy_gmem_to_smem(k_ref.at[h, page], k_smem.at[slot, dst], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[h, page], v_smem.at[slot, dst], v_ready.at[slot])

        # The last `slots` blocks' releases, so every barrier phase is observed (Mosaic GPU's interpreter checks
        # it; on the GPU this only waits for the compute warpgroup, which the CTA does anyway).
        @pl.loop(jnp.maximum(steps - slots, 0), steps)
        def _(step):
            slot = lax.rem(step, slots)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


@functools.partial(
    jax.jit,
    static_argnames=("scale", "block_kv", "slots", "num_splits", "ctas_per_sm", "plan_seqs", "regs", "interpret"),
)
def paged_decode_mgpu(
    q,
    k_pages,
    v_pages,
    seq_lens,
    block_tables,
    *,
    scale,
    block_kv=64,
    slots=4,
    num_splits=None,
    ctas_per_sm=1,
    plan_seqs=None,
    regs=None,
    interpret=False,
):
    """q [B, N, H] over the paged cache -> [B, N, H]; see the module docstring. regs: (compute, memory)
    registers per thread for the two warpgroups (setmaxnreg), or None to leave them to the compiler.
    plan_seqs: the live sequences the splits are planned for (default B), as the Triton kernel's: the engine's
    batch-1 step has a padding row (seq_len 0), whose CTAs exit at once.

    Defaults by measurement (H100 runs at cd90f98 / 88e7d4d / ebd9225 / 3baf4dc, XProf kernel time; their JSON
    was lost with the session that made them, bench/KERNELS_NOTES.md "Stop 22"): a 4-slot ring of 64-key
    blocks with one CTA per SM (128 KB of KV in flight per SM) and splits for one wave: B1 x 32k 51.9-52.4 us
    against 54.5 with 2 slots and two CTAs per SM; B64 x 2k 185.2 (2 slots: 190.4-190.7; 128-key blocks:
    183.7-185.1); setmaxnreg (208 / 48) was slower (59.6 vs 57.3 us chain time at B1 x 32k)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, N, H = q.shape
    K, P, S, _ = k_pages.shape
    G = N // K
    ppb = block_kv // S
    splits = num_splits or choose_splits(plan_seqs or B, K, block_tables.shape[1], ppb, S, ctas_per_sm)
    SP = next_pow2(splits)
    bt = whole_blocks_table(block_tables, ppb)
    q2 = q.reshape(B * N, H)
    # TMA reads rows past the end as zeros but wants whole 8-row tiles; the CPU interpreter raises on them.
    pad = _q_rows(G) if interpret else -(B * N) % 8
    if pad:
        q2 = jnp.pad(q2, ((0, pad), (0, 0)))
    kernel = functools.partial(
        _kernel,
        G=G,
        num_splits=splits,
        block_kv=block_kv,
        page_size=S,
        slots=slots,
        scale_log2=scale * math.log2(math.e),
        dtype=q.dtype,
        regs=regs,
        interpret=interpret,
    )

    def entry(*refs):
        tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scoped: kernel(*refs, (scoped[0:6], scoped[6:9], scoped[9:11])),
            plgpu.SMEM((BQ, H), q.dtype, transforms=tiled),
            plgpu.SMEM((slots, block_kv, H), q.dtype, transforms=tiled),
            plgpu.SMEM((slots, block_kv, H), q.dtype, transforms=tiled),
            plgpu.SMEM((BQ, H), q.dtype if splits == 1 else jnp.float32),  # output staging: untiled (rows from r0)
            plgpu.SMEM((BQ,), jnp.float32),
            plgpu.SMEM((BQ,), jnp.float32),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=ppb, num_barriers=slots),
            plgpu.Barrier(num_arrivals=ppb, num_barriers=slots),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_barriers=slots),
            collective_axes="wg",
        )

    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        kw["interpret"] = InterpretGPUParams()
    final = splits == 1
    if final:
        out_type = (jax.ShapeDtypeStruct((B, K, G, H), q.dtype),)
    else:
        partial_shape = jax.ShapeDtypeStruct((B, K, SP, G), jnp.float32)
        out_type = (jax.ShapeDtypeStruct((B, K, SP, G, H), jnp.float32), partial_shape, partial_shape)
    outs = plgpu.kernel(
        kernel_named(entry, "paged_decode_mgpu"),
        out_type=out_type,
        grid=(B, K, splits),
        grid_names=("b", "h", "s"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kw,
    )(seq_lens.astype(jnp.int32), bt, q2, k_pages, v_pages)
    out = outs[0] if final else combine_splits(*outs, splits, q.dtype, interpret=interpret)
    return out.reshape(B, N, H)
