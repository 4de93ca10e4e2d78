"""Continuous-batching scheduler (vLLM V1 policy) on host ints. Imports no jax.

One step: schedule() -> SchedulerOutput -> the runner runs it -> update(output, sampled) -> the engine detokenizes,
checks stops and calls finish() (see jaxllm.engine.protocol for the whole data flow).

Policy of schedule(), under a token budget (max_num_batched_tokens) and max_num_seqs:
1. Running sequences first, oldest first (by priority, arrival, add order): each gets all its remaining tokens
   (a decode: 1; an in-progress chunked prefill: the rest of its prompt) cut to the remaining budget. When the
   pages for a chunk do not fit, the newest running sequence (highest priority value, latest arrival) is
   preempted by recompute: its pages are freed, num_computed_tokens = 0, its output tokens are kept, and it
   goes back to the waiting queue; if the sequence needing pages is itself the newest, it is the one preempted.
2. Then, unless something was preempted this step, waiting sequences in (priority, arrival, add order): each
   first reuses prefix-cache pages, then is admitted with as many tokens as the budget allows (chunked
   prefill) or only whole (chunked prefill off); admission stops at the first sequence that does not fit.
   A re-admitted sequence recomputes prompt + outputs, with prefix-cache hits. With LoRA, a sequence whose
   adapter would make the running sequences' distinct adapters exceed max_loras waits (later ones may run).
num_computed_tokens advances at schedule time. A chunk that reaches the end of the sequence's tokens has
sample=True: the step samples the next token, and num_pending goes up by one until update() delivers it.

Async scheduling: schedule() for step N+1 may run before update() for step N. A sequence sampled in step N then
has num_pending=1 and its next chunk is that single pending token, whose id only the device knows
(ScheduledSeq.token_ids is empty; the runner feeds the token sampled for this sequence in step N). A sequence
preempted while it has a pending token is not re-admitted until update() delivers it. update() ignores tokens
of sequences that were finished or aborted after their step was scheduled. Pages freed while a step that
writes them is in flight are safe to hand out again because the device runs steps in order; so every
SchedulerOutput must run in full (see block_manager for this and the write-then-attend rule).

The scheduler never finishes a sequence: it stops sampling a sequence once len(output) + num_pending reaches
its max_tokens or its num_tokens reaches max_model_len, and the engine must then finish() it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.configs import CacheConfig, SchedulerConfig
from jaxllm.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)  # slots: one of these per running sequence per step, so creation and reads are hot
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first new token (num_computed_tokens before this step)
    num_tokens: int  # new tokens this step: positions [start, start + num_tokens)
    sample: bool  # the chunk reaches the sequence's end, so this step samples its next token
    # Input ids known at schedule time: all num_tokens of them, or none when the input is the token the
    # previous step sampled on the device (async scheduling).
    token_ids: list[int] = field(default_factory=list)
    # Speculative decoding: the proposed tokens this decode verifies (token_ids = [last token] + these); the step
    # emits 1 to len + 1 tokens for it.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def from_device(self) -> bool:
        """The input is the token the previous step sampled for this sequence, still on the device."""
        return len(self.token_ids) < self.num_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token, or a first chunk: the prompt (or a recompute) rather than a decode."""
        return self.num_tokens > 1 or self.start < self.seq.num_prompt_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # seq_ids preempted by this schedule()
    num_batched_tokens: int = 0
    # seq_ids finished, aborted or preempted since the previous non-empty schedule(): the runner drops their
    # per-sequence state (a preempted sequence comes back with fresh pages and a recompute). An empty schedule
    # (no step runs, so no runner sees it) keeps them for the next one.
    freed: list[str] = field(default_factory=list)
    # seq_id -> pages kept, for block tables that shrank since the previous non-empty schedule() (speculated
    # tokens' pages freed by update()): the runner's copies of those tables are stale past that many pages.
    trimmed: dict[str, int] = field(default_factory=dict)
    step_id: int = 0
    verify: bool = False  # speculative decoding: the step verifies its sequences' proposals (see _add_proposals)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counters, totals since start (vLLM's vllm:spec_decode_* metrics)."""

    num_drafts: int = 0  # verified proposals (one per sequence per step that had some)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at proposal position i

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_proposed:
            per_pos.extend([0] * (num_proposed - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # tokens, totals since start
    prefix_cache_hits: int
    num_preemptions: int
    spec_decode: SpecDecodeStats | None = None


def _queue_key(seq: Sequence) -> tuple:
    return (seq.priority, seq.arrival_time, seq.order)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        num_lookahead_tokens: int = 0,
        verify_every_decode: bool = False,
    ) -> None:
        """num_lookahead_tokens: KV slots a speculating decode needs past its verified tokens (a draft model or
        EAGLE head writes its own KV for the proposals of the next step there; 0 for n-gram lookup).
        verify_every_decode: every speculating decode-only step is a verify step, with proposals or not (a
        drafter on the device proposes in verify steps: the first one after a pause has none to verify)."""
        if cache_config.num_usable_tokens < scheduler_config.max_model_len:
            raise ValueError(
                f"The KV cache holds {cache_config.num_usable_tokens} tokens "
                f"({cache_config.num_usable_blocks} blocks of {cache_config.block_size}; block 0 is reserved), "
                f"fewer than max_model_len ({scheduler_config.max_model_len}), so one sequence of max_model_len "
                "tokens could never run. Increase num_blocks (gpu_memory_utilization) or decrease max_model_len."
            )
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = BlockManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self.waiting: list[Sequence] = []  # sorted by _queue_key
        self.running: list[Sequence] = []  # sorted by _queue_key: the tail is preempted first
        self.num_preemptions = 0
        self._next_order = 0
        self._step_id = 0
        self._freed: list[str] = []
        self.num_lookahead_tokens, self.verify_every_decode = num_lookahead_tokens, verify_every_decode
        self._trimmed: dict[str, int] = {}
        self.spec_stats = SpecDecodeStats()
        self.speculate = True  # the engine's per-step switch (off: proposals are ignored, see _add_proposals)

    # ---- requests ----

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"Sequence {seq.seq_id!r} already exists.")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_pending:
            raise ValueError(f"Sequence {seq.seq_id!r} must be new, got {seq!r}.")
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"Sequence {seq.seq_id!r} has {seq.num_tokens} tokens, more than max_model_len "
                f"({self.config.max_model_len})."
            )
        seq.order = self._next_order
        self._next_order += 1
        self.seqs[seq.seq_id] = seq
        bisect.insort(self.waiting, seq, key=_queue_key)

    def abort(self, seq_id: str) -> bool:
        """Aborts a sequence in any state and frees its pages at once; False when it is unknown or finished."""
        return self.finish(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish(self, seq_id: str, status: SequenceStatus) -> bool:
        """Finishes a sequence (the engine's call: stop, length, abort) and frees its pages; False when it is
        unknown or already finished."""
        if not status.is_finished:
            raise ValueError(f"finish() needs a FINISHED_* status, got {status}.")
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return False
        was_running = seq.status is SequenceStatus.RUNNING
        (self.running if was_running else self.waiting).remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        if was_running:  # a preempted one was reported when it was preempted
            self._freed.append(seq_id)
        return True

    def get(self, seq_id: str) -> Sequence | None:
        return self.seqs.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decode=self.spec_stats,
        )

    # ---- one step ----

    def _wants_tokens(self, seq: Sequence) -> bool:
        """False once the sequence may sample no more, so the engine is about to finish it: max_tokens outputs,
        or num_tokens at max_model_len (a prompt of exactly max_model_len still samples one token, as in vLLM)."""
        num_outputs = len(seq.output_token_ids) + seq.num_pending  # lens, not properties: called per sequence
        if num_outputs and len(seq.prompt_token_ids) + num_outputs >= self.config.max_model_len:
            return False
        return seq.max_tokens is None or num_outputs < seq.max_tokens

    def _schedule_chunk(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        # Runs for every scheduled sequence every step (256 decodes: most of schedule()), hence the plain lens.
        start = seq.num_computed_tokens
        end = start + num_new
        num_known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        if start < num_known:
            token_ids = seq.token_ids_slice(start, min(end, num_known))
            assert len(token_ids) == num_new, (seq, start, num_new)
        else:  # a decode of the token still pending on the device
            token_ids = []
            assert num_new == 1, (seq, start, num_new)
        seq.num_computed_tokens = end
        sample = end == num_known + seq.num_pending
        if sample:
            seq.num_pending += 1
        out.scheduled.append(ScheduledSeq(seq, start, num_new, sample, token_ids))
        out.num_batched_tokens += num_new
        # A decode fills a page once every block_size steps: call only when the next uncommitted page is full of
        # computed and known tokens (commit_full_blocks' own test, without the call).
        bm = self.block_manager
        next_full = (seq.num_committed_blocks + 1) * bm.block_size
        if end >= next_full and num_known >= next_full and bm.enable_prefix_caching:
            bm.commit_full_blocks(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_queue_key)
        out.preempted.append(seq.seq_id)
        self._freed.append(seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        cfg, bm = self.config, self.block_manager
        out = SchedulerOutput(step_id=self._step_id)
        self._step_id += 1
        budget = cfg.max_num_batched_tokens
        block_size = bm.block_size

        # 1. Running sequences, oldest first. Victims come from the tail, so they were not scheduled yet.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # seq.num_tokens - seq.num_computed_tokens without the property calls (this runs for every sequence)
            num_new = len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.num_pending - seq.num_computed_tokens
            if num_new == 0 or not self._wants_tokens(seq):
                i += 1
                continue
            if not cfg.enable_chunked_prefill and num_new > budget:
                i += 1  # runs whole or not at all (only recomputes get here: prefills complete at admission)
                continue
            if num_new > budget:
                num_new = budget
            # Most steps' decodes stay inside their last page: ask the block manager only at page boundaries.
            if seq.num_computed_tokens + num_new > len(seq.block_table) * block_size:
                while not bm.ensure_slots(seq, num_new):
                    victim = self.running[-1]
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    break  # seq preempted itself: everything after it is gone too
            self._schedule_chunk(out, seq, num_new)
            budget -= num_new
            i += 1

        # 2. Waiting sequences, unless this step had to preempt.
        if not out.preempted:
            # LoRA: the running sequences' adapters, at most max_loras (each is a device slot the steps read)
            loras = {s.lora_id for s in self.running if s.lora_id} if cfg.max_loras else None
            j = 0
            while j < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
                seq = self.waiting[j]
                if seq.num_pending or not self._wants_tokens(seq):
                    j += 1  # preempted with a token still in flight (wait for update()), or about to finish
                    continue
                if loras is not None and seq.lora_id and seq.lora_id not in loras and len(loras) >= cfg.max_loras:
                    j += 1  # its adapter needs a slot the running sequences' adapters hold
                    continue
                cached = bm.find_cached_prefix(seq)
                num_cached = len(cached) * bm.block_size
                num_new = seq.num_tokens - num_cached
                if not cfg.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(num_new, budget)
                if bm.allocate_prompt(seq, num_new, cached) is None:
                    break
                del self.waiting[j]
                if seq.status is SequenceStatus.WAITING:
                    seq.num_cached_tokens = num_cached
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self.running, seq, key=_queue_key)
                if loras is not None and seq.lora_id:
                    loras.add(seq.lora_id)
                self._schedule_chunk(out, seq, num_new)
                budget -= num_new

        if self.speculate and out.scheduled and out.num_batched_tokens == len(out.scheduled):
            self._add_proposals(out, budget)
        for s in out.scheduled:  # proposals not verified now are stale once the sequence moves on
            s.seq.spec_token_ids = []
        if out.scheduled:
            out.freed, self._freed = self._freed, []
            out.trimmed, self._trimmed = self._trimmed, {}
        return out

    def _add_proposals(self, out: SchedulerOutput, budget: int) -> None:
        """Speculative decoding: a step whose chunks are all single-token decodes verifies the proposals of its
        sequences too (each decode becomes [last token] + proposals). Steps with prompt tokens do not: the
        proposals would lengthen a step that is not waiting on weight reads, and the prefill would lose budget.
        Proposals are cut to the budget, to the tokens the sequence may still emit (max_tokens, max_model_len:
        a step emits at most one more token than it verifies), and dropped when their pages do not fit (they
        never preempt anyone)."""
        bm, max_len, ahead = self.block_manager, self.config.max_model_len, self.num_lookahead_tokens

        def reserve(seq: Sequence, k: int) -> bool:
            # No page past max_model_len: the runner's block tables end there (the drafter drops writes past a
            # sequence's pages, so lookahead slots cut short only cost its proposals some context)
            return bm.ensure_slots(seq, min(k, max_len - seq.num_computed_tokens))

        out.verify = self.verify_every_decode
        for s in out.scheduled:
            seq = s.seq
            props = seq.spec_token_ids
            if not props or budget <= 0 or s.from_device or not s.sample:
                if self.verify_every_decode and ahead:  # the drafter's pages for its next proposals, when free
                    reserve(seq, ahead)
                continue
            n_out = len(seq.output_token_ids)  # seq.num_pending is 1 for this step's token
            room = max_len - (len(seq.prompt_token_ids) + n_out) - 1
            if seq.max_tokens is not None:
                room = min(room, seq.max_tokens - n_out - 1)
            n = min(len(props), budget, room)
            if n <= 0 or not reserve(seq, n + ahead):
                if self.verify_every_decode and ahead:
                    reserve(seq, ahead)
                continue
            out.verify = True
            s.spec_token_ids = props[:n]
            s.token_ids = s.token_ids + s.spec_token_ids
            s.num_tokens += n
            seq.num_computed_tokens += n
            out.num_batched_tokens += n
            budget -= n

    def update(self, output: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Sequence]:
        """Appends the tokens sampled by the step that ran `output`; returns the sequences that got one (the
        new token is seq.output_token_ids[-1]). Tokens of sequences finished since `output` are dropped.

        A speculating decode's entry is the list of tokens the step emitted (its accepted proposals and one
        more): its KV progress rolls back past the rejected proposals and their pages are freed. (A single int
        there: the proposals were not verified, and all roll back uncounted.)"""
        appended = []
        for s in output.scheduled:
            seq = s.seq
            if not s.sample or seq.is_finished:
                continue
            new = sampled[seq.seq_id]
            if s.spec_token_ids:
                verified = isinstance(new, list)  # an int: the runner ran the step as a plain decode
                new = new if verified else [int(new)]
                num_accepted = len(new) - 1
                assert 0 <= num_accepted <= len(s.spec_token_ids), (seq, new, s.spec_token_ids)
                if verified:
                    self.spec_stats.record(len(s.spec_token_ids), num_accepted)
                seq.output_token_ids.extend(new)
                if seq.status is SequenceStatus.RUNNING:  # not preempted since it was scheduled
                    seq.num_computed_tokens -= len(s.spec_token_ids) - num_accepted
                    if self.block_manager.trim(seq, seq.num_computed_tokens + self.num_lookahead_tokens):
                        kept = len(seq.block_table)
                        self._trimmed[seq.seq_id] = min(kept, self._trimmed.get(seq.seq_id, kept))
            elif isinstance(new, list):
                seq.output_token_ids.extend(new)
            else:
                seq.output_token_ids.append(int(new))
            seq.num_pending -= 1
            assert seq.num_pending >= 0, seq
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.commit_full_blocks(seq)
            appended.append(seq)
        return appended
