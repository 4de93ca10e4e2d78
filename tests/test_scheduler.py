"""Scheduler: continuous batching, chunked prefill, preemption by recompute, priorities, prefix hits, async.

FakeEngine drives the scheduler as the engine does and stands in for the device: each launched step writes
(position, token) into a shadow KV cache through the block tables and "samples" the next token as a
deterministic function of the KV it reads back. So a wrong prefix hit, a page overwritten while in use or a
wrong chunk changes the generated tokens, which must equal an unscheduled reference.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxllm.engine.block_manager import NULL_BLOCK
from jaxllm.engine.configs import CacheConfig, SchedulerConfig
from jaxllm.engine.scheduler import Scheduler, SchedulerOutput
from jaxllm.engine.sequence import Sequence, SequenceStatus

STOP = 3  # the fake model's stop token; prompts use tokens 0..2


def model(prefix: list[int]) -> int:
    """A deterministic next token of the whole prefix (greedy decoding of a fake model)."""
    h = 0
    for t in prefix:
        h = (h * 31 + t + 7) % 1000003
    h = (h * 2654435761 + len(prefix)) % 1000003
    return STOP if h % 9 == 0 else h % 3


def reference(prompt: list[int], max_tokens: int, max_model_len: int) -> tuple[list[int], SequenceStatus]:
    out: list[int] = []
    while True:
        out.append(model(prompt + out))
        if out[-1] == STOP:
            return out, SequenceStatus.FINISHED_STOPPED
        if len(out) >= max_tokens or len(prompt) + len(out) >= max_model_len:
            return out, SequenceStatus.FINISHED_LENGTH


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=64, chunked=True, caching=True
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
    )


class FakeEngine:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # (page, slot) -> (position, token)
        self.on_device: dict[str, deque[int]] = {}  # sampled tokens update() has not delivered yet
        self.inflight: deque[tuple[SchedulerOutput, dict[str, int]]] = deque()
        self.finished: dict[str, Sequence] = {}
        self.steps = 0

    def add(self, seq: Sequence) -> None:
        self.sched.add(seq)
        self.on_device[seq.seq_id] = deque()

    def _slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        bs = self.sched.block_manager.block_size
        return seq.block_table[pos // bs], pos % bs

    def launch(self) -> SchedulerOutput:
        sched, cfg = self.sched, self.sched.config
        assert all(s.num_pending <= len(self.inflight) for s in sched.seqs.values())
        out = sched.schedule()
        self.steps += 1
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids)) <= cfg.max_num_seqs
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled) <= cfg.max_num_batched_tokens
        for p in out.preempted:
            seq = sched.seqs[p]
            assert seq.status is SequenceStatus.PREEMPTED and not seq.block_table and seq.num_computed_tokens == 0
        # The step writes every chunk's KV, then attends: a sequence may hit a page that another one
        # completes in this same step (the block manager registers pages at schedule time, as vLLM does).
        truths = {}
        for s in out.scheduled:
            seq = s.seq
            assert seq.status is SequenceStatus.RUNNING and s.num_tokens >= 1
            assert s.start + s.num_tokens == seq.num_computed_tokens
            n_spec = len(s.spec_token_ids)  # proposals verified by this decode (tests/test_spec_scheduler.py)
            if s.sample:
                assert seq.num_tokens + n_spec == seq.num_computed_tokens + 1
            else:
                assert seq.num_tokens > seq.num_computed_tokens and not n_spec
            truth = truths[seq.seq_id] = seq.all_token_ids + list(self.on_device[seq.seq_id]) + s.spec_token_ids
            if not cfg.enable_chunked_prefill:
                assert s.sample  # a prompt (or recompute) runs whole
            if s.from_device:
                assert s.num_tokens == 1 and s.start == seq.num_known_tokens and not s.token_ids
            else:
                assert s.token_ids == truth[s.start : s.start + s.num_tokens]
            for pos in range(s.start, s.start + s.num_tokens):
                page, slot = self._slot(seq, pos)
                assert page != NULL_BLOCK
                self.kv[page, slot] = (pos, truth[pos])
        sampled: dict[str, int] = {}
        for s in out.scheduled:
            seq, truth = s.seq, truths[s.seq.seq_id]
            end = s.start + s.num_tokens
            context = [self.kv[self._slot(seq, pos)] for pos in range(end)]
            assert [p for p, _ in context] == list(range(end)), "KV at the wrong position"
            assert [t for _, t in context] == truth[:end], "KV of other tokens"
            if s.sample and s.spec_token_ids:  # greedy verification: accept while the model agrees
                emitted = []
                for j in range(len(s.spec_token_ids) + 1):
                    emitted.append(model([t for _, t in context[: s.start + 1 + j]]))
                    if j == len(s.spec_token_ids) or emitted[-1] != s.spec_token_ids[j]:
                        break
                sampled[seq.seq_id] = emitted
                self.on_device[seq.seq_id].extend(emitted)
            elif s.sample:
                sampled[seq.seq_id] = model([t for _, t in context])
                self.on_device[seq.seq_id].append(sampled[seq.seq_id])
        self.inflight.append((out, sampled))
        return out

    def complete(self) -> list[Sequence]:
        out, sampled = self.inflight.popleft()
        appended = self.sched.update(out, sampled)
        max_model_len = self.sched.config.max_model_len
        for seq in appended:
            new = sampled[seq.seq_id] if isinstance(sampled[seq.seq_id], list) else [sampled[seq.seq_id]]
            assert [self.on_device[seq.seq_id].popleft() for _ in new] == seq.output_token_ids[-len(new) :]
            del seq.output_token_ids[len(seq.output_token_ids) - len(new) :]  # replayed one by one, as the engine
            for token in new:
                seq.output_token_ids.append(token)
                if token == STOP:
                    self.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
                elif seq.num_output_tokens >= (seq.max_tokens or 1 << 30) or seq.num_known_tokens >= max_model_len:
                    self.finish(seq.seq_id, SequenceStatus.FINISHED_LENGTH)
                if seq.is_finished:
                    break
            else:
                self.propose(seq)
        return appended

    def propose(self, seq: Sequence) -> None:
        """Speculative decoding's proposer (none here; tests/test_spec_scheduler.py sets one)."""

    def finish(self, seq_id: str, status: SequenceStatus) -> bool:
        seq = self.sched.get(seq_id)
        if self.sched.finish(seq_id, status):
            self.finished[seq_id] = seq
            return True
        return False

    def step(self) -> SchedulerOutput:
        out = self.launch()
        self.complete()
        return out

    @property
    def verifying(self) -> bool:
        """A step in flight verifies proposals: as LLMEngine does, the next one is scheduled after its tokens (the
        scheduler rolls back the rejected ones then; scheduling before would read the unverified progress)."""
        return any(s.spec_token_ids for out, _ in self.inflight for s in out.scheduled)

    def run(self, max_steps: int = 1000, lookahead: bool = False) -> None:
        while self.sched.has_unfinished() or self.inflight:
            assert self.steps < max_steps, "no progress"
            if lookahead and self.sched.has_unfinished() and not self.verifying:
                self.launch()
                if len(self.inflight) > 1:
                    self.complete()
            else:
                if not self.inflight:
                    self.launch()
                self.complete()


