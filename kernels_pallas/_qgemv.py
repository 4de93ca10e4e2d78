"""Weight-only int4 / int8 GEMV for the decode step's 1-2 rows (Pallas, Triton lowering): _qmatmul's function for
M <= MAX_ROWS, written so that Triton pipelines the packed weight's loads and dequantizes in the MMA's own registers.

    y = x @ W, W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]   (qlayout's packed layout, unchanged)

Grid (N / BN, splits). A program owns BN output columns and one contiguous run of K's steps (split-K). A step is BL
word rows of one tile (BL divides the plane height L: a tile's L words hold its P planes, so BL rows hold BL rows
of each plane; BL < L makes the steps, and so the splits, finer). Per step the [BL, BN] int32 words are loaded once
and each of the P planes, unrolled, is one MMA: [16, BL] (x's M rows stacked to the MMA's 16) times the plane's
[BL, BN] values. With the planes unrolled in the step's body every dot reads the words, so Triton's pipeliner
copies them asynchronously into shared memory num_stages steps ahead and loads them straight into the MMA operand's
registers, where each field is turned into a 16-bit value (sm_90 SASS from the PyPI Triton: no shared-memory round
trip of the dequantized operand; _qmatmul's plane loop keeps the words' load synchronous).

The value (dequant=, static; bench/KERNELS_NOTES.md for the measurements):
- "f32": bits (q | 0x4B000000) read as float32 are 2^23 + q; minus 2^23 + z is q - z exactly, then x's dtype
  (exact: a small integer). _qmatmul's float path.
- "hi" (int4): the field shifted to the float32 mantissa's top bits under the magic of 2^7 (bfloat16 x) or 2^10
  (float16 x): the float32 is 2^7 + q (2^10 + q) with zero low bits, so its conversion to x's dtype is exact and
  needs no float subtraction; the zero point (2^7 + z) is subtracted in x's dtype (exact: integers below 2^8).
- "fold" (int4): the same 2^7 + q operand, the zero point folded out of the float32 MMA result through x's row
  sums (a second MMA of the same x against ones): d - (2^7 + z) * sum(x). float32 rounding of the larger partial
  sums only (~1e-6 relative), below x's dtype's output rounding.
The group scale multiplies the MMA's float32 result once per plane and column (a plane lies in one group), as in
_qmatmul. Output: float32 partials [splits, M, N] that the caller sums (in the fusion after it: the residual add,
silu * up, or the qkv/RoPE/write kernel that takes split-K partials).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import mma, triton_params
from .qlayout import MAGIC, PLANES, per_word

MAX_ROWS = 2  # the engine's batch-1 decode bucket; more rows take _qmatmul
NUM_SMS = 132  # H100 / H200: sizes split-K statically
DEQUANT = ("f32", "hi", "fold")
# float32 magics whose mantissa's top bits take an int4 field: (bits of 2^e, the field's bit offset) per x dtype
_HI = {jnp.dtype(jnp.bfloat16): (0x43000000, 16, 128.0), jnp.dtype(jnp.float16): (0x44800000, 13, 1024.0)}


def supported(x_dtype, m: int, n: int, bits: int, group_size: int, plane: int) -> bool:
    """Inputs the kernel takes: 16-bit x of 1..MAX_ROWS rows, N a multiple of 16, planes inside one group."""
    return (
        jnp.dtype(x_dtype) in _HI
        and 1 <= m <= MAX_ROWS
        and n % 16 == 0
        and bits in (4, 8)
        and plane in PLANES
        and (group_size == -1 or group_size % plane == 0)
    )


def default_dequant(bits: int) -> str:
    return "hi" if bits == 4 else "f32"


def plan(n: int, kp: int, bits: int, plane: int, *, block_n=None, block_l=None, splits=None):
    """Static (block_n, block_l, splits, steps per split, steps): ~4 programs an SM unless splits is given."""
    bl = block_l or plane
    if plane % bl or bl % 16:
        raise ValueError(f"block_l={bl} must be a multiple of 16 dividing the plane height {plane}")
    bn = block_n or next(b for b in (64, 32, 16) if n % b == 0)
    steps = kp // (plane * per_word(bits)) * (plane // bl)
    if splits is None:
        splits = -(-4 * NUM_SMS // (n // bn))
    splits = max(1, min(steps, splits))
    per = -(-steps // splits)
    return bn, bl, -(-steps // per), per, steps


def _kernel(x_ref, qw_ref, s_ref, *rest, rows, bits, plane, bl, group_size, has_zeros, per_split, steps, dequant):
    z_ref = rest[0] if has_zeros else None
    o_ref = rest[-1]
    M = rows
    BN = qw_ref.shape[-1]
    P, L = per_word(bits), plane
    TK, sub = L * P, L // bl
    R = 16 // M
    cdt = x_ref.dtype
    f32 = jnp.float32
    mask = (1 << bits) - 1
    per_channel = group_size == -1
    magic, at, base = _HI[jnp.dtype(cdt)]

    def zero(g):  # the zero point z as a [1, BN] float32 row (symmetric: 2^(bits - 1))
        if not has_zeros:
            return float(1 << (bits - 1))
        return z_ref[g, :].astype(f32)[None, :]

    def operand(words, j, g):
        """Plane j of the words as x's dtype: q - z ("f32", "hi") or 2^e + q ("fold")."""
        s = j * bits
        if dequant == "f32":
            q = words if s == 0 else jax.lax.shift_right_logical(words, jnp.int32(s))
            q = q & mask if j < P - 1 else q
            return (jax.lax.bitcast_convert_type(q | MAGIC, f32) - (zero(g) + float(1 << 23))).astype(cdt)
        if s < at:
            q = jax.lax.shift_left(words, jnp.int32(at - s))
        elif s > at:
            q = jax.lax.shift_right_logical(words, jnp.int32(s - at))
        else:
            q = words
        v = jax.lax.bitcast_convert_type((q & (mask << at)) | magic, f32).astype(cdt)  # 2^e + q, exact
        if dequant == "fold":
            return v
        return v - jnp.asarray(zero(g) + base, cdt)  # q - z, exact in x's dtype

    def body(i, acc):
        t, r0 = (i, 0) if sub == 1 else (i // sub, (i % sub) * bl)
        words = qw_ref[pl.ds(t * L + r0, bl), :]
        for j in range(P):
            k0 = t * TK + j * L + r0
            g = 0 if per_channel else k0 // group_size
            x16 = x_ref[:, pl.ds(k0, bl)]  # [16, BL]: R copies of the M rows
            d = mma(x16, operand(words, j, g))
            if dequant == "fold":
                d = d - (zero(g) + base) * mma(x16, jnp.ones((bl, BN), cdt))
            acc = acc + (d if per_channel else d * s_ref[g, :].astype(f32)[None, :])
        return acc

    lo = pl.program_id(1) * per_split
    acc = jax.lax.fori_loop(lo, jnp.minimum(lo + per_split, steps), body, jnp.zeros((16, BN), f32))
    y = acc.reshape(R, M, BN).max(axis=0)  # the copies are bitwise equal: max keeps them exact
    if per_channel:
        y = y * s_ref[0, :].astype(f32)[None, :]
    o_ref[...] = y


_STATIC = ("bits", "group_size", "plane", "block_n", "block_l", "splits", "dequant", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def qgemv_kernel(
    x,
    qweight,
    scales,
    zeros,
    *,
    bits,
    group_size,
    plane,
    block_n=None,
    block_l=None,
    splits=None,
    dequant=None,
    num_warps=4,
    num_stages=2,
    interpret=False,
):
    """x [M, Kp] (M <= MAX_ROWS; Kp the layout's padded K, columns in the layout's row order) times the packed
    weight -> float32 partials [splits, M, N] whose sum is the product. Tuning (static): block_n, block_l (word
    rows a step), splits (plan()), dequant (DEQUANT; default_dequant), num_warps, num_stages."""
    M, Kp = x.shape
    N = qweight.shape[1]
    if not supported(x.dtype, M, N, bits, group_size, plane):
        raise ValueError(
            f"qgemv_kernel does not take x {x.dtype} {x.shape}, N={N}, bits={bits}, group_size={group_size}, "
            f"plane={plane} (see supported)"
        )
    if Kp != qweight.shape[0] * per_word(bits):
        raise ValueError(f"x has {Kp} columns; the packed weight has {qweight.shape[0] * per_word(bits)} rows")
    dequant = dequant or default_dequant(bits)
    if dequant not in DEQUANT or (dequant != "f32" and bits != 4):
        raise ValueError(f"dequant={dequant!r}: one of {DEQUANT}, and 'hi' / 'fold' for 4-bit weights only")
    BN, BL, S, per, steps = plan(N, Kp, bits, plane, block_n=block_n, block_l=block_l, splits=splits)
    if N % BN:
        raise ValueError(f"N={N} must be a multiple of block_n={BN}")
    has_zeros = zeros is not None
    ng = scales.shape[0]
    # the MMA's 16 rows as R copies of x's M rows, stacked once here (an XLA fusion, or part of x's producer's
    # fusion in a model's step) so that each program loads them as the MMA's operand: stacked in registers, every
    # dot paid a register move per weight (sm_90 SASS), and a [2, BL] slice is too small for an async copy
    x16 = jnp.broadcast_to(x[None], (16 // M, M, Kp)).reshape(16, Kp)
    in_specs = [
        pl.BlockSpec((16, Kp), lambda n, s: (0, 0)),
        pl.BlockSpec((Kp // per_word(bits), BN), lambda n, s: (0, n)),
        pl.BlockSpec((ng, BN), lambda n, s: (0, n)),
    ]
    args = [x16, qweight, scales]
    if has_zeros:
        in_specs.append(pl.BlockSpec((ng, BN), lambda n, s: (0, n)))
        args.append(zeros)
    kernel = functools.partial(
        _kernel,
        rows=M,
        bits=bits,
        plane=plane,
        bl=BL,
        group_size=group_size,
        has_zeros=has_zeros,
        per_split=per,
        steps=steps,
        dequant=dequant,
    )
    return pl.pallas_call(
        kernel,
        grid=(N // BN, S),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, M, BN), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((S, M, N), jnp.float32),
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"qgemv_int{bits}_g{group_size}_L{plane}_{BN=}_{BL=}_{S=}_{dequant}",
    )(*args)
