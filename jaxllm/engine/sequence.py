"""Sequence: one generation stream's host state (tokens, KV progress, block table) as the scheduler sees it.

Token accounting, for a sequence with P prompt and O known output tokens:

    num_tokens = P + O + num_pending           every token that exists, on the host or only on the device
    num_computed_tokens <= num_tokens          tokens whose KV is (being) written: advanced at schedule time
    all_token_ids                              the P + O tokens the host knows

num_pending counts tokens a scheduled step samples that update() has not delivered yet: scheduling a chunk with
sample=True adds one, update() removes it. Between schedule() and update() of a synchronous loop it is 1; with
one step of lookahead (schedule N+1 before update N) it is at most 1 whenever schedule() starts.
"""

from __future__ import annotations

import enum
import time
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # never admitted
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue; its KV is recomputed on re-admission
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's CompletionOutput.finish_reason for this status."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """A prompt and the tokens generated after it. n > 1 requests are n Sequences with distinct seq_ids."""

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: int | None = None,
        skip_prefix_cache_read: bool = False,
        cache_salt: str | None = None,
        sampling_params: Any = None,
        lora_id: int = 0,
        lora_key: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty.")
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # lower runs first
        # The scheduler samples no more once len(output) + num_pending reaches this; the engine then finishes it.
        self.max_tokens = max_tokens
        self.skip_prefix_cache_read = skip_prefix_cache_read  # prompt_logprobs requests: compute every token
        self.cache_salt = cache_salt  # isolates prefix-cache sharing between tenants (vLLM's cache_salt)
        self.lora_id = lora_id  # the LoRA adapter's lora_int_id (0: the base model); the runner maps it to a slot
        self.lora_key = lora_key  # the adapter's prefix-cache key: KV computed with one adapter is never another's
        self.sampling_params = sampling_params  # carried for the engine; the scheduler never reads it
        self.bias_row: dict[int, float] | None = None  # the engine's logit biases for the next token (runner reads)
        self.token_bitmask = None  # structured outputs: the next token's allowed set ([W] int32; runner reads)
        # Speculative decoding: tokens proposed to follow the last known one, verified by the next step that runs
        # this sequence as a decode (the engine sets them after each step; the scheduler takes them).
        self.spec_token_ids: list[int] = []

        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # prefix-cache hit tokens at first admission (RequestOutput.num_cached_tokens)
        self.num_preemptions = 0

        # Owned by BlockManager: chained hashes of the known full blocks, and how many leading blocks of
        # block_table are registered in (or were read from) the prefix cache.
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        # Owned by Scheduler: tie-break for equal (priority, arrival_time), in add() order.
        self.order = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Known output tokens (pending ones excluded)."""
        return len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Known tokens at positions [start, stop), without building all_token_ids."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    def token_at(self, position: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < p else self.output_token_ids[position - p]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, pending={self.num_pending}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )
