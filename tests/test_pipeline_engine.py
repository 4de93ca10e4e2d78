"""Greedy tokens through the whole engine (LLM) at tp / pp / tp x pp equal tp=1, from an HF directory and
from a converted Orbax checkpoint."""

import pytest

from jaxllm import LLM, SamplingParams
from tests.tiny_models import make_tiny_model_dir

PROMPTS = [
    [5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 3, 83, 27],
    [101, 7],
    [8] * 19,
    [3],
    [44, 55, 66, 77, 88, 99, 11, 22, 33],
]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny")))[0]


def engine(model_dir, **kw):
    kw.setdefault("enforce_eager", True)
    return LLM(
        model_dir,
        dtype="float32",
        num_gpu_blocks_override=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=8,
        max_model_len=64,
        compilation_cache_dir=None,
        **kw,
    )


def greedy(model_dir, **kw):
    llm = engine(model_dir, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ref(tiny):
    return greedy(tiny)


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])  # tp=4 > kv heads: test_sharding, test_convert
def test_engine_greedy_equal_tp1(tiny, ref, tp, pp):
    assert greedy(tiny, tensor_parallel_size=tp, pipeline_parallel_size=pp) == ref


def prompt_logprobs(model_dir, **kw):
    llm = engine(model_dir, **kw)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    return [o.prompt_logprobs for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)])
def test_prompt_logprobs_equal_tp1(tiny, tp, pp):
    """Prompt logprobs with the lm_head split over the vocabulary (step_fns.prompt_logprobs: each shard's top-k,
    never the whole [T, V] gathered), in the step program and on the last pipeline stage: tp 1's tokens and ranks,
    its logprobs to float32 rounding."""
    want = prompt_logprobs(tiny)
    got = prompt_logprobs(tiny, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) and g[0] is None and w[0] is None
        for gd, wd in zip(g[1:], w[1:]):
            assert list(gd) == list(wd) and [x.rank for x in gd.values()] == [x.rank for x in wd.values()]
            assert [x.logprob for x in gd.values()] == pytest.approx([x.logprob for x in wd.values()], abs=1e-5)


def test_pipeline_warm_up_compiles_before_serving(tiny, ref):
    """pp > 1 with warm-up on (enforce_eager False, the default): start-up compiles every stage and the sampling
    head for each step shape (it used to lower the single-mesh step over the stages' devices and fail), and
    serving the prompts compiles nothing but the row gather of multi-micro-batch steps."""
    import jax

    compiles = []

    def on_event(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        llm = LLM(
            tiny,
            dtype="float32",
            num_gpu_blocks_override=64,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            block_size=8,
            enforce_eager=False,
            max_model_len=64,
            compilation_cache_dir=None,
            pipeline_parallel_size=2,
        )
        at_start = len(compiles)
        one = llm.generate({"prompt_token_ids": PROMPTS[3]}, GREEDY, use_tqdm=False)  # one micro-batch a step
        assert at_start and len(compiles) == at_start
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert one[0].outputs[0].token_ids == ref[3]


def test_engine_loads_converted_checkpoint(tiny, ref, tmp_path):
    from convert import convert_checkpoint

    out = convert_checkpoint(tiny, str(tmp_path / "orbax"), tp=2, dtype="float32", progress=False)
    assert greedy(out, tensor_parallel_size=2) == ref


def test_tp_warm_up_binds_each_loaders_weights(tiny, ref, tmp_path):
    """With warm-up on and no pipeline stages, the steps compile against abstract_weights while the weights
    load: each loader (HF safetensors; a converted Orbax checkpoint, at tp=4 through its repeated-kv-heads path)
    must hand back the shardings they were compiled for (set_params checks)."""
    from convert import convert_checkpoint

    out = convert_checkpoint(tiny, str(tmp_path / "orbax"), tp=2, dtype="float32", progress=False)
    assert greedy(tiny, tensor_parallel_size=2, enforce_eager=False) == ref
    assert greedy(out, tensor_parallel_size=4, enforce_eager=False) == ref