def seq(seq_id, prompt, **kw) -> Sequence:
    kw.setdefault("arrival_time", 0.0)
    return Sequence(seq_id, list(prompt), **kw)


def chunks(out: SchedulerOutput) -> list[tuple]:
    return [(s.seq.seq_id, s.start, s.num_tokens, s.sample) for s in out.scheduled]


# ---- configs ----


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="max_num_batched_tokens \\(100\\) is smaller than max_model_len \\(200\\)"):
        SchedulerConfig(max_num_batched_tokens=100, max_model_len=200, enable_chunked_prefill=False)
    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, max_model_len=200)  # fine with chunking
    with pytest.raises(ValueError, match="must be greater than or equal to max_num_seqs"):
        SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=16, max_model_len=64)
    for field, value in [("max_num_seqs", 0), ("max_model_len", -1), ("max_num_batched_tokens", 1.5)]:
        kw = {"max_model_len": 8, "max_num_seqs": 1, "max_num_batched_tokens": 8, field: value}
        with pytest.raises(ValueError, match=field):
            SchedulerConfig(**kw)
    with pytest.raises(ValueError, match="num_blocks"):
        CacheConfig(num_blocks=1)
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(num_blocks=8, block_size=0)
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(num_blocks=4, block_size=4, max_model_len=16)  # 3 usable blocks: 12 tokens
    with pytest.raises(ValueError, match="more than max_model_len"):
        make_scheduler(max_model_len=8).add(seq("a", range(9)))


