"""InputBatch: host arrays that persist across steps, one row per running sequence (no jax).

Rebuilding every sequence's block table and sampling settings each step costs ~1 ms of Python at 256
sequences. Here a sequence keeps its row while it runs: its block table only appends the pages it gained
since the last step, its sampling settings (and the sampler features they need) are written once, and a
step gathers the rows it needs with one fancy index. Rows come back when the scheduler reports the sequence
freed (finished, aborted or preempted).
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

# Sampling settings stored per row, in this column order.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
PADDING_ROW = (0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0)  # a greedy, filter-free row

# Bits of InputBatch.features: what a row's sampling params ask of the sampler (fixed for a request).
HAS_PARAMS, FILTERING, PENALTIES, ALLOWED_IDS, LOGPROBS, PROMPT_LOGPROBS, STRUCTURED = (1 << i for i in range(7))

_seq_id = attrgetter("seq_id")
_block_table = attrgetter("block_table")


def feature_bits(sp) -> int:
    if sp is None:
        return 0
    penalties = sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1
    return (
        HAS_PARAMS
        | FILTERING * (sp.top_p < 1.0 or sp.top_k > 0)
        | PENALTIES * penalties
        | ALLOWED_IDS * bool(sp.allowed_token_ids)
        | LOGPROBS * (sp.logprobs is not None)
        | PROMPT_LOGPROBS * (sp.prompt_logprobs is not None)
        | STRUCTURED * (sp.structured_outputs is not None)
    )


class InputBatch:
    def __init__(self, max_rows: int, max_pages: int, pad_page: int = 0):
        self.tables = np.full((max_rows, max_pages), pad_page, np.int32)
        self.num_pages = np.zeros(max_rows, np.int64)  # pages of each row's table written so far
        self.sampling = np.tile(np.asarray(PADDING_ROW, np.float32), (max_rows, 1))
        self.seeds = np.zeros(max_rows, np.uint32)
        self.features = np.zeros(max_rows, np.uint8)  # feature_bits of the row's sampling params
        self._row: dict[str, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            row = self._row.pop(seq_id, None)
            if row is not None:
                self._free.append(row)

    def truncate(self, trimmed: dict[str, int]) -> None:
        """Block tables that shrank (SchedulerOutput.trimmed: seq_id -> pages kept): their rows are rewritten past
        that point by the next rows() (a table that shrank and grew back to its length has new pages there)."""
        for seq_id, kept in trimmed.items():
            row = self._row.get(seq_id)
            if row is not None:
                self.num_pages[row] = min(self.num_pages[row], kept)

    def rows(self, seqs) -> np.ndarray:
        """Row of each sequence ([n] int), assigning rows to new ones and appending new pages."""
        # Every step passes all running sequences, so the common case (known rows, a new page for a few)
        # goes through C-level map()s and one numpy compare instead of a Python loop over the sequences.
        n = len(seqs)
        found = list(map(self._row.get, map(_seq_id, seqs)))
        if None in found:
            found = [self._assign(seq) if row is None else row for seq, row in zip(seqs, found)]
        out = np.fromiter(found, np.int64, n)
        lens = np.fromiter(map(len, map(_block_table, seqs)), np.int64, n)
        changed = np.flatnonzero(lens != self.num_pages[out])
        if len(changed):
            # A decode gains one page every block_size steps, so some sequences grew by exactly one page.
            k = self.num_pages[out[changed]]
            one = lens[changed] == k + 1
            grown = changed[one].tolist()
            self.tables[out[grown], k[one]] = [seqs[i].block_table[-1] for i in grown]
            for i in changed[~one].tolist():  # new rows, chunked prefills, re-admissions
                row, table, k = found[i], seqs[i].block_table, int(self.num_pages[found[i]])
                start = k if len(table) > k else 0  # a table never shrinks while its row lives; rewrite if so
                self.tables[row, start : len(table)] = table[start:]
            self.num_pages[out[changed]] = lens[changed]
        return out

    def _assign(self, seq) -> int:
        if not self._free:
            raise RuntimeError(
                f"InputBatch has no free row for {seq.seq_id!r}: more running sequences than "
                f"{self.tables.shape[0]} rows (a freed sequence was not released?)."
            )
        row = self._free.pop()
        self._row[seq.seq_id] = row
        self.num_pages[row] = 0
        sp = seq.sampling_params
        self.sampling[row] = PADDING_ROW if sp is None else [getattr(sp, f) for f in SAMPLING_FIELDS]
        self.seeds[row] = key_seed(getattr(seq, "rng_seed", 0) or 0)
        self.features[row] = feature_bits(sp)
        return row


def key_seed(seed: int) -> int:
    """The sampler's 32-bit key seed for a request seed of up to 64 bits (negative ones as two's complement):
    splitmix64's finalizer, so seeds that differ only in their high bits (0 and 2**32, 5 and 2**63 + 5) still
    get unrelated streams (truncating to the low 32 bits made them equal)."""
    z = seed & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 32
