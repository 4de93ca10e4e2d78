"""Speculative decoding through the whole engine (n-gram prompt lookup on a tiny Llama): greedy outputs are
token for token those without speculation, batched, with chunked prefill, prefix caching and preemption; stops in
the middle of a step's emitted tokens; logprobs per emitted token; the acceptance counters, Prometheus metrics
and the stats log line."""

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.metrics.prometheus import EngineMetrics
from server.metrics import StatsLogger
from tests.tiny_models import make_tiny_model_dir

# Repetitive prompts, so the n-gram lookup finds matches (the tiny random model also loops on its own).
PROMPTS = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35] * 3, [101, 7], [8] * 19, [3], [44, 55, 66, 77, 88, 99, 11, 22, 33] * 2]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": 64,
}  # CPU's cost model would stop speculating at ~3 sequences


def make_llm(model_dir, **kw):
    base = dict(
        dtype="float32",
        num_gpu_blocks_override=96,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=8,
        enforce_eager=True,
        max_model_len=128,
    )
    return LLM(model_dir, **(base | kw))


def run(llm, prompts=PROMPTS, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny")))[0]


@pytest.fixture(scope="module")
def plain(tiny):
    return make_llm(tiny)


@pytest.fixture(scope="module")
def spec(tiny):
    return make_llm(tiny, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def want(plain):
    return ids(run(plain))


def check_free(llm):
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "KV blocks leaked"


def test_greedy_is_identical_batched_and_proposals_are_accepted(spec, want):
    stats = spec.llm_engine.scheduler.spec_stats
    before = (stats.num_drafts, stats.num_accepted_tokens)
    assert ids(run(spec)) == want
    assert stats.num_drafts > before[0] and stats.num_accepted_tokens > before[1]
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert stats.num_accepted_tokens_per_pos == sorted(stats.num_accepted_tokens_per_pos, reverse=True)
    check_free(spec)


def test_greedy_is_identical_with_preemption_chunked_prefill_and_prefix_hits(tiny, want):
    llm = make_llm(
        tiny, num_gpu_blocks_override=14, max_model_len=64, max_num_batched_tokens=16, speculative_config=NGRAM
    )
    assert ids(run(llm)) == want
    assert ids(run(llm, PROMPTS[:2])) == want[:2]  # the prompts' pages are cached now
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.spec_stats.num_accepted_tokens > 0
    assert eng.scheduler.block_manager.prefix_cache_hits > 0
    check_free(llm)


def test_a_stop_inside_the_emitted_tokens_ends_the_output_there(spec, plain, want):
    """The stop token is one the greedy output reaches mid-way: tokens a step emitted after it are dropped."""
    stop = want[0][10]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop])
    got, ref = run(spec, PROMPTS[:1], params)[0].outputs[0], run(plain, PROMPTS[:1], params)[0].outputs[0]
    assert (got.token_ids, got.finish_reason, got.stop_reason) == (ref.token_ids, "stop", stop)
    assert got.text == ref.text
    check_free(spec)


def test_logprobs_are_those_without_speculation(spec, plain):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    got, ref = run(spec, PROMPTS[:1], params)[0].outputs[0], run(plain, PROMPTS[:1], params)[0].outputs[0]
    assert got.token_ids == ref.token_ids and len(got.logprobs) == len(ref.logprobs) == 16
    for g, r in zip(got.logprobs, ref.logprobs, strict=True):
        assert g.keys() == r.keys()
        for t in g:
            assert g[t].logprob == pytest.approx(r[t].logprob, abs=1e-4) and g[t].rank == r[t].rank
    assert got.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)


def test_sampling_with_penalties_and_filters_runs_and_is_seeded(spec):
    params = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.5, max_tokens=20, seed=7, ignore_eos=True
    )
    a, b = ids(run(spec, PROMPTS[:2], params)), ids(run(spec, PROMPTS[:2], params))
    assert a == b and all(len(t) == 20 for t in a)
    check_free(spec)


def test_counters_reach_prometheus_and_the_log_line(spec):
    eng = spec.llm_engine
    eng.stats()  # drains the steps' token counts: EngineMetrics' registration polls before it can file them
    metrics = EngineMetrics(eng, "tiny")
    logger = StatsLogger(metrics, 10.0)
    logger.line()
    run(spec, PROMPTS[:1])
    text = metrics.render().decode()
    sd = eng.stats().spec_decode
    labels = '{engine="0",model_name="tiny"}'  # prometheus_client writes the labels sorted
    assert f"vllm:spec_decode_num_drafts_total{labels} {float(sd.num_drafts)}" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{labels} {float(sd.num_accepted_tokens)}" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{labels} {float(sd.num_draft_tokens)}" in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"}' in text
    line = logger.line()
    assert "SpecDecoding metrics: Mean acceptance length: " in line and "Avg Draft acceptance rate: " in line
    # LLM.get_metrics()'s reader: the per-position counters as one Vector, as vLLM's reader gives them
    from jaxllm.metrics.reader import Counter, Vector, get_metrics_snapshot

    snap = {m.name: m for m in get_metrics_snapshot(metrics.registry)}
    per_pos = snap["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.labels == {"engine": "0", "model_name": "tiny"}
    assert per_pos.values == sd.num_accepted_tokens_per_pos
    assert isinstance(snap["vllm:spec_decode_num_drafts"], Counter) and snap["vllm:spec_decode_num_drafts"].value


def test_no_spec_metrics_without_speculation(plain):
    assert plain.llm_engine.stats().spec_decode is None  # (and drains the token counts, as above)
    assert "spec_decode" not in EngineMetrics(plain.llm_engine, "tiny").render().decode()


def test_bad_configs_fail_before_anything_loads(tiny):
    with pytest.raises(ValueError, match="Expected num_speculative_tokens to be greater than zero"):
        make_llm(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_steps_whose_program_is_compiling_run_unverified(spec, plain):
    """After warm-up a speculative step with new sampler flags (a logit bias here) does not wait for its program:
    it runs as plain decodes (every proposal rolled back, uncounted) while the program compiles in the
    background. Greedy outputs with the bias are still those without speculation."""
    runner = spec.llm_engine.runner.programs
    runner.eager, runner.warmed_up = False, True
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={0: -5.0})
        drafts = spec.llm_engine.scheduler.spec_stats.num_drafts
        got = ids(run(spec, PROMPTS[:1], params))
        assert got == ids(run(plain, PROMPTS[:1], params))
        runner.wait_for_background_compiles()
        assert any(v.num_spec and v.flags.bias for v in runner.compiled)
        assert ids(run(spec, PROMPTS[:1], params)) == got
        assert spec.llm_engine.scheduler.spec_stats.num_drafts > drafts
    finally:
        runner.eager = True
    check_free(spec)
