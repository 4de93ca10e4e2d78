"""silu(gate) * up rounded to e4m3 with dynamic per-token scales, in one pass (Pallas, Triton lowering): the input
of an fp8 W8A8 down projection, from the gate / up projection's output (quant.fp8_silu_mlp).

    g, u = gu * row_scale * col_scale (the fp8 GEMM's unscaled product and its scales; or gu as given)
    a = silu(g) * u (float32), s = max(max|a_m| / 448, min_scale) per row, xq = round_e4m3(clip(a / s, +-448))

One program per row of gu [T, 2, F] (16-bit), over F in tiles of `block` columns. resident (the default up to
RESIDENT_MAX_F columns): every tile's a is computed once and held in registers through the row's amax and the
e4m3 stores (one read of the row); else two loops over the tiles, the amax and then the stores, each computing a
from gu (the second read from L2). a stays in float32 from the GEMM's product to the rounding, as XLA's fusion of
the same jnp keeps it where it fuses them (no 16-bit rounding of the scaled gate / up or of a).

Measured (H100, M rows x F 14336, the stage alone chained on rotating inputs, XProf; bench/results/
quant_kernels_h100_b6b7a73_silu.json): M 512: resident with 16 warps 20.3 us (0.61 of copy), 8 warps 23.1, the
looped kernel 29.4, XLA's fusions of silu_mul_fp8_ref 33.0; M 256: 11.0 / 11.5 / 17.9 / 18.2 us.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import triton_params

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
RESIDENT_MAX_F = 32768  # a row's float32 a in registers: F / (32 * num_warps) values a thread


def block_for(f: int) -> int | None:
    """The largest power-of-two tile of at most 2048 columns dividing F (at least 128), or None."""
    return next((b for b in (2048, 1024, 512, 256, 128) if f % b == 0), None)


def supported(dtype, f: int) -> bool:
    """16-bit gate / up values and F a multiple of 128."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and block_for(f) is not None


def _kernel(*refs, block, min_scale, scaled, resident):
    if scaled:
        gu_ref, rs_ref, cs_ref, xq_ref, s_ref = refs
    else:
        gu_ref, xq_ref, s_ref = refs
    F = xq_ref.shape[-1]
    f32 = jnp.float32

    def act(i):
        cols = pl.ds(i * block, block)
        g, u = gu_ref[0, cols].astype(f32), gu_ref[1, cols].astype(f32)
        if scaled:  # the fp8 GEMM's product times its token scale and channel scales, in float32
            r = rs_ref[0]
            g, u = g * r * cs_ref[0, cols], u * r * cs_ref[1, cols]
        return g * jax.nn.sigmoid(g) * u

    def store(i, a, s):
        xq_ref[pl.ds(i * block, block)] = jnp.clip(a / s, -FP8_MAX, FP8_MAX).astype(FP8)

    n = F // block
    if resident:  # the whole row's values in registers: one read of gu, no second pass
        tiles = [act(i) for i in range(n)]
        s = jnp.maximum(functools.reduce(jnp.maximum, [jnp.abs(a) for a in tiles]).max() / FP8_MAX, min_scale)
        for i, a in enumerate(tiles):
            store(i, a, s)
    else:
        amax = jax.lax.fori_loop(1, n, lambda i, m: jnp.maximum(m, jnp.abs(act(i))), jnp.abs(act(0)))
        s = jnp.maximum(amax.max() / FP8_MAX, min_scale)
        jax.lax.fori_loop(0, n, lambda i, c: store(i, act(i), s) or c, 0)
    s_ref[...] = jnp.full(s_ref.shape, s, f32)


_STATIC = ("min_scale", "block", "resident", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def silu_mul_fp8_kernel(
    gu,
    row_scale=None,
    col_scale=None,
    *,
    min_scale,
    block=None,
    resident=None,
    num_warps=16,
    num_stages=2,
    interpret=False,
):
    """gu [T, 2, F] (16-bit: gate, up) -> (xq [T, F] float8_e4m3fn, scales [T, 1] float32). row_scale [T, 1] and
    col_scale [2, F] (float32, both or neither): gu is an fp8 GEMM's unscaled product, gate / up = gu * row_scale *
    col_scale. Tuning (static): block (columns a tile, block_for(F) by default), resident (None: F <= RESIDENT_MAX_F),
    num_warps, num_stages."""
    T, C, F = gu.shape
    if C != 2 or not supported(gu.dtype, F):
        raise ValueError(
            f"silu_mul_fp8_kernel takes 16-bit [T, 2, F] with F a multiple of 128; got {gu.dtype} {gu.shape}"
        )
    scaled = row_scale is not None
    if scaled != (col_scale is not None) or (scaled and (row_scale.shape != (T, 1) or col_scale.shape != (2, F))):
        raise ValueError("row_scale [T, 1] and col_scale [2, F] come together")
    block = block or block_for(F)
    resident = F <= RESIDENT_MAX_F if resident is None else resident
    operands, specs = [gu], [pl.BlockSpec((None, 2, F), lambda t: (t, 0, 0))]
    if scaled:
        operands += [row_scale.astype(jnp.float32), col_scale.astype(jnp.float32)]
        specs += [pl.BlockSpec((None, 1), lambda t: (t, 0)), pl.BlockSpec((2, F), lambda t: (0, 0))]
    return pl.pallas_call(
        functools.partial(_kernel, block=block, min_scale=min_scale, scaled=scaled, resident=resident),
        grid=(T,),
        in_specs=specs,
        out_specs=[pl.BlockSpec((None, F), lambda t: (t, 0)), pl.BlockSpec((None, 1), lambda t: (t, 0))],
        out_shape=[jax.ShapeDtypeStruct((T, F), FP8), jax.ShapeDtypeStruct((T, 1), jnp.float32)],
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"silu_mul_fp8_{block=}" + ("_scaled" if scaled else ""),
    )(*operands)
