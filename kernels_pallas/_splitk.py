"""Split-K for the paged decode kernels: how many splits (choose_splits), how many tokens per KV block
(default_block_k), and the small Pallas kernel that combines the splits' partial outputs (combine_splits).

Separate from _decode because both decode kernels (_decode's Triton one and _decode_mgpu's Mosaic GPU one)
write the same partials and share this combine.

With several splits a decode kernel writes each split's normalized f32 output and its (max, sum) in the log2
domain, and one small Pallas kernel (grid (B, K, G, H / 32): single-warp programs) combines them into q's
dtype; the partials are B * N * H * 4 bytes per split, tiny next to the KV they summarize. (XLA made three
kernels of the same combine: ~4.7 us per call at B1 x 32k on an H100, where the attention kernel itself takes
~52 us; the combine folded into the attention kernel's last program per group was slower,
bench/KERNELS_NOTES.md.)

Splits are chosen statically from (B, K, pages per sequence) so that one wave of programs fills the chip:
~2 per SM, or 3 where the split-K tiles fit 3 per SM (choose_splits; measured: at B64 x 2k one split beats
two, bench/results/kernels_h100_2749f1e_prefetch_write_backend.json).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import triton_params

NUM_SMS = 132  # H100/H200; only used to size split-K statically.


def _combine_kernel(o_ref, m_ref, l_ref, out_ref, *, splits):
    """One (sequence, q head): the splits' partial outputs o [SP, H] with their m / l [SP] -> [H]. Slots >=
    splits (SP is splits rounded up to a power of two) were never written and are masked out."""
    SP = m_ref.shape[0]
    live = jnp.arange(SP, dtype=jnp.int32) < splits
    l = jnp.where(live, l_ref[...], 0.0)
    m = jnp.where(live & (l > 0), m_ref[...], -jnp.inf)
    m_max = m.max()
    w = jnp.where(l > 0, jnp.exp2(m - jnp.where(m_max == -jnp.inf, 0.0, m_max)) * l, 0.0)
    denom = w.sum()
    o = jnp.where(live[:, None], o_ref[...], 0.0)
    out = (w[:, None] * o).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)
    out_ref[...] = out.astype(out_ref.dtype)


def combine_splits(o, m, l, splits, dtype, *, interpret=False, block_h=32, num_warps=1):
    """o [B, K, SP, Gq, H], m / l [B, K, SP, Gq] (f32, log2 domain) -> [B, K, Gq, H] in dtype. One single-warp
    program per (sequence, q head, 32 columns): the call is latency-bound, so the more and smaller the
    programs the sooner it ends (B1 x 32k on an H100, XProf: 3.39 us with one 4-warp program per q head,
    2.53 with 64 columns, 2.29 with 32; kernels_h100_ce5d5f4.json)."""
    B, K, SP, Gq, H = o.shape
    HB = min(block_h, H)
    return pl.pallas_call(
        functools.partial(_combine_kernel, splits=splits),
        grid=(B, K, Gq, H // HB),
        in_specs=[
            pl.BlockSpec((None, None, SP, None, HB), lambda b, h, g, c: (b, h, 0, g, c)),
            pl.BlockSpec((None, None, SP, None), lambda b, h, g, c: (b, h, 0, g)),
            pl.BlockSpec((None, None, SP, None), lambda b, h, g, c: (b, h, 0, g)),
        ],
        out_specs=pl.BlockSpec((None, None, None, HB), lambda b, h, g, c: (b, h, g, c)),
        out_shape=jax.ShapeDtypeStruct((B, K, Gq, H), dtype),
        interpret=interpret,
        compiler_params=triton_params(num_warps, 1),
        name=f"paged_decode_combine_{splits=}",
    )(o, m, l)


def default_block_k(B, K):
    """Tokens per KV block, by measurement on an H100. When split-K has to make the parallelism (few
    sequences, long contexts): 32 (B16 x 16k: 409 vs 529 us; B1 x 32k: 75 vs 84 us,
    bench/results/kernels_h100_f69dc4a_tune.json). With enough (sequence, kv head) programs for one or two
    waves unsplit: 64 (B64 x 2k: 227 us vs 287 at 32). With many waves (the throughput workload's ~500
    sequences of ~600 tokens): 32 again (B512 x 600: 463 vs 507 us; B256 x 700: 280 vs 285 us,
    bench/results/kernels_h100_0e2d6f7_tune.json)."""
    return 64 if 2 * NUM_SMS <= B * K < 2048 else 32


def choose_splits(B, K, M, pages_per_block, page_size, num_splits=None, min_split_tokens=128):
    """Static split-K plan: (num_splits, pages_per_split) for a table of M pages; the kernel divides each
    sequence's live pages by num_splits, so no split gets more than pages_per_split."""
    if num_splits is None:
        # Programs for one wave: ~2 per SM, or 3 where the split-K tiles (block_k 32, 167 registers per
        # thread for D128 bf16) fit 3 per SM and that gives more (ncu, bench/results/kernels_h100_0b6c0b6_ncu.txt:
        # B1 x 32k had 256 CTAs where 396 fit). Measured (kernels_h100_ea7ffd5_tune.json): B1 x 32k 57.1 ->
        # 54.0-55.6 us, B2 x 128k 451 -> 381 us, B4 x 8k 62.2 -> 55.1 us; one CTA past the wave (B2 x 128k
        # with 25 splits: 516 us) costs a second wave.
        want = max(1, -(-2 * NUM_SMS // (B * K)), 3 * NUM_SMS // (B * K))
        # >= 128 tokens per split: batch 1 at 700 tokens in a 1024-token table 32.6 -> 20.2 us per call
        # (1024 before; 64 and 256 were slower, bench/results/kernels_h100_38a111a_tune.json)
        min_pages = max(pages_per_block, min_split_tokens // page_size)
        num_splits = max(1, min(want, -(-M // min_pages)))
    pps = -(-M // num_splits)
    pps = -(-pps // pages_per_block) * pages_per_block
    return -(-M // pps), pps
