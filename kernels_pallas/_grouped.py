"""Grouped GEMM of the mixture-of-experts layers (Pallas, Triton lowering): rows sorted by expert, each group of
rows times its own expert's weight matrix, reading only the experts that have rows.

    grouped_matmul_kernel(rows [M, K], sizes [E] int32, w [E, K, N]) -> [M, N]

rows[sum(sizes[:e]) : sum(sizes[:e + 1])] belong to expert e; rows past sum(sizes) (padding, or in expert
parallelism the pairs of other ranks' experts) give zeros.

Tiling (megablocks / vLLM fused_moe style, without a padded copy of the rows): each group's rows are cut into
tiles of BM rows that never span two groups, and the rows past the groups form one more group, of zeros. The
tile plan (jnp, outside the kernel) gives per tile its expert (-1: the zeros group), first row and row count; its
length is a static bound on the tiles any sizes can need (a group of s rows takes ceil(s / BM) tiles, at most
min(E + 1, M) groups have rows), so one compiled kernel serves every routing of a token bucket, and the tiles
past the last real one (0 rows) exit at once. Grid (tiles, N / BN): a program reads its expert id from the plan,
walks K in BK steps loading rows[tile rows, k-block] (row indices clamped to the array, the rows past the tile's
count belong to the next tile and are never stored) and w[expert, k-block, n-block] straight from global memory
(the whole weight is one ref indexed by the expert id: Triton-lowered Pallas has no data-dependent BlockSpec),
accumulates in float32 and stores its own rows only (a masked store; interpret mode, which has no masked store,
sends the other rows to a spare row that is cut off).

A decode step's T * k pairs mostly land in distinct experts: with BM = 16 each chosen expert is one tile whose
weights are read once (the MMA's 16 rows are the hardware's minimum; the idle ones cost no memory traffic), which
is the floor of the layer's memory traffic. Larger batches get larger BM (plan), up to 128 rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import mma, next_pow2, triton_params

NUM_SMS = 132  # H100 / H200: enough column blocks for ~2 programs per SM when few tiles are live
_BLOCKS = (256, 128, 64, 32, 16)
SMEM = 100 * 1024  # bytes of pipelined operand tiles per program (H100 / H200 have 227 KB a block)


def supported(dtype, k: int, n: int) -> bool:
    """K and N multiples of 16 (the MMA's smallest tile), and a float dtype the MMA takes."""
    ok = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
    return ok and k % 16 == 0 and n % 16 == 0


def _largest_block(dim: int, cap: int) -> int:
    return next(b for b in _BLOCKS if b <= cap and dim % b == 0)


def num_tiles(m: int, e: int, block_m: int) -> int:
    """Static bound on the tiles of M rows in E groups plus the zeros group: sum ceil(s_g / BM) over at most
    min(E + 1, M) non-empty groups of sum M is at most (M + groups * (BM - 1)) // BM."""
    groups = min(e + 1, m)
    return max(1, (m + groups * (block_m - 1)) // block_m)


def plan(
    m: int,
    k: int,
    n: int,
    e: int,
    itemsize: int = 2,
    *,
    block_m=None,
    block_n=None,
    block_k=None,
    num_warps=None,
    num_stages=None,
):
    """Static launch plan (BM, BN, BK, num_warps, num_stages) for M rows over E experts.
    BM follows the rows an expert gets on average, at most half of them (a group's last tile is half empty on
    average: <= 25 % idle MMA rows); decode gets 16, so each chosen expert is read by one tile;
    BN is as wide as still gives ~2 programs per SM over the tiles that can be live (decode GEMMs have few
    tiles; 64 columns keep 128-byte rows of bfloat16); BK keeps the pipeline's shared memory within SMEM."""
    half = max(1, m // (2 * e))  # half the rows an expert gets on average: a group wastes ~BM / 2 rows
    bm = block_m or min(128, max(16, next_pow2(half + 1) // 2))  # the power of two <= half, in [16, 128]
    tiles = min(num_tiles(m, e, bm), max(1, m))  # tiles that can hold rows (the zeros group aside)
    if block_n is None:
        block_n = _largest_block(n, 16)
        for b in (128, 64):
            if n % b == 0 and tiles * (n // b) >= 2 * NUM_SMS:
                block_n = b
                break
        else:
            block_n = _largest_block(n, 64)
    warps = num_warps or (8 if bm * block_n >= 128 * 128 else 4)
    stages = num_stages or (3 if bm >= 128 else 4)
    bk = block_k
    if bk is None:  # the widest K step whose pipeline stages (a [BM, BK] and a [BK, BN] tile each) fit the budget
        fits = [b for b in _BLOCKS if b <= 128 and k % b == 0 and stages * (bm + block_n) * b * itemsize <= SMEM]
        bk = fits[0] if fits else _largest_block(k, 16)
    return bm, block_n, bk, warps, stages


def tile_plan(sizes, m: int, block_m: int):
    """Per tile of the static bound: (expert id, -1 for the zeros group; first row; rows, 0 past the last tile).
    Group e's rows start at sum(sizes[:e]); the sizes are clipped so the groups end inside the M rows."""
    E = sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(sizes.astype(jnp.int32), 0)), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])  # group E: the rows past the groups (zeros)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    per_group = (ends - starts + block_m - 1) // block_m
    tile_end = jnp.cumsum(per_group)
    nt = num_tiles(m, E, block_m)
    i = jnp.arange(nt, dtype=jnp.int32)
    # compare_all: one fused [tiles, E + 1] comparison. The default ("scan") is a while loop of log2(E) steps,
    # each a few tiny kernels and copies: on an H100 that made the Qwen3-30B-A3B decode step launch-bound
    # (16 D2D copies and 16 select/add kernels per layer: latency_qwen3-30b-a3b_h100_5b65d4d_profile.json).
    g = jnp.searchsorted(tile_end, i, side="right", method="compare_all")
    g = jnp.clip(g, 0, E).astype(jnp.int32)
    j = i - (tile_end[g] - per_group[g])
    first = starts[g] + j * block_m
    live = i < tile_end[-1]
    count = jnp.where(live, jnp.clip(ends[g] - first, 0, block_m), 0)
    expert = jnp.where(g < E, g, -1)
    return expert.astype(jnp.int32), first.astype(jnp.int32), count.astype(jnp.int32)


def _grouped_kernel(te_ref, tr_ref, tn_ref, x_ref, w_ref, o_ref, *, block_m, block_n, block_k, num_rows, interpret):
    # Tiles in reverse order: the same work on a GPU, and in interpret mode (programs run in grid order) a tile that
    # stored rows past its own would overwrite its already written successor, which the tests would see.
    i = pl.num_programs(0) - 1 - pl.program_id(0)
    col = pl.ds(pl.multiple_of(pl.program_id(1) * block_n, block_n), block_n)
    expert, first, count = te_ref[i], tr_ref[i], tn_ref[i]
    K = x_ref.shape[1]
    r = jnp.arange(block_m, dtype=jnp.int32)
    rows = first + r
    mine = r < count
    src = jnp.minimum(rows, num_rows - 1)  # rows past the tile's count are read (the next tile's) but not stored

    def store(out):
        out = out.astype(o_ref.dtype)
        if interpret:  # no masked scatter there: the rows that are not this tile's go to the spare row
            o_ref[jnp.where(mine, rows, num_rows), col] = out
        else:
            plgpu.store(o_ref.at[rows, col], out, mask=jnp.broadcast_to(mine[:, None], out.shape))

    @pl.when((count > 0) & (expert >= 0))
    def _():
        e = jnp.maximum(expert, 0)

        def step(kb, acc):
            kk = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
            x = x_ref[src, kk]
            return acc + mma(x, w_ref[e, kk, col].astype(x.dtype))

        store(jax.lax.fori_loop(0, K // block_k, step, jnp.zeros((block_m, block_n), jnp.float32)))

    @pl.when((count > 0) & (expert < 0))
    def _():
        store(jnp.zeros((block_m, block_n), jnp.float32))


_STATIC = ("out_dtype", "block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_matmul_kernel(
    rows,
    sizes,
    w,
    *,
    out_dtype=None,
    block_m=None,
    block_n=None,
    block_k=None,
    num_warps=None,
    num_stages=None,
    interpret=False,
):
    """rows [M, K] sorted by expert, sizes [E] int32, w [E, K, N] -> [M, N] in out_dtype (default rows.dtype);
    rows past sum(sizes) give zeros. Tuning (static): block_m / block_n / block_k (powers of two, block_n and
    block_k dividing N and K), num_warps, num_stages; plan picks what is not given."""
    M, K = rows.shape
    E, Kw, N = w.shape
    if Kw != K or sizes.shape != (E,):
        raise ValueError(f"rows {rows.shape}, sizes {sizes.shape} and weights {w.shape} do not agree")
    if not supported(rows.dtype, K, N):
        raise ValueError(f"the grouped GEMM kernel does not take {rows.dtype} rows with K={K}, N={N} (see supported)")
    bm, bn, bk, warps, stages = plan(
        M,
        K,
        N,
        E,
        jnp.dtype(rows.dtype).itemsize,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if N % bn or K % bk or bm & (bm - 1) or bm < 16:
        raise ValueError(f"block_n={bn} / block_k={bk} must divide N={N} / K={K}; block_m={bm} a power of two >= 16")
    out_dtype = jnp.dtype(out_dtype or rows.dtype)
    te, tr, tn = tile_plan(sizes, M, bm)
    nt = te.shape[0]
    Mo = M + 1 if interpret else M  # interpret mode: one spare row for the rows a tile does not own
    full = lambda shape: pl.BlockSpec(shape, lambda t, c: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_grouped_kernel, block_m=bm, block_n=bn, block_k=bk, num_rows=M, interpret=interpret)
    out = pl.pallas_call(
        kernel,
        grid=(nt, N // bn),
        in_specs=[full((nt,)), full((nt,)), full((nt,)), full((M, K)), full((E, K, N))],
        out_specs=full((Mo, N)),
        out_shape=jax.ShapeDtypeStruct((Mo, N), out_dtype),
        interpret=interpret,
        compiler_params=triton_params(warps, stages),
        name=f"grouped_matmul_{bm=}_{bn=}_{bk=}",
    )(te, tr, tn, rows, w)
    return out[:M] if interpret else out