# ---- chunked prefill ----


def test_chunked_prefill_splits_a_prompt_over_the_budget():
    sched = make_scheduler(budget=4, max_num_seqs=2)
    eng = FakeEngine(sched)
    eng.add(seq("a", [0, 1, 2] * 3 + [0], max_tokens=3))  # 10 tokens
    assert chunks(eng.step()) == [("a", 0, 4, False)]
    assert chunks(eng.step()) == [("a", 4, 4, False)]
    assert chunks(eng.step()) == [("a", 8, 2, True)]
    eng.add(seq("b", [1] * 6, max_tokens=1))
    # Running first (a's decode), then b gets what is left of the budget.
    assert chunks(eng.step()) == [("a", 10, 1, True), ("b", 0, 3, False)]
    assert chunks(eng.step())[1] == ("b", 3, 3, True)


def test_chunked_prefill_off_runs_prompts_whole():
    sched = make_scheduler(budget=12, max_model_len=12, max_num_seqs=4, chunked=False, caching=False)
    eng = FakeEngine(sched)
    eng.add(seq("a", [1] * 10, max_tokens=2))
    eng.add(seq("b", [2] * 5, max_tokens=2))
    assert chunks(eng.step()) == [("a", 0, 10, True)]  # b (5) does not fit the 2 tokens left: it waits
    assert chunks(eng.step()) == [("a", 10, 1, True), ("b", 0, 5, True)]


def test_waiting_admission_stops_at_the_first_that_does_not_fit():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64, max_model_len=16, caching=False)  # 4 blocks
    eng = FakeEngine(sched)
    eng.add(seq("a", [1] * 12, arrival_time=0.0, max_tokens=2))  # 3 blocks
    eng.add(seq("b", [1] * 8, arrival_time=1.0, max_tokens=2))  # 2 blocks: no
    eng.add(seq("c", [2] * 2, arrival_time=2.0, max_tokens=2))  # 1 block, but FCFS: behind b
    assert chunks(eng.step()) == [("a", 0, 12, True)]
    assert sched.num_waiting == 2


# ---- preemption ----


def test_preemption_takes_the_newest_running_sequence_and_recomputes_it():
    # 6 usable blocks of 2 tokens; three sequences of 4 prompt tokens fill them.
    sched = make_scheduler(num_blocks=7, block_size=2, budget=32, max_model_len=12, caching=False)
    eng = FakeEngine(sched)
    for i, name in enumerate("abc"):
        eng.add(seq(name, [i] * 4, arrival_time=float(i), max_tokens=8))
    out = eng.step()
    assert [s.seq.seq_id for s in out.scheduled] == ["a", "b", "c"] and sched.block_manager.num_free_blocks == 0
    out = eng.step()  # a needs a third block for position 4: c (newest) goes
    assert out.preempted == ["c"] and chunks(out) == [("a", 4, 1, True), ("b", 4, 1, True)]
    c = sched.get("c")
    assert c.status is SequenceStatus.PREEMPTED and c.num_computed_tokens == 0 and c.block_table == []
    assert c.num_output_tokens == 1 and sched.num_preemptions == 1 and sched.stats.num_preemptions == 1
    assert "c" in out.freed
    eng.run()
    assert set(eng.finished) == {"a", "b", "c"}
    for name, s in eng.finished.items():
        assert (s.output_token_ids, s.status) == reference(s.prompt_token_ids, 8, 12), name


