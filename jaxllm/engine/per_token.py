"""The engine's host work per token that needs only the request and the tokenizer (llm_engine.py calls it): the
next token's logit biases (logit_bias, min_tokens, bad_words) and the Logprob dicts of sampled and prompt tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxllm.engine.sequence import Sequence
from jaxllm.outputs import Logprob
from jaxllm.sampling_params import SamplingParams


def bias_row(seq: Sequence, tokenizer) -> dict[int, float] | None:
    """Host-side logit biases for seq's next token (the runner packs seq.bias_row): min_tokens suppresses stop
    tokens, bad_words bans the token that would complete a bad word. None: nothing to bias (most requests: this
    runs for every token)."""
    p = seq.sampling_params
    if not (p.logit_bias or p.bad_words or seq.num_output_tokens < p.min_tokens):
        return None
    row = dict(p.logit_bias or {})
    if seq.num_output_tokens < p.min_tokens:
        for t in p.all_stop_token_ids:
            row[t] = float("-inf")
    for word_ids in bad_word_ids(p, tokenizer):
        prefix = word_ids[:-1]
        if not prefix or seq.output_token_ids[-len(prefix) :] == prefix:
            row[word_ids[-1]] = float("-inf")
    return row


def bad_word_ids(p: SamplingParams, tokenizer) -> list[list[int]]:
    """Each bad word's token ids, alone and after a space (as vLLM encodes them); cached on p."""
    if not p.bad_words:
        return []
    cached = getattr(p, "_bad_word_ids", None)
    if cached is None:
        cached = []
        for word in p.bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in cached:
                    cached.append(ids)
        p._bad_word_ids = cached
    return cached


def logprob_dict(tokenizer, vocab_size: int, token, lp, rank, top_ids, top_lps, k) -> dict[int, Logprob]:
    """vLLM's logprobs entry of one position: the token's, then the top k (k -1: the whole vocabulary, allowed
    when max_logprobs is -1). tokenizer None (a request with detokenize=False): no decoded_token, as vLLM's."""
    k = vocab_size if k == -1 else k
    decode = (lambda t: None) if tokenizer is None else (lambda t: tokenizer.decode([t]))
    d = {token: Logprob(lp, rank, decode(token))}
    for tid, tlp, r in zip(top_ids[:k], top_lps[:k], range(1, k + 1)):
        tid = int(tid)
        if tid not in d:
            d[tid] = Logprob(float(tlp), r, decode(tid))
    return d


def collect_prompt_logprobs(handle, result, request_of: Callable, tokenizer, vocab_size: int) -> None:
    """Appends a step's prompt logprobs (result.prompt) to the requests whose prompt chunks it ran;
    request_of(seq_id): the engine's request of that sequence, or None."""
    t_lp, t_rank, top_ids, top_lps = result.prompt
    scheduled = {s.seq.seq_id: s.seq for s in handle.sched.scheduled}
    for seq_id, (lo, n, start) in handle.prompt_rows.items():
        req = request_of(seq_id)
        # The chunk must belong to this request's sequence: an aborted request's id may be in use again.
        if req is None or req.prompt_logprobs is None or req.seqs[0].seq is not scheduled.get(seq_id):
            continue
        k = req.params.prompt_logprobs
        for j in range(n):
            pos = start + j + 1  # prompt position of token j's target = its index in prompt_logprobs
            if pos >= len(req.prompt_token_ids):
                break
            if pos < len(req.prompt_logprobs):  # recomputed after a preemption: kept from the first pass
                continue
            req.prompt_logprobs.append(
                logprob_dict(
                    tokenizer if req.params.detokenize else None,
                    vocab_size,
                    req.prompt_token_ids[pos],
                    float(t_lp[lo + j]),
                    int(t_rank[lo + j]),
                    top_ids[lo + j],
                    top_lps[lo + j],
                    k,
                )
            )
