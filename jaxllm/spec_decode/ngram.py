"""N-gram prompt lookup (vLLM's "ngram" method): propose the tokens that followed an earlier occurrence of the
sequence's last n tokens. Host numpy, no model.

The rule is vLLM's (v1/spec_decode/ngram_proposer.py, a KMP scan of the reversed tokens): the longest n in
[prompt_lookup_min, prompt_lookup_max] whose last-n-token suffix occurs earlier in the sequence (an occurrence
ending before the last token; it may overlap the suffix), its earliest occurrence among those of that length,
and up to k tokens that followed it (fewer when the sequence ends first). Here the scan extends the match length
one token at a time over the candidate end positions, which is the same answer in a few vectorised passes.
"""

from __future__ import annotations

import weakref

import numpy as np

_EMPTY = np.zeros(0, np.int32)


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """tokens: the sequence's token ids [L]. Returns up to k proposed ids (int32, maybe none)."""
    total = len(tokens)
    if total < min_n or total < 2 or k <= 0:
        return _EMPTY
    # ends: end positions e (e <= total - 2) of occurrences whose last n tokens match the sequence's last n.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best_n = best_end = 0
    n = 1
    while len(ends):
        best_n, best_end = n, int(ends[0])  # ascending: ends[0] is the earliest occurrence of this length
        if n == max_n or n == total - 1:
            break
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[total - 1 - n]]
        n += 1
    if best_n < min_n:
        return _EMPTY
    return tokens[best_end + 1 : best_end + 1 + k].astype(np.int32, copy=False)


class NgramProposer:
    """Proposals for many sequences. Each sequence's tokens are kept in a growing numpy buffer, extended by the
    tokens appended since the last call (converting a whole history every step would cost O(length) each); the
    buffers go with their Sequence objects (weak keys)."""

    def __init__(self, min_n: int, max_n: int, k: int):
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def tokens(self, seq) -> np.ndarray:
        """seq's prompt + output ids as a numpy view (tokens only grow, so the buffer is extended)."""
        prompt, output = seq.prompt_token_ids, seq.output_token_ids
        total = len(prompt) + len(output)
        buf, n = self._buffers.get(seq, (None, 0))
        if buf is None or total > len(buf):
            grown = np.empty(max(2 * total, 64), np.int32)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        if n < len(prompt):
            buf[n : len(prompt)] = prompt[n:]
            n = len(prompt)
        if n < total:
            buf[n:total] = output[n - len(prompt) :]
        self._buffers[seq] = (buf, total)
        return buf[:total]

    def propose(self, seq, k: int | None = None) -> list[int]:
        """Up to min(k, num_speculative_tokens) proposed ids for seq (a Sequence)."""
        k = self.k if k is None else min(k, self.k)
        if k <= 0:
            return []
        return propose_ngram(self.tokens(seq), self.min_n, self.max_n, k).tolist()