def test_a_sequence_that_is_the_newest_preempts_itself():
    sched = make_scheduler(num_blocks=4, block_size=2, budget=16, max_model_len=6, caching=False)  # 3 blocks
    eng = FakeEngine(sched)
    eng.add(seq("a", [1, 1, 1], arrival_time=0.0, max_tokens=3))  # 2 blocks
    eng.add(seq("b", [2, 2], arrival_time=1.0, max_tokens=3))  # 1 block
    eng.step()
    out = eng.step()  # a: position 3 fits its block 2; b: position 2 needs a 4th block -> b preempts itself
    assert out.preempted == ["b"] and chunks(out) == [("a", 3, 1, True)]
    eng.run()
    assert {k: v.status for k, v in eng.finished.items()} == {
        k: reference(p, 3, 6)[1] for k, p in [("a", [1, 1, 1]), ("b", [2, 2])]
    }


def test_a_recompute_is_chunked_and_samples_only_at_its_end():
    sched = make_scheduler(num_blocks=4, block_size=2, budget=2, max_num_seqs=2, max_model_len=6, caching=False)
    eng = FakeEngine(sched)
    eng.add(seq("a", [0, 1], arrival_time=0.0, max_tokens=8))
    eng.add(seq("b", [1, 2], arrival_time=1.0, max_tokens=8))
    trace = [eng.step() for _ in range(6)]
    assert [chunks(o) for o in trace[:3]] == [
        [("a", 0, 2, True)],
        [("a", 2, 1, True), ("b", 0, 1, False)],
        [("a", 3, 1, True), ("b", 1, 1, True)],
    ]
    assert trace[3].preempted == ["b"] and chunks(trace[3]) == [("a", 4, 1, True)]
    # b recomputes its prompt and its one output token (3 tokens) under a budget of 2.
    assert chunks(trace[4]) == [("b", 0, 2, False)] and chunks(trace[5]) == [("b", 2, 1, True)]
    eng.run()
    assert (eng.finished["b"].output_token_ids, eng.finished["b"].status) == reference([1, 2], 8, 6)


def test_readmission_after_preemption_reuses_cached_blocks():
    sched = make_scheduler(num_blocks=6, block_size=2, budget=32, max_model_len=10)  # 5 usable blocks
    eng = FakeEngine(sched)
    eng.add(seq("a", [0, 1, 2, 0], arrival_time=0.0, max_tokens=2))  # 2 blocks
    eng.add(seq("c", [2, 0, 0, 1, 1], arrival_time=1.0, max_tokens=3))  # 3 blocks, the last one partial
    assert chunks(eng.step()) == [("a", 0, 4, True), ("c", 0, 5, True)]
    out = eng.step()  # a's position 4 needs a page: c is preempted; its 2 full blocks stay cached
    assert out.preempted == ["c"] and chunks(out) == [("a", 4, 1, True)]
    assert eng.finished["a"].status is SequenceStatus.FINISHED_LENGTH
    c = sched.get("c")
    hits = sched.block_manager.prefix_cache_hits
    assert chunks(eng.step()) == [("c", 4, 2, True)]  # prompt + 1 output: the first 4 tokens are hits
    assert sched.block_manager.prefix_cache_hits - hits == 4 and c.num_cached_tokens == 0 and c.num_preemptions == 1
    eng.run()
    assert (c.output_token_ids, c.status) == reference([2, 0, 0, 1, 1], 3, 10)


# ---- priority ----


