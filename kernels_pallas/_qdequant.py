"""The quantized matmul kernel's "asm" dequantization (_qmatmul.py, dequant="asm"): qlayout's packed words turned
into the MMA's 16-bit operand, or the FMA variant's float32 operand, with the PTX logic instructions LOP3 and PRMT
through Triton's elementwise inline assembly, and a jnp twin of each that interpret mode runs (CPU cannot run
PTX), computing the same bits.

Magic numbers. A b-bit field q placed in the mantissa of a float whose exponent makes the field's lowest bit worth
1 reads as exactly M + q (M: the float with that exponent and an empty mantissa), so one LOP3, (t & mask) | magic,
turns bits into a number. M + q is exact wherever the mantissa holds the field:
  bfloat16  0x4300 = 128: 128 + q, q at bits 0..3 of a 16-bit half (7 mantissa bits)
  float16   0x5400 = 64: 64 + q, q at bits 4..7 of a half (10 mantissa bits)
  float32   2^(23 - p) for a field at bits p..p+b-1 (p >= 8, p + b <= 23): 2^15 / 2^11 / 2^7 + q for p 8 / 12 / 16
MMA operand (int4, 16-bit activations), two columns per instruction: one PRMT puts byte i of two words (fields 2i,
2i+1 of two elements of the [L, BN] tile) into the two halves of one register, one LOP3 makes the two halves M + q
of field 2i, a shift and another LOP3 those of field 2i + 1 (float16: the shift is the low nibble's): 4
instructions per 4 weights, against ~7 per weight for the float path (shift, and, or, float32 subtraction,
conversion, and the shuffles of unpacked values). The zero point is not subtracted per weight: the MMA multiplies
M + q exactly, and asm_kernel subtracts (M + z) * rowsum(x) per plane and column in float32.
FMA operand (float32), int4: one LOP3 per weight on the word shifted so the field sits at bits 8..19 (two shifts
per word, shared by its fields). int8, whose 8-bit fields leave a 16-bit mantissa no room for M: one PRMT per
weight moves the byte under the float32 magic 2^23, then q - z = (2^23 + q) - (2^23 + z) exactly, as the float path.

Triton hands an asm instance `pack` elements of each argument (pack=2: two int32 words) and packs 16-bit results
two per register, the first element in the low half; which elements share an instance is unspecified, so every
instruction here treats the halves of a register as two independent elements (elementwise, as Triton requires).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import mma

# 16-bit halves of the MMA operand, per dtype: for fields 2i and 2i + 1 (the low and high nibble of byte i),
# (magic, M, shift, mask): M + q = magic | ((half >> shift) & mask), shift < 0 a left shift. float16 could take
# the low nibble in place under 0x6400 (1024 + q, no shift), but the fold's float32 cancellation grows with M
# (~2e-5 of the product at M = 1024, ~1e-6 at 64): one shift per 4 weights buys the smaller M
PAIR_MAGIC = {
    jnp.dtype(jnp.bfloat16): ((0x4300, 128, 0, 0xF), (0x4300, 128, 4, 0xF)),
    jnp.dtype(jnp.float16): ((0x5400, 64, -4, 0xF0), (0x5400, 64, 0, 0xF0)),
}
# int4 fields as float32 (the FMA variant's operand): word shift (left > 0, right < 0, logical) and the bit p the
# field lands at, per field j; the shifts repeat, so each is computed once per tile and shared
F32_FIELDS = ((8, 8), (8, 12), (0, 8), (0, 12), (0, 16), (-12, 8), (-12, 12), (-12, 16))
F32_BYTE_MAGIC = 0x4B000000  # float32 2^23: byte j of a word moved under it by one PRMT reads 2^23 + q (int8)
LOP3_OR_AND = 0xEA  # LOP3's truth table for (a & b) | c: f(0xF0, 0xCC, 0xAA)


def pair_selector(i):
    """PRMT's control for byte i of both words: byte i of the first word into bytes 0 (and 1) of the result, of
    the second word (source bytes 4..7) into bytes 2 (and 3); bytes 1 and 3 are masked off afterwards."""
    return 0x4400 + 0x1111 * i


def prmt_asm(selector=None) -> str:
    """$0 = PRMT of $1 and $2 (pair_selector: byte i of two words as two 16-bit halves; byte_selector: 2^23 + byte
    j of $1 under the magic $2). selector: a static control, or None: the control is operand $3 (a plane loop's
    traced byte)."""
    return f"prmt.b32 $0, $1, $2, {'$3' if selector is None else hex(selector)};"


def half_asm(magic: int, shift: int, mask: int) -> str:
    """$0 (two 16-bit halves) = magic | (each half of $1 shifted right by `shift` (left if < 0), & mask): the
    32-bit shift moves bits across the halves' boundary only where the mask clears them."""
    lop3 = f"lop3.b32 $0, {'t' if shift else '$1'}, {mask * 0x10001:#010x}, {magic * 0x10001:#010x}, {LOP3_OR_AND:#x};"
    if not shift:
        return lop3
    op = f"shr.u32 t, $1, {shift};" if shift > 0 else f"shl.b32 t, $1, {-shift};"
    return f"{{\n.reg .b32 t;\n{op}\n{lop3}\n}}"


