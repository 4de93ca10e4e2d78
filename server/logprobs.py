"""The logprobs of a response in OpenAI's shapes: the legacy completions one, chat's, and vLLM's prompt_logprobs.

JSON has no -inf or NaN, so every logprob is clamped to -9999.0 (what OpenAI clients accept).
"""

from __future__ import annotations

import math

from jaxllm.outputs import Logprob
from server.protocol import ChatLogprobToken, CompletionLogProbs, TopLogprob


def _clamp(x: float) -> float:
    # JSON has no -inf/NaN; OpenAI clients expect a number.
    return -9999.0 if math.isnan(x) else max(x, -9999.0)


def _rank_key(item: tuple[int, Logprob]):
    r = item[1].rank
    return (r is None, r if r is not None else 0)


class TokenNamer:
    """How a token id is shown in logprobs: its decoded text, or "token_id:N" (--return-tokens-as-token-ids, or no
    tokenizer)."""

    def __init__(self, tokenizer, as_ids: bool):
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, tid: int, lp: Logprob | None) -> str:
        if self.as_ids or self.tokenizer is None:  # (no tokenizer: --skip-tokenizer-init)
            return f"token_id:{tid}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([tid])


def completion_logprobs(
    name: TokenNamer, token_ids: list[int], entries: list, num_top: int, offset: int
) -> tuple[CompletionLogProbs, int]:
    """The legacy completions shape; entries[i] is None for the first prompt token. Returns the next offset."""
    out = CompletionLogProbs()
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            tok = name(tid, None)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            lp = entry.get(tid)
            tok = name(tid, lp)
            out.token_logprobs.append(_clamp(lp.logprob) if lp is not None else None)
            top = {name(t, l): _clamp(l.logprob) for t, l in sorted(entry.items(), key=_rank_key)[:num_top]}
            if lp is not None:
                top.setdefault(tok, _clamp(lp.logprob))
            out.top_logprobs.append(top)
        out.tokens.append(tok)
        out.text_offset.append(offset)
        offset += len(tok)
    return out, offset


def chat_logprobs(name: TokenNamer, token_ids: list[int], entries: list, num_top: int) -> list[ChatLogprobToken]:
    content = []
    for tid, entry in zip(token_ids, entries):
        entry = entry or {}
        lp = entry.get(tid)
        tok = name(tid, lp)
        tops = []
        for t, l in sorted(entry.items(), key=_rank_key)[:num_top]:
            s = name(t, l)
            tops.append(TopLogprob(token=s, logprob=_clamp(l.logprob), bytes=list(s.encode("utf-8", "replace"))))
        content.append(
            ChatLogprobToken(
                token=tok,
                logprob=_clamp(lp.logprob) if lp is not None else -9999.0,
                bytes=list(tok.encode("utf-8", "replace")),
                top_logprobs=tops,
            )
        )
    return content


def prompt_logprobs_json(entries) -> list | None:
    """vLLM's prompt_logprobs field: per prompt token None or {token_id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {t: {"logprob": _clamp(l.logprob), "rank": l.rank, "decoded_token": l.decoded_token} for t, l in e.items()}
        for e in entries
    ]