def test_priority_orders_admission_and_preemption():
    sched = make_scheduler(num_blocks=7, block_size=2, budget=32, max_num_seqs=2, max_model_len=12, caching=False)
    eng = FakeEngine(sched)
    eng.add(seq("low", [0] * 4, arrival_time=0.0, priority=5, max_tokens=8))
    eng.add(seq("late", [1] * 4, arrival_time=2.0, priority=0, max_tokens=8))
    eng.add(seq("early", [2] * 4, arrival_time=1.0, priority=0, max_tokens=8))
    assert [s.seq.seq_id for s in eng.step().scheduled] == ["early", "late"]
    assert sched.waiting[0].seq_id == "low"
    sched2 = make_scheduler(num_blocks=7, block_size=2, budget=32, max_model_len=12, caching=False)
    eng2 = FakeEngine(sched2)
    eng2.add(seq("x", [0] * 4, arrival_time=0.0, priority=0, max_tokens=8))
    eng2.add(seq("y", [1] * 4, arrival_time=1.0, priority=1, max_tokens=8))
    eng2.add(seq("z", [2] * 4, arrival_time=2.0, priority=0, max_tokens=8))
    assert [s.seq.seq_id for s in eng2.step().scheduled] == ["x", "z", "y"]
    assert eng2.step().preempted == ["y"]  # the lowest priority goes first, not the newest arrival


# ---- prefix caching ----


def test_prefix_cache_hits_are_reported():
    sched = make_scheduler(block_size=4, budget=64)
    eng = FakeEngine(sched)
    shared = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]  # 18 tokens: 4 full blocks
    eng.add(seq("a", shared, max_tokens=1))
    eng.run()
    eng.add(seq("b", shared + [2, 2], max_tokens=1))
    out = eng.step()
    assert chunks(out) == [("b", 16, 4, True)]
    b = eng.finished["b"]
    assert b.num_cached_tokens == 16
    st_ = sched.stats
    assert (st_.prefix_cache_queries, st_.prefix_cache_hits) == (18 + 20, 16)
    eng.add(seq("c", shared, max_tokens=1, skip_prefix_cache_read=True))
    assert chunks(eng.step()) == [("c", 0, 18, True)]
    assert eng.finished["c"].num_cached_tokens == 0


def test_prefix_cache_never_changes_outputs():
    prompts = [[0, 1, 2, 0, 1, 2, 0, 1] + [i % 3] * (i + 1) for i in range(6)]
    results = []
    for caching in (False, True):
        sched = make_scheduler(num_blocks=13, block_size=2, budget=8, max_num_seqs=3, max_model_len=24, caching=caching)
        eng = FakeEngine(sched)
        for i, p in enumerate(prompts):
            eng.add(seq(f"s{i}", p, arrival_time=float(i), max_tokens=6))
        eng.run()
        results.append({k: v.output_token_ids for k, v in eng.finished.items()})
        assert sched.block_manager.num_free_blocks == 12
    assert results[0] == results[1] == {f"s{i}": reference(p, 6, 24)[0] for i, p in enumerate(prompts)}


# ---- async scheduling ----


def test_async_schedule_before_update_feeds_the_pending_token():
    sched = make_scheduler(block_size=4)
    eng = FakeEngine(sched)
    eng.add(seq("a", [0, 1, 2], max_tokens=4))
    out1 = eng.launch()
    assert chunks(out1) == [("a", 0, 3, True)] and sched.get("a").num_pending == 1
    out2 = eng.launch()  # before update(out1)
    (s,) = out2.scheduled
    assert (s.start, s.num_tokens, s.sample, s.token_ids, s.from_device) == (3, 1, True, [], True)
    assert sched.get("a").num_pending == 2 and sched.get("a").num_tokens == 5
    eng.complete()  # update(out1)
    a = sched.get("a")
    assert a.num_output_tokens == 1 and a.num_pending == 1
    eng.run(lookahead=True)
    assert eng.finished["a"].output_token_ids == reference([0, 1, 2], 4, 64)[0]


