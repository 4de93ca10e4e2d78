"""Embedding models (vLLM's pooling runner): LLM(..., runner="pooling").embed() / encode() give each prompt's
last-token hidden state after the final norm, normalized, as a sentence-transformers last-token model computes it
(checked against HF's base model on the same weights), through batching, chunked prefill and the prefix cache."""

import json
import os

import numpy as np
import pytest

from jaxllm import LLM, PoolingParams
from tests.tiny_models import make_tiny_model_dir

PROMPTS = [[5, 9, 2, 77, 3, 14, 15, 92, 6, 11, 40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 8], [5, 9, 2, 77, 3, 14, 15]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny_embed")))


@pytest.fixture(scope="module")
def hf_last(tiny):
    """HF's base model (final norm included): each prompt's last hidden state, float64."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny[0], dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0, -1].double().numpy() for p in PROMPTS]


def _llm(model_dir, **kw):
    kw = dict(dtype="float32", block_size=8, enforce_eager=True, max_model_len=64, **kw)
    return LLM(model_dir, **kw)


def test_embed_matches_hf_through_batching_chunks_and_the_prefix_cache(tiny, hf_last):
    llm = _llm(tiny[0], runner="pooling", max_num_batched_tokens=16, max_num_seqs=4)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.embed(prompts, use_tqdm=False)
    for out, ref in zip(outs, hf_last, strict=True):
        assert out.finished and len(out.outputs.embedding) == out.outputs.hidden_size == ref.shape[0]
        np.testing.assert_allclose(out.outputs.embedding, ref / np.linalg.norm(ref), atol=2e-5)
    again = llm.embed(prompts, use_tqdm=False)  # the prompts' full pages come from the prefix cache now
    assert again[0].num_cached_tokens == 16 and again[2].num_cached_tokens == 0
    for a, b in zip(outs, again, strict=True):
        np.testing.assert_allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-6)
    raw = llm.encode(prompts[:1], PoolingParams(normalize=False), use_tqdm=False)[0]
    assert raw.outputs.data.dtype == np.float32
    np.testing.assert_allclose(raw.outputs.data, hf_last[0], atol=2e-5)
    truncated = llm.embed(prompts[0], truncate_prompt_tokens=7, use_tqdm=False)[0]
    assert truncated.prompt_token_ids == PROMPTS[0][-7:]
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert llm.llm_engine.generation_tokens_total == 0  # an embedding generates nothing (its one step's token)
    with pytest.raises(ValueError, match="takes PoolingParams requests"):
        llm.generate(prompts[0], use_tqdm=False)
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed(prompts[0], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_matryoshka_dimensions_and_task_spellings(tiny, hf_last):
    """dimensions keeps the first k values, then normalizes (models whose config says they are Matryoshka);
    task="embed" and convert="embed" are vLLM's older and other spellings of runner="pooling"."""
    llm = _llm(tiny[0], task="embed", hf_overrides={"matryoshka_dimensions": [8, 16]})
    out = llm.embed({"prompt_token_ids": PROMPTS[1]}, pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    ref = hf_last[1][:8]
    np.testing.assert_allclose(out[0].outputs.embedding, ref / np.linalg.norm(ref), atol=2e-5)
    with pytest.raises(ValueError, match=r"only supports \[8, 16\]"):
        llm.embed({"prompt_token_ids": PROMPTS[1]}, pooling_params=PoolingParams(dimensions=4), use_tqdm=False)


def test_sentence_transformers_pooling_files(tiny, tmp_path):
    """The model folder's sentence-transformers modules decide the pooling and normalization, as in vLLM: a
    last-token Pooling module without a Normalize module gives unnormalized embeddings; mean pooling is refused
    before any weight loads."""
    import shutil

    from jaxllm.pooling_params import PoolerConfig

    folder = str(tmp_path / "st")
    shutil.copytree(tiny[0], folder)
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(
            [
                {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ],
            f,
        )
    os.makedirs(os.path.join(folder, "1_Pooling"))
    pooling = {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    assert PoolerConfig.resolve(folder, None) == PoolerConfig("LAST", False, None)
    assert PoolerConfig.resolve(folder, {"normalize": True}).normalize
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"pooling_mode_mean_tokens": True}, f)
    with pytest.raises(ValueError, match="Pooling type MEAN is not supported"):
        _llm(folder, runner="pooling")
    with pytest.raises(ValueError, match="pooler_config.foo is not supported"):
        PoolerConfig.resolve(None, {"foo": 1})


def test_runner_values(tiny):
    with pytest.raises(ValueError, match="runner='draft' is not supported"):
        _llm(tiny[0], runner="draft")
    with pytest.raises(ValueError, match="convert='classify' is not supported"):
        _llm(tiny[0], convert="classify")
    with pytest.raises(ValueError, match="runs without pipeline_parallel_size"):
        _llm(tiny[0], runner="pooling", pipeline_parallel_size=2)


def test_embeddings_route(tiny, hf_last):
    """/v1/embeddings through the openai SDK (its default base64 encoding, decoded) and as floats: the offline
    embeddings; token-id and text inputs; what an embedding server refuses, and a generative server's answer."""
    import openai

    from server.serve import build_engine
    from server.server_thread import ServerThread
    from tests.test_server_api import http
    from tests.tiny_models import tiny_serve_args

    args = tiny_serve_args(tiny[0], "--runner", "pooling")
    engine = build_engine(args)
    with ServerThread(engine, args=args) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        r = client.embeddings.create(model="tiny", input=PROMPTS[:2])
        assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
        for d, ref in zip(r.data, hf_last, strict=False):
            np.testing.assert_allclose(d.embedding, ref / np.linalg.norm(ref), atol=2e-5)
        status, text = http(
            "POST", srv.base_url + "/v1/embeddings", json={"input": PROMPTS[1], "encoding_format": "float"}
        )
        assert status == 200, text
        body = json.loads(text)
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        np.testing.assert_allclose(body["data"][0]["embedding"], r.data[1].embedding, atol=1e-6)
        assert len(client.embeddings.create(model="tiny", input="the engine").data[0].embedding) == len(hf_last[0])
        # vLLM's chat form: the conversation through the chat template (no generation prompt), as /tokenize renders it
        messages = [{"role": "user", "content": "the engine"}]
        tokenized = {"messages": messages, "add_generation_prompt": False, "add_special_tokens": False}
        ids = json.loads(http("POST", srv.base_url + "/tokenize", json=tokenized)[1])["tokens"]
        status, text = http("POST", srv.base_url + "/v1/embeddings", json={"messages": messages})
        assert status == 200, text
        by_ids = client.embeddings.create(model="tiny", input=ids).data[0].embedding
        np.testing.assert_allclose(json.loads(text)["data"][0]["embedding"], by_ids, atol=1e-6)
        for path, payload, what in [
            ("/v1/embeddings", {"input": PROMPTS[1], "dimensions": 8}, "matryoshka"),
            ("/v1/embeddings", {"input": []}, "input must not be empty"),
            ("/v1/embeddings", {"input": "x", "messages": messages}, "exactly one of `input` or `messages`"),
            ("/v1/embeddings", {"input": PROMPTS[1], "truncate_prompt_tokens": 0}, "must be an integer >= 1 or -1"),
            ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 2}, "embedding (pooling) model"),
        ]:
            status, text = http("POST", srv.base_url + path, json=payload)
            assert status == 400 and what in text, text
        bm = engine.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_usable_blocks
        metrics = http("GET", srv.base_url + "/metrics")[1]
        assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 6.0' in metrics
    plain_args = tiny_serve_args(tiny[0])
    with ServerThread(build_engine(plain_args), args=plain_args) as srv:
        status, text = http("POST", srv.base_url + "/v1/embeddings", json={"input": "x"})
        assert status == 400 and "does not support Embeddings API" in text
