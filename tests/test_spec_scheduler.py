"""Speculative decoding in the scheduler: proposals ride on decode-only steps, the step emits the accepted ones
plus one token, and the rejected ones' KV progress and pages are rolled back. Driven by tests/test_scheduler.py's
FakeEngine (a shadow KV cache through the block tables, greedy verification against its fake model), so a wrong
rollback, a page freed while in use or a proposal fed at the wrong position changes the generated tokens, which
must equal the unscheduled reference, under chunked prefill, prefix caching, preemption and aborts."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from jaxllm.engine.configs import CacheConfig, SchedulerConfig
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Sequence, SequenceStatus
from tests.test_scheduler import FakeEngine, SchedulerMachine, chunks, model, reference, seq


def make_spec_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=64, chunked=True, caching=True, lookahead=0
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
        num_lookahead_tokens=lookahead,
    )


class SpecEngine(FakeEngine):
    """Proposes up to k tokens after each step: the fake model's own continuation, each token corrupted with
    probability `wrong` (so some are accepted, some rejected), sometimes none."""

    def __init__(self, sched: Scheduler, k: int = 3, wrong: float = 0.3, seed: int = 0):
        super().__init__(sched)
        self.k, self.wrong, self.rng = k, wrong, random.Random(seed)

    def propose(self, seq: Sequence) -> None:
        if self.rng.random() < 0.15:
            return
        ctx, props = seq.all_token_ids, []
        for _ in range(self.rng.randint(1, self.k)):
            t = model(ctx + props)
            props.append((t + 1) % 3 if self.rng.random() < self.wrong else t)
        seq.spec_token_ids = props


def test_a_decode_verifies_its_proposals_and_rolls_back_the_rejected():
    sched = make_spec_scheduler(block_size=4, max_model_len=64)
    eng = SpecEngine(sched)
    a = seq("a", [0, 0, 0, 0, 1], max_tokens=20)
    eng.add(a)
    eng.step()  # prefill: samples token 5
    truth = reference(a.prompt_token_ids, 20, 64)[0]
    assert 3 not in truth[:4]  # the fake model's stop token
    props = a.spec_token_ids = [truth[1], truth[2], (truth[3] + 1) % 3]  # two right, one wrong
    out = eng.launch()
    assert chunks(out) == [("a", 5, 4, True)] and out.scheduled[0].spec_token_ids == props
    assert a.spec_token_ids == [] and out.scheduled[0].token_ids == [truth[0], *props]
    assert len(a.block_table) == 3  # positions 5..8
    eng.complete()
    assert a.output_token_ids == truth[:4]  # the two accepted proposals and the model's token after them
    assert a.num_computed_tokens == 8 and len(a.block_table) == 2  # position 8 (rejected) rolled back, its page freed
    st = sched.spec_stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.num_accepted_tokens_per_pos) == (
        1,
        3,
        2,
        [1, 1, 0],
    )
    eng.run()
    assert (a.output_token_ids, a.status) == reference(a.prompt_token_ids, 20, 64)


def test_proposals_wait_for_decode_only_steps_and_respect_the_limits():
    sched = make_spec_scheduler(budget=8, max_model_len=16)
    eng = SpecEngine(sched, k=8, wrong=0.0)
    a = seq("a", [0, 1, 2], max_tokens=4)
    eng.add(a)
    eng.step()
    eng.add(seq("b", [2, 2, 1, 0, 1]))
    a.spec_token_ids = [1, 1, 1]
    out = eng.launch()  # b's prompt joins: no speculation in this step, a's proposals are dropped
    assert not any(s.spec_token_ids for s in out.scheduled) and a.spec_token_ids == []
    eng.complete()
    a.spec_token_ids = [0] * 8
    sched.get("b").spec_token_ids = []
    out = eng.launch()
    # a has 2 outputs of max_tokens 4: it may emit 2 more, so it verifies 1 proposal
    assert [len(s.spec_token_ids) for s in out.scheduled if s.seq is a] == [1]
    eng.complete()
    sched.speculate = False  # the engine's switch-off
    for s in sched.running:
        s.spec_token_ids = [0]
    assert not any(s.spec_token_ids for s in eng.launch().scheduled)
    eng.complete()


class SpecSchedulerMachine(SchedulerMachine):
    @initialize(
        block_size=st.integers(1, 4),
        max_model_len=st.integers(3, 14),
        extra_blocks=st.integers(0, 4),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(1, 16),
        chunked=st.booleans(),
        caching=st.booleans(),
        lookahead=st.integers(0, 2),
        k=st.integers(1, 4),
        seed=st.integers(0, 1000),
    )
    def setup(
        self, block_size, max_model_len, extra_blocks, max_num_seqs, budget, chunked, caching, lookahead, k, seed
    ):
        budget = max(budget, max_num_seqs, 0 if chunked else max_model_len)
        num_blocks = -(-max_model_len // block_size) + 1 + extra_blocks
        self.sched = make_spec_scheduler(
            num_blocks, block_size, max_num_seqs, budget, max_model_len, chunked, caching, lookahead
        )
        self.eng = SpecEngine(self.sched, k=k, seed=seed)
        self.n = 0
        self.max_tokens: dict[str, int] = {}
        self.interrupted: set[str] = set()

    @invariant()
    def consistent(self):
        sched = self.sched
        bm = sched.block_manager
        bm.check_invariants([s.block_table for s in sched.seqs.values()])
        for s in sched.running:
            assert s.status is SequenceStatus.RUNNING
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens
        for s in sched.waiting:
            assert s.block_table == [] and s.num_computed_tokens == 0 and s.spec_token_ids == []


TestSpecSchedulerMachine = SpecSchedulerMachine.TestCase
TestSpecSchedulerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