def test_async_preempted_sequence_waits_for_its_pending_token():
    sched = make_scheduler(num_blocks=5, block_size=2, budget=16, max_model_len=8, caching=False)  # 4 blocks
    eng = FakeEngine(sched)
    eng.add(seq("a", [0, 0, 1], arrival_time=0.0, max_tokens=4))  # 2 blocks
    eng.add(seq("b", [1, 2, 2, 1], arrival_time=1.0, max_tokens=4))  # 2 blocks
    eng.launch()  # both prefill and sample: pending 1 each
    out2 = eng.launch()  # a's pending token fits its block; b's position 4 needs a 5th page: b preempted
    assert out2.preempted == ["b"] and chunks(out2) == [("a", 3, 1, True)]
    b = sched.get("b")
    assert b.status is SequenceStatus.PREEMPTED and b.num_pending == 1
    eng.complete()  # update(out1): a gets token 1, b gets its token though it is waiting
    assert b.num_pending == 0 and b.num_output_tokens == 1
    eng.run(lookahead=True)
    for name, prompt in [("a", [0, 0, 1]), ("b", [1, 2, 2, 1])]:
        assert eng.finished[name].output_token_ids == reference(prompt, 4, 8)[0]


def test_async_readmission_is_blocked_while_a_token_is_pending():
    sched = make_scheduler(num_blocks=5, block_size=2, budget=16, max_model_len=8, caching=False)
    b = seq("b", [1, 2])
    sched.add(b)
    out = sched.schedule()
    sched._preempt(b, out)  # preempted with its sampled token still in flight
    assert b.num_pending == 1 and sched.schedule().is_empty
    sched.update(out, {"b": 0})
    assert chunks(sched.schedule()) == [("b", 0, 3, True)]


def test_finished_while_in_flight_ignores_the_late_token():
    sched = make_scheduler(block_size=4)
    eng = FakeEngine(sched)
    eng.add(seq("a", [0, 1], max_tokens=10))
    eng.launch()
    out2 = eng.launch()
    eng.complete()
    a = sched.get("a")
    n = a.num_output_tokens
    assert sched.finish("a", SequenceStatus.FINISHED_STOPPED)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks
    assert sched.update(out2, {"a": 2}) == [] and a.num_output_tokens == n
    assert not sched.finish("a", SequenceStatus.FINISHED_ABORTED) and not sched.has_unfinished()
    # No step runs on an empty schedule, so no runner would see "a" freed there: the next step reports it.
    assert sched.schedule().freed == []
    eng.add(seq("b", [3], max_tokens=2))
    out = sched.schedule()
    assert not out.is_empty and "a" in out.freed


# ---- abort, length ----


def test_abort_in_any_state_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=9, block_size=2, budget=3, max_num_seqs=3, max_model_len=16)
    eng = FakeEngine(sched)
    eng.add(seq("running", [0, 1, 2], arrival_time=0.0))
    eng.add(seq("partial", [1] * 6, arrival_time=1.0))
    eng.add(seq("waiting", [2] * 4, arrival_time=2.0))
    eng.step()  # running: 3 tokens; nothing left for the others
    eng.step()  # running decodes, partial gets 2 of 6
    assert sched.get("partial").num_computed_tokens == 2 and sched.get("waiting").status is SequenceStatus.WAITING
    for name in ("partial", "waiting", "running"):
        assert sched.abort(name)
        assert sched.get(name) is None
    assert not sched.abort("running") and not sched.abort("nope")
    assert sched.block_manager.num_free_blocks == 8 and not sched.has_unfinished()
    assert sched.num_running == sched.num_waiting == 0


