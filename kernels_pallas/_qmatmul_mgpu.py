"""Weight-only int4 matmul as a Mosaic GPU kernel (Hopper: a TMA ring of the packed weight, the weight as wgmma's
register operand), for the decode step's few rows.

y = x @ W with W [K, N] = (q - z) * s, q int4, groups of `group_size` rows of K (or one per channel). The kernel
computes y^T = W^T x^T: wgmma's 64-row operand is a 64-column slice of W, transposed, held in registers; the rows of
x (up to 256, in blocks of a multiple of 8: wgmma's smallest N; the TMA copies zero-fill the rows past x's) are its
shared-memory operand. So one row of x needs no padding to wgmma's 64 rows, and the dequantization happens in
registers, with no shared-memory round trip of the dequantized weight.

The layout it reads ("nk", made from qlayout's planes by `nk_layout`, or by jaxllm.models.quant while loading): the
weight transposed, int4 [N, Kp], values q - 8 (signed int4: GPTQ's symmetric z = 8 becomes 0), K permuted within
each 64 inputs (`nk_permute`: each lane's 16 values of a row for wgmma's register operand side by side, in the order
the conversion below makes pairs); scales [G, N] in x's dtype; asymmetric weights also zeros [G, N] as z - 8 in x's
dtype. A program owns BM * nw columns of W (one compute warpgroup per 64) and a split of K; a memory warpgroup
copies [64, block_k] weight blocks (row-major in shared memory) and the matching [Mp, block_k] block of x into a ring
of `stages` shared-memory slots (with inline_copies, the default for some shapes: `default_inline`, the one compute
warpgroup issues those copies itself). Per block the compute warpgroup loads each thread's two rows with 64-bit loads and
turns each value pair into 16 bits with one shift and one LOP3 (`_biased_weight`: the two nibbles masked into the
mantissa of bias = 128 (bf16) / 1024 (f16), their sign bit flipped back) and one subtract of bias + z; runs one wgmma
into a fresh float32 accumulator and adds it times the group's scale to the running sum (the scale on the product,
as _qmatmul does). Mosaic GPU's own path (an int4 load in WGMMA_UPCAST_4X layout, its relayout to WGMMA and
FragmentedArray.astype) took ~200 instructions a block a thread, 32 of them the relayout's warp shuffles and permutes
(ncu, bench/results/nk_ncu_source_h200_69729e3_gate_up.csv); the permuted layout made each kernel 4 % faster at one
row, 7-10 % asymmetric (one H200, bench/results/quant_kernels_nk_h200_340bf3d_m1_*.json), and the LOP3 written as
inline PTX (ptxas had made arith's and + xor two instructions) 3-8 % more at 1-16 rows: the loop is 154 instructions
a block, 34 LOP3, 27 SHF, 32 HADD2, 8 HGMMA (bench/results/quant_kernels_nk_h200_cacc39c_*.json, nk_ncu_*_cacc39c_*).
A second wgmma chain a block (d988207's bias_sum: ones times the x block, to take the bias off the product instead
of 32 HADD2) made every kernel 30-40 % slower, so the 8 register-operand HGMMAs and their wait are a large part of a
block's time. Up to `sync_rows` rows (SYNC_ROWS = 16 by default) each block's product is per-warp
mma.sync.m16n8k16 instead, as Marlin does (_mma_sync): no warpgroup arrive and wait. One H200, M = 1, us against
wgmma: qkv 6.58 / 6.92, o 5.09 / 5.29, gate_up 23.21 / 24.31, down 12.13 / 12.78; at M = 16 within 1.5 % either way
(bench/results/quant_kernels_nk_h200_b66bf74_syncrows.json; gpu_parity gptq_int4 passes with it:
gpu_parity_gptq_h200_b66bf74_sync16.json).
Output: float32 split-K partials [S, N, Mp] (y^T per split), summed and transposed by the caller; or with rows_first
[S, M, N] (y per split): the y^T tile goes to shared memory transposed (the WGMMA_TRANSPOSED layout, a shuffle and a
permute a register pair) and its TMA store drops the rows past M, so the decoder's 1-2-row qkv partials reach the
attention kernel with no XLA sum or transpose in front of it (quant_matmul.split_k). Only there: on one H200 the
rows-first store made o's and down's kernel 1.6 us slower (7.47 / 16.11 against 5.86 / 14.52 us at M = 1; qkv 7.78
against 7.76, gate_up 26.47 against 26.67; bench/results/quant_kernels_nk_h200_6deb82c_*.json).

More rows than one wgmma takes (offline decode batches, prefill chunks) run `qmatmul_mgpu_wide`: the same ring and
register operand, with x's rows tiled as well (a program owns `tile_m` rows times BM * nw columns, the row tiles of a
column block launched next to each other so they share its weight blocks in L2) and all of K in one program. There
the group's scale multiplies the dequantized weight block before its wgmma (the 16-bit product rounds exactly as
the dense path's float32 (q - z) * s rounded once), so one accumulator holds the whole sum. Output: y^T [N, Mp] in
x's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import qlayout
from ._common import kernel_named
from ._splitk import NUM_SMS

BM = 64  # wgmma rows: weight columns per compute warpgroup
MAX_ROWS = 256  # wgmma's largest N
MAX_SCALE_ROWS = 256  # a TMA box's largest dimension: group rows a program copies at its start
SYNC_ROWS = 16  # rows (Mp) up to which qmatmul_mgpu multiplies with per-warp mma.sync (_mma_sync); 0: wgmma always
# Ring slots of qmatmul_mgpu up to SHORT_K_ROWS rows (Mp) with K up to SHORT_K (8B shapes: qkv, o, gate_up; not
# down's K 14336). One H200, M = 1, kernel us, two sweeps in one call (bench/results/quant_kernels_nk_h200_6b44981_
# stages_m1_*.json): 4 slots against 8, qkv 6.20 / 6.20 against 6.62 / 6.45, gate_up 21.41 / 21.43 against 22.78 /
# 22.76; down 12.32 / 12.35 against 12.24 / 12.16 with 4 (so it keeps 8); o has 4 steps a split, so 4 slots either
# way. GPTQ 8B batch 1 in one call, ITL 2.29 / 2.31 ms against 2.41 (latency_h200_bb5edb6_stages_ab.json). Not at
# 16 rows: the kernels alone were within 3 % (quant_kernels_nk_h200_c6787c2_unroll.json), but the engine's batch 16
# ran 3.73 against 3.12 ms in one run each (latency_b16_h200_bb5edb6_stages_ab.json).
SHORT_K, SHORT_K_ROWS, SHORT_K_STAGES = 8192, 8, 4
# Tried and reverted (8c85a6c, 3199f25): 256-wide K blocks for gate_up at 1-8 rows, two g128 groups a ring slot each
# multiplied by its scale, in 2 slots. The kernel alone was 3-5 % faster at one row (22.12 / 22.30 against 23.23 /
# 22.94 us in two calls), but the engine's GPTQ batch 1 was not: ITL p50 2.40 ms against 2.34 over six alternated
# runs each in three calls (bench/results/latency_h200_3199f25_bk256_ab.json, latency_b1_b8_b16_h200_77b562d_ab.json,
# latency_h200_77b562d_bk256_ab3.json); qkv, o, and 16 rows were slower as kernels (quant_kernels_nk_h200_8c85a6c_*).
# No memory warpgroup (qmatmul_mgpu(inline_copies=True)): the compute warpgroup issues its ring's copies, so a program
# is 4 warps instead of 8. One H200, kernel us, default against inline (bench/results/quant_kernels_nk_h200_
# e23ba51_inline.json, ..._2dae8b5_inline2.json, two calls): M = 1 qkv 6.26 / 6.32, o 5.05 / 4.86, gate_up 22.89 /
# 21.34 with 8 programs an SM (26.04 with 4), down 12.22 / 11.48 with 8 (12.56 with 4); M = 16 qkv 7.34 / 7.09, o 7.25
# / 5.55, gate_up 25.92 / 26.75, down 15.16 / 15.25. In the engine's batch-1 step (latency_gptq_b1_h200_26fc03c_
# inline*_prof.json) down's 8 programs an SM (28 splits) cost the add + norm pass over its partials 2.0 us more than
# the kernel saved. So by default (inline_copies=None, `default_inline`), up to SYNC_ROWS rows: the shapes one wave
# holds at 2 programs an SM (N * K < 2^25: qkv, o), and up to SHORT_K_ROWS rows the short-K shapes (gate_up) with
# INLINE_CTAS_PER_SM programs an SM; not down. With it the engine's batch-1 layer took 58.78 us against 58.91, the
# batch-16 ITL 3.00-3.04 ms against 3.06-3.10 (latency_gptq_b{1,16}_h200_bc59ff2_inline*.json).
INLINE_SMALL = 1 << 25
INLINE_CTAS_PER_SM = 8


def default_inline(mp, n, kp, *, sync_rows=SYNC_ROWS) -> bool:
    """qmatmul_mgpu's inline_copies when not given (see INLINE_SMALL), on the mma.sync path only (mp <= sync_rows:
    the row counts measured, 1 and 16; the wgmma path keeps its memory warpgroup)."""
    return mp <= sync_rows and (n * kp < INLINE_SMALL or (mp <= SHORT_K_ROWS and kp <= SHORT_K))


def supported(x_dtype, n, kp, bits, group_size, block_k=128, nw=1) -> bool:
    """The inputs this kernel takes: 16-bit x, int4, N a multiple of BM * nw, groups a multiple of block_k (or per
    channel), Kp a multiple of block_k."""
    return (
        jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and bits == 4
        and n % (BM * nw) == 0
        and kp % block_k == 0
        and block_k % NK_GROUP == 0
        and (group_size == -1 or group_size % block_k == 0)
    )


def nk_layout(qweight, scales, zeros, *, plane, dtype):
    """qlayout's planes (qweight [Kp / 8, N] int32, scales / zeros [G, N]) -> this kernel's layout: (wt int4 [N, Kp]
    holding q - 8, scales [G, N] in dtype, zeros - 8 [G, N] in dtype or None). jnp, for load time and benchmarks."""
    wt = nk_permute((qlayout.unpack_planes(qweight, 4, plane) - 8).T).astype(jnp.int4)
    z = None if zeros is None else (zeros.astype(jnp.float32) - 8).astype(dtype)
    return wt, scales.astype(dtype), z


NK_GROUP = 64  # K values a permutation group of the nk layout spans (block_k is a multiple of it)


def nk_permute(q):
    """[..., K] in K order -> the nk layout's order (K a multiple of NK_GROUP; numpy or jax arrays). In each group of
    64 values, k = 32 j + 8 m + 2 p + e (chunk c = 4 j + m of wgmma's 8-column chunks, p the lane's column pair, e the
    pair's element) is stored at 16 p + 8 j + 4 e + m: lane p's 16 values of a row lie in two 32-bit words, word j's
    nibbles m and 4 + m (bits 4m and 16 + 4m) holding chunk 4 j + m's pair. See _biased_weight."""
    *lead, K = q.shape
    n = len(lead) + 1
    x = q.reshape(*lead, K // NK_GROUP, 2, 4, 4, 2)  # (j, m, p, e)
    return x.transpose(*range(n), n + 2, n, n + 3, n + 1).reshape(*lead, K)  # (p, j, e, m)


def nk_unpermute(q):
    """nk_permute's inverse."""
    *lead, K = q.shape
    n = len(lead) + 1
    x = q.reshape(*lead, K // NK_GROUP, 4, 2, 2, 4)  # (p, j, e, m)
    return x.transpose(*range(n), n + 1, n + 3, n, n + 2).reshape(*lead, K)  # (j, m, p, e)


def _bias(dtype) -> float:
    """_biased_weight's offset: its values are bias + q, exact in dtype (bf16: 128 + q; f16: 1024 + q)."""
    return 128.0 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else 1024.0


def _w_tiling(block_k):
    """The weight ring's shared-memory transforms: tiles of 8 rows x block_k, i.e. row-major bytes, unswizzled (the
    tiling makes Mosaic GPU address the TMA copy of int4 boxes by tile; untiled, its int4 column offsets doubled)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return (plgpu.TilingTransform((8, block_k)),)


def _submatrices(shape):
    """Mosaic GPU's WGMMA layout of a [BM, n] array: each of a thread's register indices -> (row, column) where the
    8 x 8 submatrix that register holds a row pair of starts (row 0 or 8 within the warp's 16 rows)."""
    import jax.experimental.mosaic.gpu as mgpu
    import numpy as np
    from jax.experimental.mosaic.gpu import utils

    layout = mgpu.WGMMA_LAYOUT
    strides = layout.tiling.tile_strides(tuple(utils.get_contiguous_strides(shape)))
    return {
        idx: divmod(sum(i * s for i, s in zip(idx, strides)), shape[1])
        for idx in np.ndindex(layout.registers_shape(shape))
    }


def _biased_weight(w_ref, dtype):
    """A [BM, block_k] block of nk-layout int4 (nk_permute's order, values q - 8) in shared memory (row-major, no
    swizzle) -> bias + q in dtype (_bias), in the WGMMA layout wgmma takes as its register operand. Each thread loads
    its two rows' words with 64-bit loads (two 32-bit words a row and 64-value group: nk_permute puts them side by
    side) and makes each pair of values with one shift and one LOP3: the two nibbles masked into the low mantissa
    bits of the two halves of bias's bit pattern, their sign bit (q - 8 stored as int4) flipped back (the pattern's
    bit 3). No shuffles or permutes: the layout was permuted once at load time."""
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import numpy as np
    from jax.experimental.mosaic.gpu import utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    block_k = w_ref.shape[-1]
    half = int(np.array(_bias(dtype), dtype).view(np.uint16)) | 8  # bias's bit pattern, bit 3 set (bf16 0x4308)
    magic = half * 0x10001  # both halves: (x & 0x000f000f) ^ magic = bias + q in each

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(_w_tiling(block_k)),),
        return_type=plgpu.ShapeDtypeStruct((BM, block_k), dtype, layout=plgpu.Layout.WGMMA),
    )
    def biased(ctx, ref):
        del ctx
        i32, i64, i8 = (ir.IntegerType.get_signless(b) for b in (32, 64, 8))
        c32 = lambda v: arith.constant(i32, v)  # noqa: E731
        layout = mgpu.WGMMA_LAYOUT
        tid = utils.thread_idx()  # i32, the block's
        lane = arith.remui(tid, c32(32))
        warp = arith.remui(arith.divui(tid, c32(32)), c32(4))
        row = arith.addi(arith.muli(warp, c32(16)), arith.divui(lane, c32(4)))
        pair = arith.remui(lane, c32(4))
        base = utils.memref_ptr(ref)
        row_bytes = block_k // 2
        words = {}
        for h in range(2):  # the thread's rows: row, row + 8
            off = arith.addi(arith.muli(arith.addi(row, c32(8 * h)), c32(row_bytes)), arith.muli(pair, c32(8)))
            for g in range(block_k // NK_GROUP):
                byte = arith.extui(i64, arith.addi(off, c32(32 * g)))
                v = llvm.load(ir.VectorType.get((2,), i32), utils.getelementptr(base, [byte], i8))
                for j in range(2):
                    words[h, g, j] = llvm.extractelement(v, arith.constant(i32, j))
        reg_ty = ir.VectorType.get((2,), utils.dtype_to_ir_type(dtype))
        regs = np.empty(layout.registers_shape((BM, block_k)), dtype=object)
        for idx, (dr, dc) in _submatrices((BM, block_k)).items():
            g, rem = divmod(dc // 8, 8)
            j, m = divmod(rem, 4)
            w = words[dr // 8, g, j]
            if m:
                w = arith.shrui(w, c32(4 * m))
            # (w & 0x000f000f) ^ magic as one LOP3: from arith's and + xor ptxas made two (ncu at 76d4880)
            v = llvm.inline_asm(i32, [w], f"lop3.b32 $0, $1, 0x000f000f, {magic:#010x}, 0x6a;", "=r,r")
            regs[idx] = utils.bitcast(v, reg_ty)
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return biased(w_ref)


def _x_transforms():
    """x's ring slots in shared memory: 8 x 64 tiles, 128-byte swizzle (wgmma's shared-memory operand)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _mma_sync(a, x_slot, dtype):
    """a [BM, block_k] (q - z in x's dtype, WGMMA layout) times the x block [Mp, block_k] in shared memory
    (_x_transforms) transposed -> [BM, Mp] float32 in the WGMMA layout, with per-warp mma.sync.m16n8k16 instead of one
    warpgroup wgmma: each warp's 16 rows of a are already mma.sync's A fragments (registers (dr, dc), (8 + dr, dc),
    (dr, dc + 8), (8 + dr, dc + 8) of a 16-column step), each B fragment two 32-bit loads of x (rows 8 nt + lane / 4,
    columns 2 (lane % 4) and 8 more; the swizzle XORs the 16-byte chunk with the row), and the accumulators' layout is
    the WGMMA layout's. Two accumulator chains (even and odd steps), summed. No warpgroup arrive / wait a block."""
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import numpy as np
    from jax.experimental.mosaic.gpu import utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    Mp, block_k = x_slot.shape
    ty = "bf16" if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else "f16"
    asm = f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, {{$8,$9}}, {{$10,$11,$12,$13}};"

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(_x_transforms())),
        return_type=plgpu.ShapeDtypeStruct((BM, Mp), jnp.float32, layout=plgpu.Layout.WGMMA),
    )
    def mma(ctx, a_frag, ref):
        del ctx
        i32, i8, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8), ir.F32Type.get()
        c32 = lambda v: arith.constant(i32, v)  # noqa: E731
        layout = mgpu.WGMMA_LAYOUT

        a_regs = {rc: utils.bitcast(a_frag.registers[idx], i32) for idx, rc in _submatrices((BM, block_k)).items()}
        lane = arith.remui(utils.thread_idx(), c32(32))
        g, t = arith.divui(lane, c32(4)), arith.remui(lane, c32(4))
        base = utils.memref_ptr(ref)
        row = arith.addi(arith.muli(g, c32(128)), arith.muli(t, c32(4)))  # bytes into a tile: row g, column pair t

        def x_word(nt, c):  # x[8 nt + g, 8 c + 2 t : + 2] as an i32: tile (nt, c // 8), chunk c % 8 swizzled with g
            tile = (nt * (block_k // 64) + c // 8) * 1024
            chunk = arith.muli(arith.xori(g, c32(c % 8)), c32(16))
            byte = arith.extui(ir.IntegerType.get_signless(64), arith.addi(arith.addi(row, chunk), c32(tile)))
            return llvm.load(i32, utils.getelementptr(base, [byte], i8))

        struct = llvm.StructType.get_literal([f32] * 4)
        zero = arith.constant(f32, 0.0)
        acc = {}
        for nt in range(Mp // 8):
            chains = [[zero] * 4, [zero] * 4]
            for kk in range(block_k // 16):
                a = [a_regs[0, 16 * kk], a_regs[8, 16 * kk], a_regs[0, 16 * kk + 8], a_regs[8, 16 * kk + 8]]
                b = [x_word(nt, 2 * kk), x_word(nt, 2 * kk + 1)]
                d = llvm.inline_asm(struct, [*a, *b, *chains[kk % 2]], asm, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                chains[kk % 2] = [llvm.extractvalue(f32, d, [i]) for i in range(4)]
            acc[nt] = [arith.addf(u, v) for u, v in zip(*chains, strict=True)]
        out = np.empty(layout.registers_shape((BM, Mp)), dtype=object)
        vec = ir.VectorType.get((2,), f32)
        for idx, (dr, dc) in _submatrices((BM, Mp)).items():
            d = acc[dc // 8]
            v = llvm.mlir_undef(vec)
            for i, e in enumerate(d[0:2] if dr == 0 else d[2:4]):
                v = llvm.insertelement(v, e, c32(i))
            out[idx] = v
        return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)

    return mma(a, x_slot)


def _q_minus_z(w_slot, z_row, dtype, interpret):
    """A ring slot's weight block ([BM, block_k] nk-layout int4 in shared memory) -> q - z in dtype, wgmma's register
    operand; z_row: the block's group row of zeros - 8 ([BM]; asymmetric) or None (symmetric, z = 8). On a GPU
    _biased_weight's bias + q minus bias + 8 (+ z - 8): one subtract a value pair; the interpreter unpermutes."""
    if interpret:
        a, off = nk_unpermute(w_slot[...]).astype(dtype), 0.0
    else:
        a, off = _biased_weight(w_slot, dtype), _bias(dtype) + 8
    if z_row is None:
        return a - off if off else a
    return a - lax.broadcast_in_dim(z_row + off, a.shape, [0])


def default_stages(mp, kp, steps, *, nw=1, block_k=128, sync_rows=SYNC_ROWS) -> int:
    """qmatmul_mgpu's ring slots: as many as fit ~96 KB (two programs an SM), 2..8, at most one a K block of the
    split (steps); SHORT_K_STAGES up to SHORT_K_ROWS rows on the mma.sync path (mp <= sync_rows) with K up to
    SHORT_K."""
    per_stage = nw * BM * block_k // 2 + mp * block_k * 2
    most = SHORT_K_STAGES if mp <= SHORT_K_ROWS and mp <= sync_rows and kp <= SHORT_K else 8
    return max(2, min(most, steps, (96 << 10) // per_stage))


def plan(n, kp, group_size, *, block_k=128, nw=1, ctas_per_sm=2, min_steps=2):
    """Splits of K: the fewest (dividing K's blocks, whole groups each) that give about ctas_per_sm programs an SM,
    at least min_steps blocks each, and at most MAX_SCALE_ROWS group rows a program."""
    blocks = kp // block_k
    group_blocks = blocks if group_size == -1 else group_size // block_k
    cols = n // (BM * nw)
    choices = [s for s in range(1, blocks + 1) if blocks % s == 0 and (blocks // s) % group_blocks in (0, blocks // s)]
    ok = [s for s in choices if blocks // s >= min(min_steps, blocks)]
    fits = [s for s in ok if -(-blocks // s // group_blocks) <= MAX_SCALE_ROWS]
    for s in fits:
        if cols * s >= ctas_per_sm * NUM_SMS:
            return s
    return fits[-1] if fits else blocks


def _kernel(
    x_ref,
    w_ref,
    s_ref,
    *refs,
    asym,
    nw,
    block_k,
    steps,
    stages,
    group_blocks,
    dtype,
    rows_first,
    sync_rows,
    inline_copies,
    interpret,
):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    z_ref = refs[0] if asym else None
    o_ref, scoped = refs[-2], refs[-1]
    (w_smem, x_smem, s_smem, z_smem, o_smem), (ready, free, sready) = scoped
    col, split, wg = lax.axis_index("n"), lax.axis_index("s"), lax.axis_index("wg")
    n0 = col * BM * nw
    first = split * steps  # the split's first K block
    g0 = first // group_blocks  # the split's first group row (per channel: group_blocks > K's blocks, so 0)
    Mp = x_smem.shape[1]
    feed = functools.partial(
        _Feed, x_ref, w_ref, s_ref, z_ref, scoped, x_rows=pl.ds(0, Mp), n0=n0, g0=g0, first=first, steps=steps
    )

    @pl.when(wg < nw)
    def _compute():
        wgmma_layout = plgpu.Layout.WGMMA
        row_layout = wgmma_layout.reduce(1)

        def rows(ref, g):  # a group row of scales / zeros for this warpgroup's 64 columns, [BM] in the row layout
            if interpret:
                return ref[wg, g]
            return plgpu.load(ref.at[wg, g], (), layout=row_layout, optimized=False)

        def weight(slot, g):  # the block's q - z in x's dtype
            return _q_minus_z(w_smem.at[slot, wg], rows(z_smem, g) if asym else None, dtype, interpret)

        def mma(a, slot):
            if interpret:
                return jnp.dot(a, x_smem[slot].T, preferred_element_type=jnp.float32)
            if Mp <= sync_rows:
                return _mma_sync(a, x_smem.at[slot], dtype)

            def scope(acc_ref):
                plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(x_smem.at[slot], (1, 0)))
                return acc_ref[...]

            return pl.run_scoped(scope, plgpu.ACC((BM, Mp), jnp.float32))

        if inline_copies:  # this warpgroup copies too: the scales and the ring's first blocks, then one a step
            copies = feed()
            copies.scales()
            for step in range(min(stages, steps)):
                copies.block(step, step)
        plgpu.barrier_wait(sready.at[0])

        def body(step, acc):
            slot = lax.rem(step, stages)
            g = step // group_blocks
            plgpu.barrier_wait(ready.at[slot])
            part = mma(weight(slot, g), slot)
            if not inline_copies:
                plgpu.barrier_arrive(free.at[slot])
            s = rows(s_smem, g).astype(jnp.float32)
            acc = acc + part * lax.broadcast_in_dim(s, (BM, Mp), [0])
            if inline_copies:

                @pl.when(step + stages < steps)
                def _():  # every warp has read the slot: refill it with block step + stages
                    _warpgroup_sync(interpret)
                    copies.block(step + stages, slot)

            return acc

        acc0 = jnp.zeros((BM, Mp), jnp.float32)
        acc = lax.fori_loop(0, steps, body, acc0 if interpret else plgpu.layout_cast(acc0, wgmma_layout))
        cols = pl.ds(n0 + wg * BM, BM)
        if not rows_first:
            o_smem[wg] = acc
            out = o_ref.at[split, cols]
        else:  # the [BM, Mp] tile stored as [Mp, BM]: y's rows, each BM contiguous columns
            if interpret:
                o_smem[wg] = acc.T
            else:
                tile = plgpu.transpose_ref(o_smem.at[wg], (1, 0))
                tile[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
            out = o_ref.at[split, pl.ds(0, Mp), cols]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out)
        plgpu.wait_smem_to_gmem(0)

    if not inline_copies:

        @pl.when(wg == nw)
        def _memory():
            feed().run()


def _warpgroup_sync(interpret):
    """bar.sync over the warpgroup's 128 threads (the interpreter runs a warpgroup as one thread: nothing)."""
    if interpret:
        return
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic.gpu import utils

    @plgpu.inline_mgpu()
    def sync(ctx):
        del ctx
        utils.warpgroup_barrier()

    sync()


class _Feed:
    """The copies into a program's shared memory, for both kernels: its group rows of scales (and zeros) from g0,
    and K blocks first .. first + steps of its nw x BM weight columns and of x's rows x_rows into the ring. `run` is
    the memory warpgroup: all of them, each slot reused once the compute warpgroups release it."""

    def __init__(self, x_ref, w_ref, s_ref, z_ref, scoped, *, x_rows, n0, g0, first, steps):
        (self.w_smem, self.x_smem, self.s_smem, self.z_smem, _), (self.ready, self.free, self.sready) = scoped
        self.x_ref, self.w_ref, self.s_ref, self.z_ref = x_ref, w_ref, s_ref, z_ref
        self.x_rows, self.n0, self.g0, self.first, self.steps = x_rows, n0, g0, first, steps
        self.stages, self.nw, _, self.block_k = self.w_smem.shape

    def scales(self):
        import jax.experimental.pallas.mosaic_gpu as plgpu

        ng = self.s_smem.shape[1]
        for h in range(self.nw):
            hcols = pl.ds(self.n0 + h * BM, BM)
            plgpu.copy_gmem_to_smem(self.s_ref.at[pl.ds(self.g0, ng), hcols], self.s_smem.at[h], self.sready.at[0])
            if self.z_ref is not None:
                z = self.z_ref.at[pl.ds(self.g0, ng), hcols]
                plgpu.copy_gmem_to_smem(z, self.z_smem.at[h], self.sready.at[0])

    def block(self, step, slot):
        """K block first + step of the weight columns and of x into ring slot `slot`."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        k = pl.ds((self.first + step) * self.block_k, self.block_k)
        for h in range(self.nw):
            w = self.w_ref.at[pl.ds(self.n0 + h * BM, BM), k]
            plgpu.copy_gmem_to_smem(w, self.w_smem.at[slot, h], self.ready.at[slot])
        plgpu.copy_gmem_to_smem(self.x_ref.at[self.x_rows, k], self.x_smem.at[slot], self.ready.at[slot])

    def run(self):
        import jax.experimental.pallas.mosaic_gpu as plgpu

        stages, steps, free = self.stages, self.steps, self.free
        self.scales()

        @pl.loop(0, steps)
        def _(step):
            slot = lax.rem(step, stages)

            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])

            self.block(step, slot)

        # The last `stages` releases, so every barrier phase is observed (the interpreter checks it).
        @pl.loop(max(steps - stages, 0), steps)
        def _(step):
            plgpu.barrier_wait(free.at[lax.rem(step, stages)])


def _launch(
    kernel,
    args,
    *,
    name,
    stages,
    nw,
    block_k,
    x_rows,
    ng,
    out_dtype,
    out_type,
    grid,
    grid_names,
    interpret,
    rows_first=False,
    memory_wg=True,
):
    """Runs kernel(*refs, (smem, barriers)) on the grid with nw compute warpgroups and one memory warpgroup (none
    with memory_wg=False: the compute warpgroup copies). Shared memory: the ring (int4 weight blocks [nw, BM,
    block_k], x blocks [x_rows, block_k]), scales (and zeros, when args hold them) [nw, ng, BM], the output tile
    [nw, BM, x_rows] in out_dtype ([nw, x_rows, BM] with rows_first); barriers: a slot filled, a slot released, the scales copied. name: the kernel's, as traces show it
    (NAME_mosaic_gpu_kernel)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    asym = len(args) == 4
    dtype = args[0].dtype

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: kernel(*refs, (scoped[0:5], scoped[5:8])),
            plgpu.SMEM((stages, nw, BM, block_k), jnp.int4, transforms=_w_tiling(block_k)),
            plgpu.SMEM(
                (stages, x_rows, block_k),
                dtype,
                transforms=_x_transforms(),
            ),
            plgpu.SMEM((nw, ng, BM), dtype),
            plgpu.SMEM((nw, ng if asym else 1, BM), dtype),
            plgpu.SMEM((nw, x_rows, BM) if rows_first else (nw, BM, x_rows), out_dtype),
            plgpu.Barrier(num_arrivals=nw + 1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=nw, num_barriers=stages),
            plgpu.Barrier(num_arrivals=nw * (2 if asym else 1), num_barriers=1),
            collective_axes="wg",
        )

    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        kw["interpret"] = InterpretGPUParams()
    return plgpu.kernel(
        kernel_named(entry, name),
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=nw + 1 if memory_wg else nw,
        thread_name="wg",
        **kw,
    )(*args)


@functools.partial(
    jax.jit,
    static_argnames=(
        "group_size",
        "nw",
        "block_k",
        "splits",
        "stages",
        "ctas_per_sm",
        "rows_first",
        "sync_rows",
        "inline_copies",
        "interpret",
    ),
)
def qmatmul_mgpu(
    x,
    wt,
    scales,
    zeros=None,
    *,
    group_size,
    nw=1,
    block_k=128,
    splits=None,
    stages=None,
    ctas_per_sm=None,
    rows_first=False,
    sync_rows=SYNC_ROWS,
    inline_copies=None,
    interpret=False,
):
    """x [M, Kp] (16-bit, K zero-padded to wt's Kp), wt int4 [N, Kp] (q - 8), scales / zeros [G, N] (nk_layout) ->
    float32 split-K partials [S, N, Mp] of y^T (Mp = M rounded up to a multiple of 8), or [S, M, N] of y with
    rows_first. See the module docstring. sync_rows: up to this many rows (Mp) each block's product runs as per-warp
    mma.sync instructions (_mma_sync) instead of one warpgroup wgmma; 0: always wgmma. inline_copies (nw = 1 only;
    None: default_inline): no memory warpgroup; the compute warpgroup issues the ring's copies itself, each slot
    refilled after a warpgroup barrier once its block is multiplied (half the threads a program).

    x is not padded to Mp rows on a GPU: each K block of x is one TMA copy of an [Mp, block_k] box, whose rows past
    M the TMA unit fills with zeros (out-of-bounds reads), so a 1-row decode step runs no pad kernel before each of
    its projections (the interpreter gets the padded array)."""
    M, Kp = x.shape
    N = wt.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"qmatmul_mgpu takes at most {MAX_ROWS} rows, got {M}")
    if not supported(x.dtype, N, Kp, 4, group_size, block_k, nw):
        raise ValueError(f"qmatmul_mgpu does not take x {x.dtype} [{M}, {Kp}], N={N}, group_size={group_size}")
    if inline_copies and nw != 1:
        raise ValueError(f"inline_copies takes one compute warpgroup (nw=1), got nw={nw}")
    if inline_copies is None:
        inline_copies = nw == 1 and default_inline(-(-M // 8) * 8, N, Kp, sync_rows=sync_rows)
    if ctas_per_sm is None:  # H100 (quant_kernels_h100_*_mgpu*.json): 4 for gate_up / down, 2 for qkv / o
        ctas_per_sm = (INLINE_CTAS_PER_SM if inline_copies else 4) if N * Kp >= INLINE_SMALL else 2
    blocks = Kp // block_k
    group_blocks = (1 << 30) if group_size == -1 else group_size // block_k
    S = splits or plan(N, Kp, group_size, block_k=block_k, nw=nw, ctas_per_sm=ctas_per_sm)
    if blocks % S:
        raise ValueError(f"splits={S} must divide K's {blocks} blocks of {block_k}")
    steps = blocks // S
    ng = 1 if group_size == -1 else steps // group_blocks
    if group_size != -1 and (steps % group_blocks or ng > MAX_SCALE_ROWS):
        raise ValueError(f"splits={S}: each split must hold whole groups, at most {MAX_SCALE_ROWS}")
    Mp = -(-M // 8) * 8
    if Mp != M and interpret:  # on a GPU the TMA copies of x's Mp-row blocks read zeros past its M rows
        x = jnp.pad(x, ((0, Mp - M), (0, 0)))
    if stages is None:
        stages = default_stages(Mp, Kp, steps, nw=nw, block_k=block_k, sync_rows=sync_rows)
    asym = zeros is not None
    dtype = x.dtype
    kernel = functools.partial(
        _kernel,
        asym=asym,
        nw=nw,
        block_k=block_k,
        steps=steps,
        stages=stages,
        group_blocks=group_blocks,
        dtype=dtype,
        rows_first=rows_first,
        sync_rows=sync_rows,
        inline_copies=inline_copies,
        interpret=interpret,
    )
    if not rows_first:
        out_type = jax.ShapeDtypeStruct((S, N, Mp), jnp.float32)
    else:  # on a GPU the TMA store of each [Mp, BM] tile drops its rows past M; the interpreter writes them
        out_type = jax.ShapeDtypeStruct((S, Mp if interpret else M, N), jnp.float32)
    parts = _launch(
        kernel,
        (x, wt, scales) + ((zeros,) if asym else ()),
        name="qmatmul_nk",
        stages=stages,
        nw=nw,
        block_k=block_k,
        x_rows=Mp,
        ng=ng,
        out_dtype=jnp.float32,
        out_type=out_type,
        grid=(N // (BM * nw), S),
        grid_names=("n", "s"),
        interpret=interpret,
        rows_first=rows_first,
        memory_wg=not inline_copies,
    )
    return parts[:, :M] if rows_first and interpret else parts


WIDE_SMEM_BYTES = 216 << 10  # the wide kernel's shared memory (one program an SM; at most 227 KB)


def _wide_kernel(x_ref, w_ref, s_ref, *refs, asym, nw, block_k, steps, stages, group_blocks, dtype, regs, interpret):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    z_ref = refs[0] if asym else None
    o_ref, scoped = refs[-2], refs[-1]
    (w_smem, x_smem, s_smem, z_smem, o_smem), (ready, free, sready) = scoped
    row, col, wg = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("wg")
    n0 = col * BM * nw
    tm = x_smem.shape[1]
    m0 = row * tm

    @pl.when(wg < nw)
    def _compute():
        if regs and not interpret:  # the memory warpgroup's registers to the accumulators (512 a lane in all)
            plgpu.set_max_registers(min(232, (512 - 40) // nw // 8 * 8), action="increase")
        wgmma_layout = plgpu.Layout.WGMMA
        row_layout = wgmma_layout.reduce(1)

        def rows(ref, g):  # [BM] of a group row
            if interpret:
                return ref[wg, g]
            return plgpu.load(ref.at[wg, g], (), layout=row_layout, optimized=False)

        def weight(slot, g):  # the block's (q - z) * s in x's dtype: wgmma's register operand
            a = _q_minus_z(w_smem.at[slot, wg], rows(z_smem, g) if asym else None, dtype, interpret)
            return a * lax.broadcast_in_dim(rows(s_smem, g), (BM, block_k), [0])

        plgpu.barrier_wait(sready.at[0])
        if interpret:

            def body(step, acc):
                slot = lax.rem(step, stages)
                plgpu.barrier_wait(ready.at[slot])
                a = weight(slot, step // group_blocks)
                acc = acc + jnp.dot(a, x_smem[slot].T, preferred_element_type=jnp.float32)
                plgpu.barrier_arrive(free.at[slot])
                return acc

            acc = lax.fori_loop(0, steps, body, jnp.zeros((BM, tm), jnp.float32))
        else:

            def scope(acc_ref):
                def body(step, carry):
                    slot = lax.rem(step, stages)
                    plgpu.barrier_wait(ready.at[slot])
                    plgpu.wgmma(
                        acc_ref, weight(slot, step // group_blocks), plgpu.transpose_ref(x_smem.at[slot], (1, 0))
                    )
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(free.at[slot])
                    return carry

                lax.fori_loop(0, steps, body, None)
                return acc_ref[...]

            acc = pl.run_scoped(scope, plgpu.ACC((BM, tm), jnp.float32))
        o_smem[wg] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[pl.ds(n0 + wg * BM, BM), pl.ds(m0, tm)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == nw)
    def _memory():
        if regs and not interpret:
            plgpu.set_max_registers(40, action="decrease")
        _Feed(x_ref, w_ref, s_ref, z_ref, scoped, x_rows=pl.ds(m0, tm), n0=n0, g0=0, first=0, steps=steps).run()


def wide_tiling(m, n, kp, group_size, asym=False, nw=2) -> dict:
    """The wide kernel's default tiling for x [m, kp] and N = n: 256-row tiles of 64-wide K blocks where they still
    give ~0.7 programs an SM, pad m little more than 128-row tiles and fit shared memory, else 128-row tiles of 128;
    the compute warpgroups take the memory warpgroup's registers either way. H100, M = 512 (bench/results/quant_kernels_h100_653e6ec_wide2.json, us, 128
    against 256 rows): qkv 62.3 / 51.4, gate_up 224.4 / 209.3; o 33.2 / 49.3, down 103.5 / 158.3 (64 and 32 column
    blocks: half the SMs)."""
    wide = dict(tile_m=256, block_k=64, nw=nw, regs=True)
    padded = -(-m // 256) * 256 <= 1.15 * (-(-m // 128) * 128)  # not many more padding rows than 128-row tiles
    if padded and (n // (BM * nw)) * -(-m // 256) >= 0.7 * NUM_SMS and _wide_stages(kp, group_size, asym, **wide) >= 2:
        return wide
    return dict(tile_m=128, block_k=128, nw=nw, regs=True)


def _wide_stages(kp, group_size, asym, *, tile_m, block_k, nw, **_):
    """Ring slots that fit WIDE_SMEM_BYTES beside the scales (and zeros) and the output tile, at most 8."""
    ng = 1 if group_size == -1 else kp // group_size
    fixed = nw * BM * tile_m * 2 + nw * ng * BM * 2 * (2 if asym else 1)
    per_stage = nw * BM * block_k // 2 + tile_m * block_k * 2
    return min(8, kp // block_k, (WIDE_SMEM_BYTES - fixed) // per_stage)


def wide_supported(x_dtype, n, kp, bits, group_size, *, nw=2, block_k=128) -> bool:
    """What qmatmul_mgpu_wide takes: as `supported`, and at most MAX_SCALE_ROWS group rows over all of K."""
    groups = 1 if group_size == -1 else kp // max(group_size, 1)
    return supported(x_dtype, n, kp, bits, group_size, block_k, nw) and groups <= MAX_SCALE_ROWS


@functools.partial(
    jax.jit,
    static_argnames=("group_size", "nw", "tile_m", "block_k", "stages", "regs", "interpret"),
)
def qmatmul_mgpu_wide(
    x, wt, scales, zeros=None, *, group_size, nw=2, tile_m=128, block_k=128, stages=None, regs=False, interpret=False
):
    """x [M, Kp] (16-bit, K zero-padded to wt's Kp), wt int4 [N, Kp] (q - 8), scales / zeros [G, N] (nk_layout) ->
    y^T [N, Mp] in x's dtype, Mp = M rounded up to whole tiles of tile_m rows (at most 256, a multiple of 8). See
    the module docstring."""
    M, Kp = x.shape
    N = wt.shape[0]
    if not wide_supported(x.dtype, N, Kp, 4, group_size, nw=nw, block_k=block_k):
        raise ValueError(f"qmatmul_mgpu_wide does not take x {x.dtype} [{M}, {Kp}], N={N}, group_size={group_size}")
    if tile_m % 8 or not 8 <= tile_m <= MAX_ROWS:
        raise ValueError(f"tile_m={tile_m} must be a multiple of 8 in [8, {MAX_ROWS}]")
    steps = Kp // block_k
    group_blocks = (1 << 30) if group_size == -1 else group_size // block_k
    ng = 1 if group_size == -1 else Kp // group_size
    Mp = -(-M // tile_m) * tile_m
    if Mp != M:
        x = jnp.pad(x, ((0, Mp - M), (0, 0)))
    asym = zeros is not None
    dtype = x.dtype
    if stages is None:
        stages = _wide_stages(Kp, group_size, asym, tile_m=tile_m, block_k=block_k, nw=nw)
        if stages < 2:
            raise ValueError(f"qmatmul_mgpu_wide: tile_m={tile_m} leaves no room for two ring slots (K={Kp})")
    kernel = functools.partial(
        _wide_kernel,
        asym=asym,
        nw=nw,
        block_k=block_k,
        steps=steps,
        stages=stages,
        group_blocks=group_blocks,
        dtype=dtype,
        regs=regs,
        interpret=interpret,
    )
    # The row tiles first: the programs of one column block (its weight blocks) run side by side.
    return _launch(
        kernel,
        (x, wt, scales) + ((zeros,) if asym else ()),
        name="qmatmul_nk_wide",
        stages=stages,
        nw=nw,
        block_k=block_k,
        x_rows=tile_m,
        ng=ng,
        out_dtype=dtype,
        out_type=jax.ShapeDtypeStruct((N, Mp), dtype),
        grid=(Mp // tile_m, N // (BM * nw)),
        grid_names=("m", "n"),
        interpret=interpret,
    )


def matmul(x, wt, scales, zeros=None, *, group_size, wide=None, partials=False, interpret=False, **tuning):
    """x [..., K] @ W for a weight in this kernel's layout -> [..., N] in x's dtype: K padded to wt's Kp; wide (default:
    more than MAX_ROWS rows) runs qmatmul_mgpu_wide, else qmatmul_mgpu with its split-K partials summed and
    transposed back (one XLA fusion after the kernel). partials: qmatmul_mgpu's rows-first partials [S, M, N] of
    x [M, K], unsummed, for a consumer that sums them itself (the fused decode attention's qkv)."""
    lead, K = x.shape[:-1], x.shape[-1]
    N, Kp = wt.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if Kp != K:
        x2 = jnp.pad(x2, ((0, 0), (0, Kp - K)))
    if partials and (wide or M > MAX_ROWS or x.ndim != 2):
        raise ValueError("partials=True takes x [M <= MAX_ROWS, K] and the narrow kernel")
    if wide if wide is not None else M > MAX_ROWS:
        tuning = {**wide_tiling(M, N, Kp, group_size, zeros is not None), **tuning}
        yt = qmatmul_mgpu_wide(x2, wt, scales, zeros, group_size=group_size, interpret=interpret, **tuning)
        return yt[:, :M].T.reshape(*lead, N)
    if interpret:  # the interpreter runs programs one by one: K unsplit unless asked
        tuning.setdefault("splits", 1)
    parts = qmatmul_mgpu(
        x2, wt, scales, zeros, group_size=group_size, rows_first=partials, interpret=interpret, **tuning
    )
    if partials:
        return parts
    # Rows first, then the sum over splits: at one row the [N, 1] sum is a bitcast of [1, N], and XLA fuses the slice
    # and the sum into the consumer's fusion instead of transposing [N, Mp] in a kernel of its own.
    return parts[:, :, :M].sum(0).T.astype(x.dtype).reshape(*lead, N)
