"""The packed int weight (qlayout.py) written out dense, [Kp, N] in x's dtype, for XLA's GEMM: quant.py's path for
more rows than the int kernel takes (offline decode batches, prefill), in one Pallas (Triton) pass.

    unpack_kernel(qweight, scales, zeros, *, bits, group_size, plane, dtype) -> [Kp, N]
        (q - z) * s in float32, rounded once to dtype: qlayout.dequantize's values (rows padded to Kp, not cut to K)

Grid (tiles, N / BN). A program reads one tile's [L, BN] words once and writes its P planes, [L, BN] each, with one
shift and mask a value; the tile's scale (and zero) rows come as one small block. XLA's loop fusion of
qlayout.dequantize computes every output element from its own word instead (each word read P times, through the
caches): on an H100 at 500 rows it wrote the 8B shape's int4 weights at ~2 TB/s, 280 us a layer, a quarter of the
decode step (bench/results/throughput_gptq_h100_5d42e8a_prof.json).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import triton_params
from .qlayout import per_word

BLOCK_N = 64


def supported(n: int, group_size: int, plane: int, kp: int, bits: int) -> bool:
    """Layouts the kernel writes: N a multiple of BLOCK_N, groups of whole planes that either hold whole tiles or
    fit whole in one (qlayout guarantees the first: L divides G)."""
    if n % BLOCK_N or bits not in (4, 8):
        return False
    tile = plane * per_word(bits)
    g = kp if group_size == -1 else group_size
    return g % plane == 0 and (tile % g == 0 or g % tile == 0)


def _kernel(q_ref, s_ref, *rest, bits, planes, plane, group, has_zeros):
    z_ref = rest[0] if has_zeros else None
    o_ref = rest[-1]
    f32 = jnp.float32
    words = q_ref[...]
    for j in range(planes):
        row = j * plane // group if s_ref.shape[0] > 1 else 0  # the scale row of plane j inside the tile's block
        q = jax.lax.shift_right_logical(words, bits * j) & ((1 << bits) - 1)
        z = z_ref[row, :].astype(f32)[None, :] if has_zeros else float(1 << (bits - 1))
        o_ref[pl.ds(j * plane, plane), :] = ((q.astype(f32) - z) * s_ref[row, :].astype(f32)[None, :]).astype(
            o_ref.dtype
        )


@functools.partial(
    jax.jit, static_argnames=("bits", "group_size", "plane", "dtype", "block_n", "num_warps", "interpret")
)
def unpack_kernel(
    qweight,
    scales,
    zeros,
    *,
    bits,
    group_size,
    plane,
    dtype,
    block_n=BLOCK_N,
    num_warps=8,
    interpret=False,
):
    """See the module docstring. qweight [Kp / P, N] int32, scales / zeros [groups, N] (zeros None: symmetric)."""
    P = per_word(bits)
    rows, N = qweight.shape
    kp, tile = rows * P, plane * P
    if not supported(N, group_size, plane, kp, bits) or N % block_n:
        raise ValueError(f"unpack_kernel does not take N={N}, bits={bits}, group_size={group_size}, plane={plane}")
    g = kp if group_size == -1 else group_size
    per_tile = tile // g if tile % g == 0 else 1  # scale rows a tile reads
    if per_tile > 1:
        group_map = lambda t, n: (t, n)  # noqa: E731  (blocks of per_tile rows)
    else:
        group_map = lambda t, n: (t * tile // g, n)  # noqa: E731  (the one row of the tile's group)
    group_spec = pl.BlockSpec((per_tile, block_n), group_map)
    in_specs = [pl.BlockSpec((plane, block_n), lambda t, n: (t, n)), group_spec]
    args = [qweight, scales]
    if zeros is not None:
        in_specs.append(group_spec)
        args.append(zeros)
    kernel = functools.partial(_kernel, bits=bits, planes=P, plane=plane, group=g, has_zeros=zeros is not None)
    return pl.pallas_call(
        kernel,
        grid=(kp // tile, N // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tile, block_n), lambda t, n: (t, n)),
        out_shape=jax.ShapeDtypeStruct((kp, N), dtype),
        interpret=interpret,
        compiler_params=triton_params(num_warps, 1),
        name=f"qunpack_int{bits}_L{plane}",
    )(*args)