def pair_offsets(dtype):
    """(M of field 2i, M of field 2i + 1) for the pair dequantization's operand dtype."""
    return tuple(float(m) for _, m, _, _ in PAIR_MAGIC[jnp.dtype(dtype)])


def _asm(asm, args, pack, dtype, shape):
    from jax.experimental.pallas import triton as plgpu

    [out] = plgpu.elementwise_inline_asm(
        asm,
        args=args,
        constraints=",".join(["=r"] + ["r"] * sum(max(1, pack * jnp.dtype(a.dtype).itemsize // 4) for a in args)),
        pack=pack,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, dtype)],
    )
    return out


def dequant_pair(words, i, dtype, *, interpret):
    """words [L, BN] int32 -> (M + q of field 2i, M + q of field 2i + 1), two [L, BN] arrays of dtype (bfloat16 /
    float16), exact. i: a Python int (static PRMT control) or a traced int32 (a plane loop). Three single-output asm
    statements (jax's lowering of a multi-output one returns one value): PRMT into an int16 pair, then one LOP3
    (and a shift) per field; each 16-bit half is one element, so each statement is elementwise."""
    halves = PAIR_MAGIC[jnp.dtype(dtype)]
    if interpret:  # the same bits in jnp: byte i twice in the half (PRMT's control copies it to both bytes)
        byte = (words if isinstance(i, int) and i == 0 else jax.lax.shift_right_logical(words, jnp.int32(8) * i)) & 0xFF
        t = byte * 0x101
        return tuple(
            jax.lax.bitcast_convert_type(((shifted(t, -sh) & mask) | magic).astype(jnp.uint16), dtype)
            for magic, _, sh, mask in halves
        )
    static = isinstance(i, int)
    args = [words] if static else [words, jnp.full(words.shape, pair_selector(i), jnp.int32)]
    t = _asm(prmt_asm(pair_selector(i) if static else None), args, 2, jnp.int16, words.shape)
    return tuple(_asm(half_asm(magic, sh, mask), [t], 2, dtype, words.shape) for magic, _, sh, mask in halves)


def lop3_asm(mask: int, magic: int) -> str:
    return f"lop3.b32 $0, $1, {mask:#010x}, {magic:#010x}, {LOP3_OR_AND:#x};"


def f32_magic(p: int) -> int:
    """float32 bits of 2^(23 - p): the exponent that makes bit p of the mantissa worth 1."""
    return (127 + 23 - p) << 23


def or_and(t, mask: int, magic: int, *, interpret):
    """(t & mask) | magic on int32 [L, BN] as one LOP3 (a plain and / or compiles to two instructions: LOP3 takes
    one immediate, and ptxas does not merge them), read as float32."""
    if interpret:
        bits = (t & jnp.int32(mask)) | jnp.int32(magic)
    else:
        bits = _asm(lop3_asm(mask, magic), [t], 1, jnp.int32, t.shape)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def shifted(words, shift: int):
    if shift > 0:
        return jax.lax.shift_left(words, jnp.int32(shift))
    return jax.lax.shift_right_logical(words, jnp.int32(-shift)) if shift else words


def byte_selector(j):
    """PRMT's control that builds 2^23 + byte j: byte j of the word into byte 0, bytes 4, 5, 7 of the magic (0x00,
    0x00, 0x4B) into bytes 1..3."""
    return 0x7540 + j


def f32_field(words_by_shift, j, bits, *, interpret):
    """Field j of the words as float32 M + q (exact) and M. int4: one LOP3 on the word shifted so the field sits at
    bits 8..19 (words_by_shift: {shift: the shifted words}, filled as needed so a tile computes each shift once);
    int8: one PRMT under the 2^23 magic. j: a Python int, or a traced one (int4: the field is then shifted to bits
    8.. on its own, two shifts instead of a shared one; int8: the PRMT control is a register)."""
    words = words_by_shift[0]
    if bits == 8:
        if interpret:
            byte = (
                words if isinstance(j, int) and j == 0 else jax.lax.shift_right_logical(words, jnp.int32(8) * j)
            ) & 0xFF
            bits32 = byte | F32_BYTE_MAGIC
        else:  # the magic as a register operand $2 (an immediate would be a MOV per PRMT), the control static or $3
            args = [words, jnp.full(words.shape, F32_BYTE_MAGIC, jnp.int32)]
            static = isinstance(j, int)
            args += [] if static else [jnp.full(words.shape, byte_selector(j), jnp.int32)]
            bits32 = _asm(prmt_asm(byte_selector(j) if static else None), args, 1, jnp.int32, words.shape)
        return jax.lax.bitcast_convert_type(bits32, jnp.float32), float(1 << 23)
    if not isinstance(j, int):
        t = jax.lax.shift_left(jax.lax.shift_right_logical(words, jnp.int32(bits) * j), jnp.int32(8))
        return or_and(t, 0xF00, f32_magic(8), interpret=interpret), float(1 << 15)
    shift, p = F32_FIELDS[j]
    if shift not in words_by_shift:
        words_by_shift[shift] = shifted(words, shift)
    return or_and(words_by_shift[shift], 0xF << p, f32_magic(p), interpret=interpret), float(1 << (23 - p))


def asm_kernel(
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
    interpret,
    fold=True,
):
    """_qmatmul._kernel's body for dequant="asm" / "asm_sub" (same grid, blocks and outputs). Per plane j of a
    tile, with s, z the plane's group scale and zero point and M_j the magic's offset:
      MMA, int4, fold (dequant="asm"): d = x @ (M_j + q) and r = x @ ones (x's row sums, from a second MMA on the
        same x operand: the tensor cores are idle in this kernel, a reduction over x's columns would need
        shuffles), then acc += (d - (M_j + z) r) * s in float32 (per channel: s once at the end).
      MMA, int4, no fold (dequant="asm_sub"): (M_j + q) - (M_j + z) in x's dtype (exact; bf16x2 / f16x2 adds,
        half an instruction per weight), one MMA, acc += d * s: no row sums and no fold epilogue, which grow with
        the rows (sm_90 SASS, triton 3.9: at M = 64 5.4 instructions per weight against the fold's 7.4 and the
        float path's 8.5; at M = 16 the fold's 3.3 beat its 3.6).
      MMA, int8: the field as float32 M + q, minus (M + z) (exact), rounded to x's dtype (exact: |q - z| < 256),
        one MMA, the scale on its result, as the float path.
      FMA (CUDA cores, one [L, BN] float32 accumulator per row): per group w = s (q - z) from M + q in float32,
        exact (int4 with bfloat16 scales: s (M + q) - s (M + z) with both products exact, one FFMA fused or not;
        else the exact q - z times s), per channel w = q - z and s once at the end; then acc += w x.
    Accuracy: the FMA variant, int8 and asm_sub compute exactly what the float path does (s (q - z) or q - z exact).
    The int4 MMA's fold subtracts two float32 terms of size ~(M + z) |x| per row: exact MMA operands, an error of
    a few float32 ulps of (M + 15) sum|x| per plane (tensor-core accumulation truncates), ~1e-5 of the product's
    size for bfloat16 (M = 128) and ~1e-4 for float16 (M = 1024), under the output's own rounding (2^-9 / 2^-11)."""
    z_ref = rest[0] if has_zeros else None
    o_ref = rest[-1]
    P, L = 32 // bits, plane
    TK = L * P
    BM, BN = x_ref.shape[0], qw_ref.shape[-1]
    R = replicas
    cdt = x_ref.dtype
    per_channel = group_size == -1
    lo = pl.program_id(1) * tiles_per_split
    hi = jnp.minimum(lo + tiles_per_split, num_tiles)

    def group(k0):  # the group's (scale, zero point) as [1, BN] float32 rows (a constant zero when symmetric)
        g = 0 if per_channel else k0 // group_size
        z = z_ref[g, :].astype(jnp.float32)[None, :] if has_zeros else float(1 << (bits - 1))
        return s_ref[g, :].astype(jnp.float32)[None, :], z

    channel = group(0) if per_channel else None

    def scale_zero(k0):
        return channel if per_channel else group(k0)

    def x_slice(k0):
        if R == 1:
            return x_ref[:, pl.ds(k0, L)]
        # the copies loaded by row index (row r of the MMA reads x's row r % BM): no register shuffles
        return x_ref[jax.lax.rem(jax.lax.iota(jnp.int32, R * BM), BM), pl.ds(k0, L)]

    def tiles(body, init):
        def tile(t, acc):
            return body(qw_ref[pl.ds(t * L, L), :], t, acc)

        return jax.lax.fori_loop(lo, hi, tile, init)

    def planes(n, step, acc):  # planes (or pairs of planes) unrolled, or as a loop (one's registers live at a time)
        if plane_loop:
            return jax.lax.fori_loop(0, n, step, acc)
        for j in range(n):
            acc = step(j, acc)
        return acc

    if fma:
        # s (M + q) and s (M + z) are exact float32 products when M + q has <= 16 significant bits (int4's fields
        # here: M <= 2^15) and s <= 8 (bfloat16)
        exact_fold = bits == 4 and jnp.dtype(s_ref.dtype) == jnp.dtype(jnp.bfloat16)

        def fma_tile(words, t, acc):
            by_shift = {0: words}

            def step(j, acc):
                k0 = t * TK + j * L
                w, m = f32_field(by_shift, j, bits, interpret=interpret)
                s, z = scale_zero(k0)
                if per_channel:  # q - z; the scale once at the end
                    w = w - (m + z)
                else:
                    w = w * s - s * (m + z) if exact_fold else (w - (m + z)) * s
                return tuple(acc[r] + w * x_ref[r, pl.ds(k0, L)].astype(jnp.float32)[:, None] for r in range(BM))

            return planes(P, step, acc)

        acc = tiles(fma_tile, tuple(jnp.zeros((L, BN), jnp.float32) for _ in range(BM)))
        for r in range(BM):
            row = acc[r].sum(axis=0)
            o_ref[r, :] = (row * s_ref[0, :].astype(jnp.float32) if per_channel else row).astype(o_ref.dtype)
        return

    if bits == 4:
        ones = jnp.ones((L, BN), cdt)
        offsets = pair_offsets(cdt)

        def folded(k0, v, m, acc):
            xs = x_slice(k0)
            s, z = scale_zero(k0)
            if fold:
                d = mma(xs, v) - (m + z) * mma(xs, ones)
            else:  # "asm_sub": (M + q) - (M + z) in x's dtype, exact (small integers), one HADD2 per 2 weights
                d = mma(xs, v - jnp.asarray(m + z, jnp.float32).astype(cdt))
            return acc + d if per_channel else acc + d * s

        def mma_tile(words, t, acc):
            def step(i, acc):
                for half, v in enumerate(dequant_pair(words, i, cdt, interpret=interpret)):
                    acc = folded(t * TK + (2 * i + half) * L, v, offsets[half], acc)
                return acc

            return planes(P // 2, step, acc)

    else:

        def mma_tile(words, t, acc):
            by_shift = {0: words}

            def step(j, acc):
                k0 = t * TK + j * L
                w, m = f32_field(by_shift, j, bits, interpret=interpret)
                s, z = scale_zero(k0)
                d = mma(x_slice(k0), (w - (m + z)).astype(cdt))
                return acc + d if per_channel else acc + d * s

            return planes(P, step, acc)

    acc = tiles(mma_tile, jnp.zeros((R * BM, BN), jnp.float32))
    if R > 1:  # the copies are bitwise equal; max (not sum) keeps them exact
        acc = acc.reshape(R, BM, BN).max(0)
    if per_channel:
        acc = acc * channel[0]
    o_ref[...] = acc.astype(o_ref.dtype)
