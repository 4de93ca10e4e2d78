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


class BeamSearch:
    """The search's state between its one-token steps, for a driver that runs them (run_beam_search here, AsyncLLM's
    beam_search): step_params(), then while pending() has beams, advance() with their step outputs; results()."""

    def __init__(self, prompts_ids, params: BeamSearchParams, *, eos_token_id, max_model_len: int, loras=None):
        self.params, self.eos, self.max_model_len = params, eos_token_id, max_model_len
        self.live = [
            [BeamSearchSequence(list(ids), lora_request=loras[i] if loras else None)]
            for i, ids in enumerate(prompts_ids)
        ]
        self.ended: list[list[BeamSearchSequence]] = [[] for _ in prompts_ids]
        self.steps = 0

    def step_params(self) -> SamplingParams:
        return SamplingParams(logprobs=2 * self.params.beam_width, max_tokens=1, temperature=self.params.temperature)

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty)

    def pending(self) -> list[BeamSearchSequence]:
        """The beams to extend by one token next (every prompt's, in order); [] when the search is over."""
        if self.steps >= self.params.max_tokens:
            return []
        for i, beams in enumerate(self.live):  # a beam at max_model_len has no room for another token
            for beam in beams:  # (a prompt that long goes to the engine, which refuses it as generate() does)
                if beam.logprobs and len(beam.tokens) >= self.max_model_len:
                    beam.finish_reason = "length"
                    self.ended[i].append(beam)
            self.live[i] = [b for b in beams if b.finish_reason is None]
        return [beam for beams in self.live for beam in beams]

    def advance(self, steps: list[dict]) -> None:
        """steps: each pending beam's {token: Logprob} of its next token (the top 2 * beam_width and the pick)."""
        results = iter(steps)
        for i, beams in enumerate(self.live):
            grown = []
            for beam in beams:
                step = next(results)
                for token, lp in step.items():
                    new = BeamSearchSequence(
                        beam.tokens + [token], beam.logprobs + [step], beam.lora_request, beam.cum_logprob + lp.logprob
                    )
                    if token == self.eos and not self.params.ignore_eos:
                        new.finish_reason = "stop"
                        self.ended[i].append(new)
                    else:
                        grown.append(new)
            self.live[i] = sorted(grown, key=self._score, reverse=True)[: self.params.beam_width]
        self.steps += 1

    def results(self) -> list[BeamSearchOutput]:
        out = []
        for i, beams in enumerate(self.live):
            for beam in beams:
                beam.finish_reason = beam.finish_reason or "length"
            best = sorted(self.ended[i] + beams, key=self._score, reverse=True)[: self.params.beam_width]
            out.append(BeamSearchOutput(best))
        return out


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
    search = BeamSearch(prompts_ids, params, eos_token_id=eos_token_id, max_model_len=max_model_len, loras=loras)
    while batch := search.pending():
        outputs = generate(
            [{"prompt_token_ids": b.tokens} for b in batch], search.step_params(), [b.lora_request for b in batch]
        )
        search.advance([o.outputs[0].logprobs[0] for o in outputs])
    return search.results()
