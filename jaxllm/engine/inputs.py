"""StepInputs: one step's flat ragged batch as padded numpy arrays (host side, no jax).

Padding keeps shapes inside a small set of buckets so each bucket compiles once: T tokens, B sequences,
M block-table columns. Padding tokens write nowhere (slot -1); padding sequences have length 0 and point
their block tables at pad_page, a page that is safe to read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass
class SeqChunk:
    token_ids: list[int]  # the new tokens of this step (may hold placeholders fed from the device)
    start: int  # position of the first new token = tokens already in the cache
    block_table: list[int]  # pages covering positions 0 .. start + len(token_ids) - 1


@dataclass
class StepInputs:
    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32, -1 for padding
    seq_lens: np.ndarray  # [B] int32, 0 for padding sequences
    query_start_loc: np.ndarray  # [B+1] int32
    block_tables: np.ndarray  # [B, M] int32
    logits_indices: np.ndarray  # [B] int32 index of each sequence's last new token (0 for padding)
    num_tokens: int  # real tokens
    num_seqs: int  # real sequences
    decode_only: bool


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}.")


def build_step_inputs(
    chunks: list[SeqChunk],
    block_size: int,
    num_tokens_pad: int,
    num_seqs_pad: int,
    max_pages_pad: int,
    pad_page: int = 0,
    tables: np.ndarray | None = None,
) -> StepInputs:
    """tables: the chunks' block tables already as rows [len(chunks), max_pages_pad] (an InputBatch gather;
    entries past a table's pages are ignored), instead of flattening the lists."""
    n = len(chunks)
    q_lens = np.fromiter((len(c.token_ids) for c in chunks), np.int32, n)
    n_tok = int(q_lens.sum())
    token_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int32, n_tok)
    starts = np.fromiter((c.start for c in chunks), np.int32, n)
    t_lens = np.fromiter((len(c.block_table) for c in chunks), np.int32, n)
    if tables is None:
        tables = _flatten_tables([c.block_table for c in chunks], t_lens, max_pages_pad, pad_page)
    return step_inputs(
        token_ids, q_lens, starts, t_lens, tables, block_size, num_tokens_pad, num_seqs_pad, max_pages_pad, pad_page
    )


def _flatten_tables(lists: list[list[int]], t_lens: np.ndarray, M: int, pad_page: int) -> np.ndarray:
    """Block-table lists -> rows [n, M], padded with pad_page (tables wider than M are left to step_inputs'
    check, which reports them)."""
    n = len(lists)
    out = np.full((n, max(M, int(t_lens.max(initial=0)))), pad_page, np.int32)
    n_pages = int(t_lens.sum())
    if n_pages:
        flat = np.fromiter(itertools.chain.from_iterable(lists), np.int32, n_pages)
        rows = np.repeat(np.arange(n, dtype=np.int32), t_lens)
        cols = np.arange(n_pages, dtype=np.int32) - np.repeat(np.cumsum(t_lens) - t_lens, t_lens)
        out[rows, cols] = flat
    return out


def step_inputs(
    token_ids: np.ndarray,
    q_lens: np.ndarray,
    starts: np.ndarray,
    t_lens: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    num_tokens_pad: int,
    num_seqs_pad: int,
    max_pages_pad: int,
    pad_page: int = 0,
) -> StepInputs:
    """build_step_inputs from arrays: the new tokens of every chunk back to back ([sum(q_lens)]), each
    chunk's new-token count, first position and block-table length ([n] each), and its table rows [n, >= M]
    (only the first t_lens[i] entries of row i are read)."""
    # Vectorised over sequences: per-sequence numpy calls cost ~10 us each, which at 256 sequences is most
    # of a step's host budget (bench/host_overhead.py).
    T, B, M, S = num_tokens_pad, num_seqs_pad, max_pages_pad, block_size
    n = len(q_lens)
    n_tok = len(token_ids)
    if n_tok > T or n > B:
        raise ValueError(f"{n_tok} tokens / {n} sequences exceed the bucket {T} / {B}.")
    ends = starts + q_lens
    short = np.nonzero(t_lens * S < ends)[0]
    if len(short):
        b = int(short[0])
        raise ValueError(f"sequence {b}: block table covers {int(t_lens[b]) * S} < {int(ends[b])} tokens.")
    wide = np.nonzero(t_lens > M)[0]
    if len(wide):
        b = int(wide[0])
        raise ValueError(f"sequence {b}: {int(t_lens[b])} pages exceed the bucket {M}.")
    query_start_loc = np.zeros(B + 1, np.int32)
    np.cumsum(q_lens, out=query_start_loc[1 : n + 1])
    query_start_loc[n + 1 :] = n_tok
    block_tables = np.full((B, M), pad_page, np.int32)
    block_tables[:n] = tables[:, :M]
    padded_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.full(T, -1, np.int32)
    if n_tok:
        padded_ids[:n_tok] = token_ids
        if n_tok == n:  # one token per sequence (decodes): no ragged expansion
            tok_seq, pos = np.arange(n), starts
        else:
            tok_seq = np.repeat(np.arange(n, dtype=np.int32), q_lens)
            pos = np.arange(n_tok, dtype=np.int32) + np.repeat(starts - query_start_loc[:n], q_lens)
        positions[:n_tok] = pos
        slot_mapping[:n_tok] = block_tables[tok_seq, pos // S] * S + pos % S
    seq_lens = np.zeros(B, np.int32)
    seq_lens[:n] = ends
    logits_indices = np.zeros(B, np.int32)
    logits_indices[:n] = query_start_loc[1 : n + 1] - 1
    return StepInputs(
        padded_ids,
        positions,
        slot_mapping,
        seq_lens,
        query_start_loc,
        block_tables,
        logits_indices,
        n_tok,
        n,
        bool(n and (q_lens == 1).all()),
    )
