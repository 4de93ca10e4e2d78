"""vLLM's offline API around generate(): what its examples call on LLM (profiling, the prefix cache's reset, the
seeded process), SamplingParams' best_of, and the argument-parser entry points (EngineArgs.add_cli_args,
FlexibleArgumentParser, LLMEngine.from_engine_args)."""

import glob
import random

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import ParameterError
from tests.tiny_models import make_tiny_model_dir

PROMPT = {"prompt_token_ids": [7, 21, 3, 99, 14, 5, 61, 33, 48, 2, 17, 85, 40, 12, 6, 90, 71, 25]}
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny_api")))[0]


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="float32", block_size=8, enforce_eager=True, max_model_len=128, seed=7)


def test_the_seed_seeds_the_process_as_vllm(tiny, llm):
    """vLLM's LLM(seed=...) seeds Python's and numpy's generators (its reproducibility example relies on it)."""
    draws = random.random(), np.random.rand()
    LLM(tiny, dtype="float32", enforce_eager=True, max_model_len=64, seed=7)
    assert (random.random(), np.random.rand()) == draws


def test_reset_prefix_cache(llm):
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    again = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16  # two full pages of 8
    assert llm.reset_prefix_cache() is True
    after = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == again.outputs[0].token_ids


def test_profile(llm, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    llm.stop_profile()
    assert glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)
    with pytest.raises(RuntimeError, match="No profile"):
        llm.stop_profile()


def test_get_metrics(tiny, llm):
    """vLLM's LLM.get_metrics() (its offline metrics example): with disable_log_stats=False, the engine's counters,
    gauges and request histograms under vLLM's names; each request's latencies from the engine's own times."""
    from jaxllm.metrics.reader import Counter, Gauge, Histogram

    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        llm.get_metrics()  # vLLM's LLM default: stats off
    m = LLM(tiny, dtype="float32", block_size=8, enforce_eager=True, max_model_len=128, disable_log_stats=False)
    prompts = [PROMPT, {"prompt_token_ids": PROMPT["prompt_token_ids"][:5]}]
    params = [GREEDY, SamplingParams(temperature=0.8, n=2, max_tokens=6, ignore_eos=True, seed=1)]
    m.generate(prompts, params, use_tqdm=False)
    got = {(x.name, tuple(sorted(x.labels.items()))): x for x in m.get_metrics()}
    labels = (("engine", "0"), ("model_name", tiny))

    def one(name, **extra):
        return got[(name, tuple(sorted(dict(labels, **extra).items())))]

    assert isinstance(one("vllm:num_requests_running"), Gauge) and one("vllm:num_requests_running").value == 0
    assert isinstance(one("vllm:prompt_tokens"), Counter) and one("vllm:prompt_tokens").value == 18 + 2 * 5  # n's each
    assert one("vllm:generation_tokens").value == 3 + 2 * 6
    assert one("vllm:request_success", finished_reason="length").value == 3  # each of n counts, as vLLM's
    ttft, e2e = one("vllm:time_to_first_token_seconds"), one("vllm:e2e_request_latency_seconds")
    assert isinstance(ttft, Histogram) and ttft.count == 3 and e2e.count == 3 and 0 < ttft.sum <= e2e.sum
    assert ttft.buckets["+Inf"] == 3 and list(ttft.buckets.values()) == sorted(ttft.buckets.values())
    itl = one("vllm:inter_token_latency_seconds")
    assert itl.count == 2 + 5 and itl.sum > 0  # once a step per request: 3 - 1 and 6 - 1 (n=2 shares its steps)
    assert one("vllm:request_generation_tokens").sum == 3 + 6 + 6
    assert one("vllm:request_params_n").sum == 1 + 2 and one("vllm:request_params_max_tokens").sum == 3 + 6
    # every step's tokens: the prefill of 18 + 5 + 5 (each of n's sequences), 2 steps of 3 sequences, 3 of 2
    it = one("vllm:iteration_tokens_total")
    assert (it.count, it.sum) == (6, 18 + 5 + 5 + 3 + 3 + 2 * 3)
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds"):
        assert one(name).count == 3


