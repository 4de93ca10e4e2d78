"""Weight-only int4 / int8 GEMM for decode and small batches (Pallas, Triton lowering): x [M, Kp] times a weight
in qlayout's packed layout, the integers dequantized in registers, each weight byte read once.

Grid (N / BN, splits, M / BM). A program owns BN output columns, BM rows of x and one contiguous run of K's tiles
(split-K: the splits write float32 partials that the caller sums; one split writes x's dtype). Per tile it loads
the [L, BN] int32 words once (L = the layout's plane height, 128 for g128: 32 KB at BN 64) and, for each of the P
bit fields (planes: L consecutive rows of K, qlayout), turns them into the integers q - z in float32 with no
integer-to-float conversion instruction:
    bits (q | 0x4B000000) read as float32 are exactly 2^23 + q, so (2^23 + q) - (2^23 + z) = q - z exactly
(a shift, an and / or and one subtraction per value; q - z is a small integer, exact in bfloat16), and multiplies
the plane by the matching [BM, L] slice of x with one MMA. The group scale is applied to the MMA's float32
result, once per plane and column, not to every weight: sum_k x_k (q_k - z) s = s * sum_k x_k (q_k - z) within a
group (per channel: once at the end). So the kernel's product is more exact than dequantizing to bfloat16 first
(the reference's rounding of each weight to the model's dtype is the only difference: ~2^-9 relative).

dequant="asm" (kernels_pallas/_qdequant.py; a static option, measured on an H100 at 07f2cec: correct, not faster at
M = 1, so "float" stays the default; bench/KERNELS_NOTES.md): the int4 MMA operand as 16-bit M + q straight from
Triton inline PTX (PRMT + LOP3 with the bfloat16 / float16 magic, ~1 instruction per weight; ~3.3 per weight for
the whole loop against ~6.5 on the float path in sm_90 SASS from the PyPI Triton compiler), the zero point folded
out of the MMA through x's row sums in float32;
the FMA variant's float32 operand and int8 by one LOP3 / PRMT per weight (the module docstring there).
dequant="asm_sub": the same operand with the zero point subtracted in x's dtype instead (exact, +0.5 instruction
per weight, no row-sum MMA or fold epilogue: fewer instructions from M ~ 32 on).

MMA rows: the tensor-core MMA needs >= 16 rows; batches of fewer rows are stacked R times in registers (as the
decode attention kernel stacks its query group); the entry point pads x to at least MMA_MIN_ROWS rows first.
One row (M = 1, FMA_MAX_M) takes the FMA variant instead: the plane times x's column on the CUDA cores into an
[L, BN] float32 accumulator, summed over L once at the end, with no MMA operand layout to build.

Measured (H100, jax 0.11.2, bench/quant_kernels.py; bench/KERNELS_NOTES.md "Quantized matmuls"): int4 g128 at
M = 1 reads its bytes at 0.30-0.44 of the copy bandwidth (o 9.6 us, qkv 14.6, gate_up 46.1, down 25.6: 1.4-1.6x
faster than the bf16 GEMM) and at 0.18-0.39 at M = 2..64. ncu (o, M = 1): instruction-bound, ~7 instructions
per weight and 2 warps per scheduler (181 registers in the MMA variant, 80 in the FMA one), DRAM at 19-22 %;
the dequantization's instruction count, not the bytes, sets the time (see the notes for what would close it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import mma, triton_params
from ._qdequant import asm_kernel
from .qlayout import MAGIC, PLANES, per_word

NUM_SMS = 132  # H100 / H200: sizes split-K statically
MAX_BLOCK_M = 64  # the default row block; block_m may take up to LARGEST_BLOCK_M (a measurement option)
LARGEST_BLOCK_M = 256
FMA_MAX_M = 1  # rows up to which the CUDA-core FMA variant is the default
# The MMA variant runs at least this many rows (the entry point pads x): 2 or 4 rows stacked 8 or 4 times in
# registers measured slower than 8 rows stacked twice (H100, gate_up M 2 / 4 / 8: 59.5 / 72.2 / 52.5 us)
MMA_MIN_ROWS = 8
# the dequantization: float32 magic (the default), or PTX LOP3 / PRMT (_qdequant.py) with the int4 MMA's zero point
# folded out through x's row sums ("asm") or subtracted in x's dtype ("asm_sub")
DEQUANT = ("float", "asm", "asm_sub")


def supported(x_dtype, n: int, bits: int, group_size: int, plane: int) -> bool:
    """Inputs the kernel takes: 16-bit activations (a float32 MMA would run in TF32), N a multiple of 16, and planes
    that lie inside one group (the plane divides the group size, or per channel)."""
    return (
        jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and n % 16 == 0
        and bits in (4, 8)
        and plane in PLANES
        and (group_size == -1 or group_size % plane == 0)
    )


def default_block_n(n: int, fma: bool) -> int:
    return next(b for b in ((64, 32, 16) if fma else (32, 16)) if n % b == 0)


# int4 GEMMs of up to SPLIT_WIDE_MAX_M rows split K into ~8 programs an SM (a power of two, at most SPLIT_WIDE_MAX):
# H100, M 1 / 2, the 8B shapes against the ~2-an-SM plan (quant_kernels_h100_d2cbce5_splits.json): qkv 12.4 vs
# 14.6 us (16 splits vs 3), gate_up 41.4 vs 46.1 (4 vs 1), down 22.7 vs 25.8 (16 vs 5), o 9.8 vs 9.8; at M = 2 o
# 14.1 vs 15.1, down 31.2 vs 32.8, gate_up 55.0 vs 55.5, qkv 18.3 vs 18.1. Larger M (more float32 partials to sum)
# and int8 were not measured: they keep ~2 an SM.
SPLIT_WIDE_MAX_M = 2
SPLIT_WIDE_MAX = 16


def plan(m: int, kp: int, n: int, bits: int, plane: int, *, fma: bool, block_n=None, splits=None, block_m=None):
    """Static launch plan (block_n, splits, tiles_per_split, tiles): splits over K so that ~2 programs per SM exist
    (a decode GEMM has few column blocks: o / down at BN 64 have 64), ~8 for int4 at up to SPLIT_WIDE_MAX_M rows;
    each split a whole number of tiles."""
    bn = block_n or default_block_n(n, fma)
    tiles = kp // (plane * per_word(bits))
    col_blocks = n // bn
    m_blocks = -(-m // (block_m or MAX_BLOCK_M))
    if splits is None:
        splits = -(-2 * NUM_SMS // (col_blocks * m_blocks))
        if bits == 4 and m <= SPLIT_WIDE_MAX_M:
            splits = min(SPLIT_WIDE_MAX, 1 << (-(-8 * NUM_SMS // (col_blocks * m_blocks)) - 1).bit_length())
        splits = max(1, min(tiles, splits))
    per_split = -(-tiles // splits)
    return bn, -(-tiles // per_split), per_split, tiles


def _kernel(
    x_ref,
    qw_ref,
    s_ref,
    *rest,
    bits,
    plane,
    group_size,
    has_zeros,
    tiles_per_split,
    num_tiles,
    replicas,
    plane_loop,
    fma,
    dequant,
    prefetch,
    interpret,
):
    if dequant != "float":
        return asm_kernel(
            x_ref,
            qw_ref,
            s_ref,
            *rest,
            bits=bits,
            plane=plane,
            group_size=group_size,
            has_zeros=has_zeros,
            tiles_per_split=tiles_per_split,
            num_tiles=num_tiles,
            replicas=replicas,
            plane_loop=plane_loop,
            fma=fma,
            interpret=interpret,
            fold=dequant == "asm",
        )
    z_ref = rest[0] if has_zeros else None
    o_ref = rest[-1]
    P, L = per_word(bits), plane
    TK = L * P  # K rows per tile
    mask = (1 << bits) - 1
    BM = x_ref.shape[0]
    BN = qw_ref.shape[-1]
    R = replicas
    cdt = x_ref.dtype
    per_channel = group_size == -1
    lo = pl.program_id(1) * tiles_per_split
    hi = jnp.minimum(lo + tiles_per_split, num_tiles)

    def stacked(a):  # [BM, C] -> [R * BM, C]: copies for the MMA's 16 rows
        return a if R == 1 else jnp.broadcast_to(a[None], (R,) + a.shape).reshape(R * BM, a.shape[1])

    def offset(g):  # 2^23 + z as a [1, BN] row (float32), or the symmetric zero point's constant
        if not has_zeros:
            return float((1 << 23) + (1 << (bits - 1)))
        return z_ref[g, :].astype(jnp.float32)[None, :] + float(1 << 23)

    off_channel = offset(0) if per_channel else None

    def plane_step(words, t, j, acc, static_j):
        k0 = t * TK + j * L
        q = (
            words
            if static_j and j == 0
            else jax.lax.shift_right_logical(
                words, (j * bits).astype(jnp.int32) if not static_j else jnp.int32(j * bits)
            )
        )
        if not (static_j and j == P - 1):  # the top field needs no mask after a logical shift
            q = q & mask
        g = 0 if per_channel else k0 // group_size
        off = off_channel if per_channel else offset(g)
        w = jax.lax.bitcast_convert_type(q | MAGIC, jnp.float32) - off  # q - z, exact
        scale = None if per_channel else s_ref[g, :].astype(jnp.float32)[None, :]
        if fma:  # CUDA-core FMAs into [L, BN] per row, summed over L at the end: no MMA operand layout
            out = []
            for m in range(BM):
                part = w * x_ref[m, pl.ds(k0, L)].astype(jnp.float32)[:, None]
                out.append(acc[m] + (part if per_channel else part * scale))
            return tuple(out)
        d = mma(stacked(x_ref[:, pl.ds(k0, L)]), w.astype(cdt))
        return acc + d if per_channel else acc + d * scale

    def words_at(t):
        return qw_ref[pl.ds(t * L, L), :]

    def tile(t, acc, words=None):
        words = words_at(t) if words is None else words
        if plane_loop:  # planes as a loop: one plane's registers live at a time
            return jax.lax.fori_loop(0, P, lambda j, a: plane_step(words, t, j, a, False), acc)
        for j in range(P):
            acc = plane_step(words, t, j, acc, True)
        return acc

    def run(acc):
        if not prefetch:
            return jax.lax.fori_loop(lo, hi, tile, acc)

        # the next tile's words are loaded before this tile's planes are computed, so the weight stream's DRAM
        # latency overlaps the dequantization (Triton's pipeliner leaves this load synchronous: it feeds no dot
        # directly); the last iteration reloads its own tile (an L2 hit) instead of branching
        def step(t, carry):
            acc, words = carry
            nxt = words_at(jnp.minimum(t + 1, hi - 1))
            return tile(t, acc, words), nxt

        return jax.lax.fori_loop(lo, hi, step, (acc, words_at(lo)))[0]

    if fma:
        acc = run(tuple(jnp.zeros((L, BN), jnp.float32) for _ in range(BM)))
        for m in range(BM):
            row = acc[m].sum(axis=0)
            if per_channel:
                row = row * s_ref[0, :].astype(jnp.float32)
            o_ref[m, :] = row.astype(o_ref.dtype)
        return
    acc = run(jnp.zeros((R * BM, BN), jnp.float32))
    if R > 1:  # the copies are bitwise equal; max (not sum) keeps them exact
        acc = acc.reshape(R, BM, BN).max(0)
    if per_channel:
        acc = acc * s_ref[0, :].astype(jnp.float32)[None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


_STATIC = (
    "bits",
    "group_size",
    "plane",
    "block_n",
    "block_m",
    "splits",
    "plane_loop",
    "fma",
    "dequant",
    "prefetch",
    "num_warps",
    "num_stages",
    "interpret",
)


@functools.partial(jax.jit, static_argnames=_STATIC)
def qmatmul_kernel(
    x,
    qweight,
    scales,
    zeros,
    *,
    bits,
    group_size,
    plane,
    block_n=None,
    block_m=None,
    splits=None,
    plane_loop=None,
    fma=None,
    dequant="float",
    prefetch=False,
    num_warps=None,
    num_stages=3,
    interpret=False,
):
    """x [M, Kp] (M a power of two up to 64, or a multiple of 64; Kp the layout's padded K, x's columns already in
    the layout's row order) times the packed weight -> [M, N] in x's dtype, or, when the plan splits K, float32
    partials [splits, M, N] whose sum is the product (the caller sums them, in a fusion of its own or the next
    kernel). Tuning (static): block_n, block_m (rows per program, default min(M, MAX_BLOCK_M): a larger one
    dequantizes each weight tile for more rows, the large-M case; 128 measured best at M = 256,
    quant.LARGE_M_TILING), splits, plane_loop (planes as a loop instead of unrolled; on the asm path's int4 MMA,
    pairs of planes), dequant (DEQUANT), prefetch (float
    path: load tile t + 1's weight words into registers before dequantizing tile t; not measured yet),
    num_warps, num_stages."""
    M, Kp = x.shape
    N = qweight.shape[1]
    if not supported(x.dtype, N, bits, group_size, plane):
        raise ValueError(
            f"the kernel does not take x {x.dtype}, N={N}, bits={bits}, group_size={group_size}, "
            f"plane={plane} (see supported)"
        )
    if Kp != qweight.shape[0] * per_word(bits):
        raise ValueError(f"x has {Kp} columns; the packed weight has {qweight.shape[0] * per_word(bits)} rows")
    if dequant not in DEQUANT:
        raise ValueError(f"dequant={dequant!r} is not one of {DEQUANT}")
    if prefetch and dequant != "float":
        raise ValueError(f"prefetch=True is implemented for dequant='float' only, got dequant={dequant!r}")
    BM = block_m or min(M, MAX_BLOCK_M)
    if M % BM or BM & (BM - 1) or BM > LARGEST_BLOCK_M:
        raise ValueError(
            f"M={M} must be a multiple of block_m={BM}, a power of two <= {LARGEST_BLOCK_M} "
            f"(by default M a power of two <= {MAX_BLOCK_M} or a multiple of {MAX_BLOCK_M})"
        )
    fma = M <= FMA_MAX_M if fma is None else fma
    if fma and M > 4:
        raise ValueError(f"fma=True takes at most 4 rows (one [L, BN] accumulator each), got M={M}")
    BN, S, per_split, tiles = plan(M, Kp, N, bits, plane, fma=fma, block_n=block_n, splits=splits, block_m=BM)
    # defaults by measurement (H100, bench/results/quant_kernels_h100_*.json): the FMA variant unrolled over
    # planes with 8 warps; the MMA variant with the planes as a loop (fewer live registers), 4 warps, BN 32
    plane_loop = not fma if plane_loop is None else plane_loop
    num_warps = num_warps or (8 if fma else 4)
    if N % BN:
        raise ValueError(f"N={N} must be a multiple of block_n={BN}")
    has_zeros = zeros is not None
    ng = scales.shape[0]
    in_specs = [
        pl.BlockSpec((BM, Kp), lambda n, s, m: (m, 0)),
        pl.BlockSpec((Kp // per_word(bits), BN), lambda n, s, m: (0, n)),
        pl.BlockSpec((ng, BN), lambda n, s, m: (0, n)),
    ]
    args = [x, qweight, scales]
    if has_zeros:
        in_specs.append(pl.BlockSpec((ng, BN), lambda n, s, m: (0, n)))
        args.append(zeros)
    if S == 1:
        out_shape = jax.ShapeDtypeStruct((M, N), x.dtype)
        out_spec = pl.BlockSpec((BM, BN), lambda n, s, m: (m, n))
    else:
        out_shape = jax.ShapeDtypeStruct((S, M, N), jnp.float32)
        out_spec = pl.BlockSpec((None, BM, BN), lambda n, s, m: (s, m, n))
    kernel = functools.partial(
        _kernel,
        bits=bits,
        plane=plane,
        group_size=group_size,
        has_zeros=has_zeros,
        tiles_per_split=per_split,
        num_tiles=tiles,
        replicas=max(1, 16 // BM),
        plane_loop=plane_loop,
        fma=fma,
        dequant=dequant,
        prefetch=bool(prefetch),
        interpret=bool(interpret),
    )
    return pl.pallas_call(
        kernel,
        grid=(N // BN, S, M // BM),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"qmatmul_int{bits}_g{group_size}_L{plane}_{BN=}_{S=}"
        + ("_fma" if fma else "")
        + ("" if dequant == "float" else f"_{dequant}")
        + ("_pf" if prefetch else "")
        + (f"_{BM=}" if block_m else ""),
    )(*args)
