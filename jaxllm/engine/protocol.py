"""The contract between the engine and its front ends (the OpenAI server, tests' fake engines).

Data flow inside the engine, written once here:

    Scheduler.schedule() -> SchedulerOutput     host ints: which sequences run, how many new tokens each
    ModelRunner.prepare(SchedulerOutput)        -> StepInputs: padded numpy arrays for one shape bucket
    StepInputs -> BatchMetadata (device pytree) -> jitted step(params, kv_caches, meta, sampling) ->
        (kv_caches, sampled tokens + logprobs)  the KV cache is donated; one compiled step per bucket
    Scheduler.update(SchedulerOutput, sampled)  appends tokens, frees finished sequences' blocks
    LLMEngine: detokenizes, checks stops, emits RequestOutput

Front ends only see EngineClient below: they add a request and iterate over its RequestOutputs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

# A prompt: text, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [...]}.
PromptType = str | list[int] | dict


class EngineDeadError(RuntimeError):
    """The engine loop died; every request fails with this and /health answers 503."""


@dataclass
class EngineStats:
    """A snapshot for logging and Prometheus; counters are totals since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    iteration_tokens: list[int] = field(default_factory=list)  # tokens per step since the last snapshot
    # Speculative decoding (None when it is off): totals since start, vLLM's vllm:spec_decode_* counters
    spec_decode: SpecDecodeStats | None = None


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verified proposals: one per sequence per step that had any
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at proposal position i


class EngineClient(Protocol):
    model_name: str  # the model path/name the engine loaded
    max_model_len: int
    vocab_size: int
    max_logprobs: int

    def get_tokenizer(self):
        """The HF tokenizer (PreTrainedTokenizerBase) used to encode prompts and decode outputs."""

    @property
    def is_running(self) -> bool: ...

    @property
    def errored(self) -> bool: ...

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        """Adds the request and yields cumulative RequestOutputs (text/token_ids so far); the last has
        finished=True. Invalid input raises ValueError before the first yield. Closing the iterator early
        (client gone, task cancelled) aborts the request and frees its KV blocks. lora_request: a LoRARequest
        (engines with LoRA: also add_lora, remove_lora, list_loras, as AsyncLLM)."""

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def start_profile(self, log_dir: str) -> None: ...

    def stop_profile(self) -> None: ...

    async def shutdown(self) -> None: ...
