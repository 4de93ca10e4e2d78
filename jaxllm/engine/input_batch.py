"""InputBatch: host arrays that persist across steps, one row per running sequence (no jax).

Rebuilding every sequence's block table and sampling settings each step costs ~1 ms of Python at 256
sequences. Here a sequence keeps its row while it runs: its block table only appends the pages it gained
since the last step, its sampling settings are written once, and a step gathers the rows it needs with one
fancy index. Rows come back when the scheduler reports the sequence freed (finished, aborted or preempted).
"""

from __future__ import annotations

import numpy as np

# Sampling settings stored per row, in this column order.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")
PADDING_ROW = (0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0)  # a greedy, filter-free row


class InputBatch:
    def __init__(self, max_rows: int, max_pages: int, pad_page: int = 0):
        self.tables = np.full((max_rows, max_pages), pad_page, np.int32)
        self.sampling = np.tile(np.asarray(PADDING_ROW, np.float32), (max_rows, 1))
        self.seeds = np.zeros(max_rows, np.uint32)
        self._num_pages = [0] * max_rows
        self._row: dict[str, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            row = self._row.pop(seq_id, None)
            if row is not None:
                self._free.append(row)

    def rows(self, seqs) -> np.ndarray:
        """Row of each sequence ([n] int), assigning rows to new ones and appending new pages."""
        out = np.empty(len(seqs), np.int64)
        num_pages, tables, row_of = self._num_pages, self.tables, self._row
        for i, seq in enumerate(seqs):
            row = row_of.get(seq.seq_id)
            if row is None:
                row = self._assign(seq)
            table = seq.block_table
            k = num_pages[row]
            if len(table) != k:
                start = k if len(table) > k else 0  # a table never shrinks while its row lives; rewrite if so
                tables[row, start : len(table)] = table[start:]
                num_pages[row] = len(table)
            out[i] = row
        return out

    def _assign(self, seq) -> int:
        if not self._free:
            raise RuntimeError(f"InputBatch has no free row for {seq.seq_id!r}: more running sequences than "
                               f"{self.tables.shape[0]} rows (a freed sequence was not released?).")
        row = self._free.pop()
        self._row[seq.seq_id] = row
        self._num_pages[row] = 0
        sp = seq.sampling_params
        self.sampling[row] = PADDING_ROW if sp is None else [getattr(sp, f) for f in SAMPLING_FIELDS]
        self.seeds[row] = (getattr(seq, "rng_seed", 0) or 0) & 0xFFFFFFFF
        return row
