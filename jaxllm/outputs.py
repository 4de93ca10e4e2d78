"""Request outputs with vLLM's fields, defaults and reprs: RequestOutput -> [CompletionOutput], Logprob.

As in vLLM 0.10-0.11: RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished,
metrics=None, lora_request=None, encoder_prompt=None, encoder_prompt_token_ids=None, num_cached_tokens=None,
multi_modal_placeholders=None (stored as {}), kv_transfer_params=None, **kwargs (ignored with a warning, vLLM's
forward compatibility)); CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs,
finish_reason=None, stop_reason=None, lora_request=None). jaxllm has no LoRA, encoder-decoder, multimodal or
disaggregated-prefill features, so those fields keep their defaults.
"""

from __future__ import annotations

import logging
from collections.abc import MutableSequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("jaxllm")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the sampled token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # matched stop string, stop token id, or None
    lora_request: Any = None  # vLLM's LoRARequest; always None here

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:  # vLLM's: lora_request is not shown
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason})"
        )


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


_warned_extra_args = False


class RequestOutput:
    """One request's output so far (or final): its prompt and one CompletionOutput per sequence (n)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: PromptLogprobs | None,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: RequestMetrics | None = None,
        lora_request: Any = None,
        encoder_prompt: str | None = None,
        encoder_prompt_token_ids: list[int] | None = None,
        num_cached_tokens: int | None = None,
        multi_modal_placeholders: dict | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        global _warned_extra_args
        if kwargs and not _warned_extra_args:  # vLLM: code written for a newer release still runs
            _warned_extra_args = True
            logger.warning("RequestOutput: Ignoring extra arguments: %s", kwargs)
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.multi_modal_placeholders = multi_modal_placeholders or {}
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.kv_transfer_params = kv_transfer_params

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merges a later output of the same request into this one: with aggregate, each completion's new text,
        tokens and logprobs are appended (DELTA outputs -> cumulative); without, each is replaced."""
        self.finished |= next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params
        for nxt in next_output.outputs:
            for i, cur in enumerate(self.outputs):
                if cur.index != nxt.index:
                    continue
                if not aggregate:
                    self.outputs[i] = nxt
                    break
                cur.text += nxt.text
                if not isinstance(cur.token_ids, MutableSequence):
                    cur.token_ids = list(cur.token_ids)
                cur.token_ids.extend(nxt.token_ids)
                if nxt.logprobs:
                    cur.logprobs = (cur.logprobs or []) + list(nxt.logprobs)
                cur.cumulative_logprob = nxt.cumulative_logprob
                cur.finish_reason, cur.stop_reason = nxt.finish_reason, nxt.stop_reason
                break
            else:
                self.outputs.append(nxt)

    def __repr__(self) -> str:  # vLLM's order
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, encoder_prompt={self.encoder_prompt!r}, "
            f"encoder_prompt_token_ids={self.encoder_prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, finished={self.finished}, metrics={self.metrics}, "
            f"lora_request={self.lora_request}, num_cached_tokens={self.num_cached_tokens}, "
            f"multi_modal_placeholders={self.multi_modal_placeholders})"
        )


@dataclass
class PoolingOutput:
    """A pooling request's result (vLLM's; `data` a numpy array here where vLLM's is a torch tensor)."""

    data: Any


class PoolingRequestOutput:
    """A pooling request's output (LLM.encode; the engine's output of a PoolingParams request)."""

    def __init__(
        self,
        request_id: str,
        outputs: PoolingOutput,
        prompt_token_ids: list[int],
        finished: bool,
        num_cached_tokens: int | None = None,
    ):
        self.request_id = request_id
        self.outputs = outputs
        self.prompt_token_ids = prompt_token_ids
        self.finished = finished
        self.num_cached_tokens = num_cached_tokens
        self.metrics: RequestMetrics | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(request_id={self.request_id!r}, outputs={self.outputs!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, finished={self.finished})"
        )


@dataclass
class EmbeddingOutput:
    """One embedding (vLLM's LLM.embed output): a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(PoolingRequestOutput):
    """LLM.embed's output per prompt: outputs.embedding."""

    outputs: EmbeddingOutput  # type: ignore[assignment]

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = out.outputs.data
        embedding = EmbeddingOutput([float(x) for x in data.tolist()])
        new = cls(out.request_id, embedding, out.prompt_token_ids, out.finished, out.num_cached_tokens)  # type: ignore[arg-type]
        new.metrics = out.metrics
        return new