def test_max_tokens_and_max_model_len_stop_scheduling():
    sched = make_scheduler(block_size=2, max_model_len=6)
    a = seq("a", [0, 1], max_tokens=1)
    b = seq("b", [1] * 6)  # a prompt of exactly max_model_len still samples one token (vLLM)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert chunks(out) == [("a", 0, 2, True), ("b", 0, 6, True)]
    assert sched.schedule().is_empty  # both wait for update: a hit max_tokens, b max_model_len
    sched.update(out, {"a": 0, "b": 0})
    assert sched.schedule().is_empty and sched.has_unfinished()
    assert sched.finish("a", SequenceStatus.FINISHED_LENGTH) and sched.finish("b", SequenceStatus.FINISHED_LENGTH)
    assert a.status.finish_reason == "length" and not sched.has_unfinished()


# ---- random workloads ----


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.integers(1, 4),
        max_model_len=st.integers(3, 14),
        extra_blocks=st.integers(0, 4),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(1, 16),
        chunked=st.booleans(),
        caching=st.booleans(),
    )
    def setup(self, block_size, max_model_len, extra_blocks, max_num_seqs, budget, chunked, caching):
        budget = max(budget, max_num_seqs, 0 if chunked else max_model_len)
        num_blocks = -(-max_model_len // block_size) + 1 + extra_blocks
        self.sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget, max_model_len, chunked, caching)
        self.eng = FakeEngine(self.sched)
        self.n = 0
        self.max_tokens: dict[str, int] = {}
        self.interrupted: set[str] = set()

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14),
        max_tokens=st.integers(1, 6),
        priority=st.integers(0, 1),
    )
    def add(self, prompt, max_tokens, priority):
        prompt = prompt[: self.sched.config.max_model_len]
        name = f"s{self.n}"
        self.eng.add(seq(name, prompt, arrival_time=float(self.n), max_tokens=max_tokens, priority=priority))
        self.max_tokens[name] = max_tokens
        self.n += 1

    @precondition(lambda self: not self.eng.inflight)
    @rule()
    def step(self):
        self.eng.step()

    @precondition(lambda self: len(self.eng.inflight) == 1 and not self.eng.verifying)
    @rule()
    def launch_ahead(self):
        self.eng.launch()

    @precondition(lambda self: self.eng.inflight)
    @rule()
    def complete(self):
        self.eng.complete()

    @precondition(lambda self: self.sched.seqs)
    @rule(data=st.data(), abort=st.booleans())
    def interrupt(self, data, abort):
        name = data.draw(st.sampled_from(sorted(self.sched.seqs)))
        status = SequenceStatus.FINISHED_ABORTED if abort else SequenceStatus.FINISHED_STOPPED
        assert self.eng.finish(name, status)
        self.interrupted.add(name)

    @invariant()
    def consistent(self):
        sched = self.sched
        bm = sched.block_manager
        bm.check_invariants([s.block_table for s in sched.seqs.values()])
        assert len(sched.running) <= sched.config.max_num_seqs
        assert len(sched.running) + len(sched.waiting) == len(sched.seqs)
        for s in sched.running:
            assert s.status is SequenceStatus.RUNNING
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens
            assert s.num_computed_tokens <= s.num_tokens
        for s in sched.waiting:
            assert s.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
            assert s.block_table == [] and s.num_computed_tokens == 0

    def teardown(self):
        if not hasattr(self, "eng"):
            return
        self.eng.run(max_steps=self.eng.steps + 400, lookahead=bool(self.n % 2))
        bm = self.sched.block_manager
        bm.check_invariants([])
        assert bm.num_free_blocks == bm.num_usable_blocks and not any(bm.ref_counts)
        max_model_len = self.sched.config.max_model_len
        for name, s in self.eng.finished.items():
            if name not in self.interrupted:
                expected = reference(s.prompt_token_ids, self.max_tokens[name], max_model_len)
                assert (s.output_token_ids, s.status) == expected, name
            else:
                full = reference(s.prompt_token_ids, self.max_tokens[name], max_model_len)[0]
                assert s.output_token_ids == full[: len(s.output_token_ids)], name


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
