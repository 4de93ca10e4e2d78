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
