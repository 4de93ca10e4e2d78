"""Beam search over the engine, as vLLM's LLM.beam_search runs it: a loop of one-token generate() calls.

Each step every live beam of every prompt is one request of max_tokens=1 asking for 2 * beam_width log-probabilities
(prefix caching serves the beam's earlier tokens from the pages of the step before, so a step costs one token a
beam). Each of those tokens extends its beam: an EOS ends the beam (unless ignore_eos), the others are ranked by
score and the best beam_width go on. After max_tokens steps (or when no beam is left) the ended and the live beams
are ranked together and the best beam_width returned, best first.

Score: the beam's summed log-probability / length ** length_penalty, the length counting the prompt's tokens and
not an EOS at the end (vLLM's get_beam_search_score). A BeamSearchSequence's tokens and text are the whole
sequence, prompt included, as vLLM returns them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: tokens (prompt and generated), each generated token's log-probability dict (as
    CompletionOutput.logprobs holds them), their sum, and (when returned) the decoded text."""

    tokens: list[int]
    logprobs: list[dict] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float) -> float:
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length**length_penalty)


def run_beam_search(
    prompts_ids: list[list[int]],
    params: BeamSearchParams,
    generate: Callable[[list[dict], SamplingParams, list], list],
    *,
    eos_token_id: int | None,
    max_model_len: int,
    loras: list | None = None,
) -> list[BeamSearchOutput]:
    """generate(prompts, sampling_params, lora_requests) -> RequestOutputs (LLM.generate's, in order)."""
    step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature)

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty)

    live = [
        [BeamSearchSequence(list(ids), lora_request=loras[i] if loras else None)] for i, ids in enumerate(prompts_ids)
    ]
    ended: list[list[BeamSearchSequence]] = [[] for _ in prompts_ids]
    for _ in range(params.max_tokens):
        for i, beams in enumerate(live):  # a beam at max_model_len has no room for another token
            for beam in beams:
                if len(beam.tokens) >= max_model_len:
                    beam.finish_reason = "length"
                    ended[i].append(beam)
            live[i] = [b for b in beams if b.finish_reason is None]
        batch = [beam for beams in live for beam in beams]
        if not batch:
            break
        outputs = generate(
            [{"prompt_token_ids": b.tokens} for b in batch], step_params, [b.lora_request for b in batch]
        )
        results = iter(outputs)
        for i, beams in enumerate(live):
            grown = []
            for beam in beams:
                step = next(results).outputs[0].logprobs[0]  # {token: Logprob}: the top 2 * beam_width (and the pick)
                for token, lp in step.items():
                    new = BeamSearchSequence(
                        beam.tokens + [token], beam.logprobs + [step], beam.lora_request, beam.cum_logprob + lp.logprob
                    )
                    if token == eos_token_id and not params.ignore_eos:
                        new.finish_reason = "stop"
                        ended[i].append(new)
                    else:
                        grown.append(new)
            live[i] = sorted(grown, key=score, reverse=True)[: params.beam_width]
    results_out = []
    for i, beams in enumerate(live):
        for beam in beams:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(ended[i] + beams, key=score, reverse=True)[: params.beam_width]
        results_out.append(BeamSearchOutput(best))
    return results_out
