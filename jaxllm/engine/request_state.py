"""The engine's state of a request and of each of its sequences (llm_engine.py keeps them by request id), and the
RequestOutput built from it in vLLM's output kinds (cumulative, DELTA, FINAL_ONLY).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from jaxllm.engine.detokenizer import IncrementalDetokenizer, StopChecker
from jaxllm.engine.sequence import Sequence
from jaxllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SeqState:
    seq: Sequence
    index: int
    detok: IncrementalDetokenizer
    stops: StopChecker
    text: str = ""
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # RequestOutputKind.DELTA: how much of the text, tokens and logprobs earlier outputs carried, and whether
    # one carried the finish
    sent_text: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False
    matcher: object = None  # structured outputs: the llguidance matcher of this sequence's output
    matched: int = 0  # output tokens the matcher has consumed
    grammar_error: str | None = None  # a token the matcher refused (the request fails when it is processed)
    thinking: bool = False  # reasoning still: the grammar starts after the token that ends it (structured.py)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqState]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False  # RequestOutputKind.DELTA: an output carried them (they come once)
    lora_id: int = 0  # its LoRA adapter's lora_int_id (0: the base model)
    pooling: Any = None  # an embedding request's PoolingParams (it runs as a one-token request), else None
    pooled: Any = None  # its embedding (float32 numpy), once its prompt's last token ran


def state_of(req: Request, seq: Sequence) -> SeqState | None:
    """The request's state for seq, one of its unfinished sequences (a finished one's id may be in use again)."""
    return req.seqs[0] if len(req.seqs) == 1 else next((s for s in req.seqs if s.seq is seq), None)


def build_output(req: Request) -> RequestOutput | None:
    """The request's output now: None for a FINAL_ONLY request still running, or a DELTA one with nothing new."""
    finished = all(s.finish_reason is not None for s in req.seqs)
    kind = req.params.output_kind
    if kind is RequestOutputKind.FINAL_ONLY and not finished:
        return None
    outs = []
    for s in req.seqs:
        done = s.finish_reason is not None
        text = s.text if done else s.stops.visible_text(s.text, False)
        tokens, logprobs = s.seq.output_token_ids, s.logprobs
        if kind is RequestOutputKind.DELTA:
            t0, n0 = s.sent_text, s.sent_tokens
            # vLLM sends a completion only when it has something new, its finish once
            if s.sent_finish or (not done and len(text) == t0 and len(tokens) == n0):
                continue
            s.sent_text, s.sent_tokens, s.sent_finish = len(text), len(tokens), done
            text, tokens = text[t0:], tokens[n0:]
            logprobs = None if logprobs is None else logprobs[n0:]
        outs.append(
            CompletionOutput(
                s.index,
                text,
                list(tokens),
                s.cumulative_logprob if s.logprobs is not None else None,
                logprobs,
                s.finish_reason,
                s.stop_reason,
            )
        )
    prompt_logprobs = req.prompt_logprobs
    if kind is RequestOutputKind.DELTA:  # all of the prompt's logprobs, once, when its prefill is done
        complete = prompt_logprobs is not None and len(prompt_logprobs) >= len(req.prompt_token_ids)
        if req.prompt_logprobs_sent or not complete:
            prompt_logprobs = None
        else:
            req.prompt_logprobs_sent = True
        if not outs and prompt_logprobs is None and not finished:
            return None  # nothing new
    if finished:
        req.metrics.finished_time = time.time()
    return RequestOutput(
        req.request_id,
        req.prompt,
        req.prompt_token_ids,
        prompt_logprobs,
        outs,
        finished,
        req.metrics,
        num_cached_tokens=req.seqs[0].seq.num_cached_tokens,
    )