@pytest.mark.parametrize("tp", [1, 2])
def test_sleep_mode(tiny, llm, tp):
    """vLLM's LLM.sleep() / wake_up(): level 1 frees every weight and KV page on the devices (the weights wait in
    host memory), requests are refused until both are back, then the engine answers as before with an empty
    prefix cache."""
    import jax

    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        llm.sleep()
    m = LLM(
        tiny,
        dtype="float32",
        block_size=8,
        enforce_eager=True,
        max_model_len=128,
        enable_sleep_mode=True,
        tensor_parallel_size=tp,
    )
    before = m.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    runner = m.llm_engine.runner
    held = jax.tree.leaves((runner.params, runner.kv_caches))
    m.sleep()
    assert all(a.is_deleted() for a in held) and m.llm_engine.is_sleeping()
    with pytest.raises(ValueError, match="sleeping"):
        m.generate(PROMPT, GREEDY, use_tqdm=False)
    m.wake_up(["weights"])
    assert runner.sleeping == {"weights": False, "kv_cache": True} and m.llm_engine.is_sleeping()
    m.wake_up(["kv_cache"])
    assert not m.llm_engine.is_sleeping()
    assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(runner.params), held, strict=False))
    after = m.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert after.outputs[0].token_ids == before and after.num_cached_tokens == 0  # the prefix cache went with it
    m.sleep()
    m.wake_up()
    assert m.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
    with pytest.raises(ValueError, match="level 2"):
        m.sleep(level=2)
    with pytest.raises(ValueError, match="tags must be"):
        m.wake_up(["weight"])
    with pytest.raises(ValueError, match="enable_sleep_mode needs"):
        LLM(tiny, enable_sleep_mode=True, pipeline_parallel_size=2)


def test_best_of():
    """vLLM's best_of field: None or n; more (extra sequences to pick from) is refused as vLLM V1 refuses it."""
    assert SamplingParams(best_of=1).best_of == 1 and SamplingParams(n=2, best_of=2).best_of == 2
    for kw, message in [
        (dict(best_of=5), "best_of > n is not supported"),
        (dict(n=3, best_of=2), "best_of must be greater than or equal to n"),
        (dict(best_of=1.5), "best_of must be an integer"),
    ]:
        with pytest.raises(ParameterError, match=message) as e:
            SamplingParams(**kw)
        assert e.value.parameter == "best_of"


def test_vllm_example_command_lines(tiny, capsys):
    """vLLM's examples build the engine from a command line: FlexibleArgumentParser (underscores too) +
    EngineArgs.add_cli_args, then LLM(**vars(args)) or EngineArgs.from_cli_args -> LLMEngine.from_engine_args.
    Every EngineArgs field is a flag with its default; vLLM's other engine flags parse when given (and LLM() takes
    them as it takes keywords: here one warning); a script's own flags stay its own."""
    from jaxllm import EngineArgs, LLMEngine
    from jaxllm.engine.arg_utils import AsyncEngineArgs
    from jaxllm.engine.async_engine import AsyncLLM
    from jaxllm.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    assert EngineArgs.add_cli_args(parser) is parser
    parser.set_defaults(model=tiny)
    parser.add_argument_group("Sampling parameters").add_argument("--max-tokens", type=int)
    argv = ["--dtype", "float32", "--max_model_len", "0.2k", "-tp", "1", "--no-enable-prefix-caching"]
    argv += ["--enforce-eager", "--swap-space", "4", "--max-tokens", "3", "--hf-overrides", '{"rms_norm_eps": 1e-5}']
    args = vars(parser.parse_args(argv))
    assert args["max_model_len"] == 200 and args["enable_prefix_caching"] is False and args["swap_space"] == "4"
    assert args["block_size"] == EngineArgs().block_size and "kv_cache_memory_bytes" in args  # defaults, every field
    assert "max_seq_len_to_capture" not in args  # vLLM flags jaxllm lacks appear only when given
    max_tokens = args.pop("max_tokens")
    llm = LLM(**args)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and llm.llm_engine.max_model_len == 200
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--dtype", "float32", "--enforce-eager"]))
    assert engine_args.model == tiny and AsyncEngineArgs is EngineArgs
    engine = LLMEngine.from_engine_args(engine_args)
    engine.add_request("0", PROMPT, GREEDY)
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    import inspect

    # AsyncLLM.from_engine_args takes EngineArgs positionally, as vLLM's
    assert list(inspect.signature(AsyncLLM.from_engine_args).parameters)[:1] == ["engine_args"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", "lots"])
    assert "expected an integer such as 4096" in capsys.readouterr().err


def test_skip_tokenizer_init(tiny, tmp_path):
    """vLLM's skip_tokenizer_init (RL frameworks run the engine so): no tokenizer is loaded (a folder without
    tokenizer files serves), prompts are token ids and outputs token ids without text, the same tokens as with the
    tokenizer; a text prompt and what needs the tokenizer (stop strings, bad words, structured outputs, chat) are
    refused naming it."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    llm = LLM(str(bare), dtype="float32", enforce_eager=True, max_model_len=128, skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2), use_tqdm=False)
    ref = LLM(tiny, dtype="float32", enforce_eager=True, max_model_len=128).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    o = out[0].outputs[0]
    assert o.token_ids == ref[0].outputs[0].token_ids and o.text == ""
    assert all(lp.decoded_token is None for step in o.logprobs for lp in step.values())
    with pytest.raises(ValueError, match="cannot pass text prompts when `skip_tokenizer_init` is True"):
        llm.generate("the engine", use_tqdm=False)
    for kw in (dict(stop=["x"]), dict(bad_words=["x"])):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} needs the tokenizer"):
            llm.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
