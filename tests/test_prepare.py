"""StepPreparer's steady-decode path (prepare.py: _next_decode, packing.repack) against its full prepare(): two
runners take the same scheduler outputs, one of them forgetting its last step each time, and every step's inputs,
variant, rows and packed buffers must be equal. The runs cross page boundaries, finish, add and preempt
sequences, cross the long-context threshold and mix sampling settings."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from bench import common
from jaxllm.config import ModelConfig
from jaxllm.engine.configs import CacheConfig, SchedulerConfig
from jaxllm.engine.packing import pack_host_args
from jaxllm.engine.runner import ModelRunner
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Sequence, SequenceStatus
from jaxllm.sampling_params import SamplingParams
from jaxllm.sharding import ParallelConfig

BLOCK, MAX_LEN = 4, 64


def _runner(num_blocks: int, max_seqs: int) -> ModelRunner:
    cfg = ModelConfig.from_hf(dict(common.TINY, max_position_embeddings=MAX_LEN), dtype="float32")
    return ModelRunner(
        cfg,
        None,
        ParallelConfig(1, 1).make_mesh(),
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=512,
        max_model_len=MAX_LEN,
    )


def _same(a, b, what: str) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, what
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)
        assert np.asarray(x).dtype == np.asarray(y).dtype, what


def _run(params: list[SamplingParams], *, steps: int, num_blocks: int, long_from: int = 0, arrive=None, bias_at=None):
    """Drives a scheduler with one-step lookahead (as the engine: step N + 1 is prepared before step N's tokens are
    delivered) and returns how many steps the steady-decode path prepared. arrive: step -> the SamplingParams of
    a request added then; bias_at: the step from which the first sequence has an engine logit bias (as min_tokens
    gives: seq.bias_row, per token)."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=MAX_LEN),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=True),
    )
    fast, full = _runner(num_blocks, 8), _runner(num_blocks, 8)
    fast.host.long_decode_from = full.host.long_decode_from = long_from
    rng = np.random.default_rng(0)
    continued = []  # the steps the steady-decode path prepared
    next_decode = fast.host._next_decode
    fast.host._next_decode = lambda out: continued.append(next_decode(out)) or continued[-1]

    def add(i, sp):
        seq = Sequence(
            str(i), rng.integers(100, 500, 5 + 3 * (i % 4)).tolist(), max_tokens=sp.max_tokens, sampling_params=sp
        )
        seq.rng_seed, seq.bias_row = i, dict(sp.logit_bias or {})
        sched.add(seq)
        return seq

    first = [add(i, sp) for i, sp in enumerate(params)][0]
    prev = None
    for step in range(steps):
        if arrive and step in arrive:
            add(len(params) + step, arrive[step])
        if step == bias_at:
            first.bias_row = {11: -100.0}
        out = sched.schedule()
        if out.is_empty:
            break
        full.host._last_decode = None
        p = fast.prepare(out)
        q = full.prepare(out)
        assert p.variant == q.variant and p.sample_rows == q.sample_rows and p.prompt_rows == q.prompt_rows
        assert p.num_logprobs == q.num_logprobs
        _same(p.host_args, q.host_args, f"step {step}")
        pi, pf, pl = p.packed or pack_host_args(p.host_args)
        qi, qf, ql = pack_host_args(q.host_args)
        np.testing.assert_array_equal(pi, qi), np.testing.assert_array_equal(pf, qf)
        assert pl == ql
        fast.host.prev_rows, full.host.prev_rows = dict(p.sample_rows), dict(q.sample_rows)
        if prev is not None:
            done = sched.update(prev[0], {sid: 7 + step for sid in prev[1]})
            for seq in done:
                if seq.max_tokens is not None and seq.num_output_tokens >= seq.max_tokens:
                    sched.finish(seq.seq_id, SequenceStatus.FINISHED_LENGTH)
        prev = (out, p.sample_rows)
    return sum(c is not None for c in continued)


def test_steady_decode_matches_full_prepare_across_pages_finishes_and_arrivals():
    params = [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=13, temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=5, logprobs=2),
    ]
    arrive = {20: SamplingParams(max_tokens=8, temperature=0.5)}
    n_fast = _run(params, steps=45, num_blocks=80, arrive=arrive, bias_at=30)
    assert n_fast >= 18  # steady decodes: all but the prefills, a finish, an arrival and the biased steps


def test_steady_decode_crosses_the_long_context_threshold():
    assert _run([SamplingParams(max_tokens=30, temperature=0.0)], steps=30, num_blocks=64, long_from=20) >= 20


def test_steady_decode_under_preemption():
    """Few pages: sequences are preempted and recomputed (freed rows, new tables) along the way."""
    params = [SamplingParams(max_tokens=40, temperature=0.0) for _ in range(4)]
    assert _run(params, steps=80, num_blocks=24) > 0


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_tokens=20, repetition_penalty=1.2),  # penalties read every token so far
        SamplingParams(max_tokens=20, logit_bias={5: 1.0}),  # logit biases: the sampler's bias rows
        SamplingParams(max_tokens=20, allowed_token_ids=[5, 6, 7]),
    ],
)
def test_steps_whose_inputs_change_otherwise_take_the_full_prepare(sp):
    assert _run([sp, SamplingParams(max_tokens=20)], steps=20, num_blocks=64) == 0
