"""StepInputs: one step's flat ragged batch as padded numpy arrays (host side, no jax).

Padding keeps shapes inside a small set of buckets so each bucket compiles once: T tokens, B sequences,
M block-table columns. Padding tokens write nowhere (slot -1); padding sequences have length 0 and point
their block tables at pad_page, a page that is safe to read.
"""

from __future__ import annotations

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


def build_step_inputs(chunks: list[SeqChunk], block_size: int, num_tokens_pad: int, num_seqs_pad: int,
                      max_pages_pad: int, pad_page: int = 0) -> StepInputs:
    T, B, M = num_tokens_pad, num_seqs_pad, max_pages_pad
    q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int32)
    n_tok = int(q_lens.sum())
    if n_tok > T or len(chunks) > B:
        raise ValueError(f"{n_tok} tokens / {len(chunks)} sequences exceed the bucket {T} / {B}.")
    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.full(T, -1, np.int32)
    seq_lens = np.zeros(B, np.int32)
    query_start_loc = np.zeros(B + 1, np.int32)
    query_start_loc[1 : len(chunks) + 1] = np.cumsum(q_lens)
    query_start_loc[len(chunks) + 1 :] = n_tok
    block_tables = np.full((B, M), pad_page, np.int32)
    logits_indices = np.zeros(B, np.int32)
    for b, c in enumerate(chunks):
        lo, n = query_start_loc[b], len(c.token_ids)
        end = c.start + n
        if len(c.block_table) * block_size < end:
            raise ValueError(f"sequence {b}: block table covers {len(c.block_table) * block_size} < {end} tokens.")
        if len(c.block_table) > M:
            raise ValueError(f"sequence {b}: {len(c.block_table)} pages exceed the bucket {M}.")
        pos = np.arange(c.start, end, dtype=np.int32)
        table = np.asarray(c.block_table, np.int32)
        token_ids[lo : lo + n] = c.token_ids
        positions[lo : lo + n] = pos
        slot_mapping[lo : lo + n] = table[pos // block_size] * block_size + pos % block_size
        seq_lens[b] = end
        block_tables[b, : len(table)] = table
        logits_indices[b] = lo + n - 1
    return StepInputs(token_ids, positions, slot_mapping, seq_lens, query_start_loc, block_tables,
                      logits_indices, n_tok, len(chunks), bool(len(chunks) and (q_lens == 1).all()))
