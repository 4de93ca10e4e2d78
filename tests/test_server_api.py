"""The OpenAI server through the official `openai` client, against FakeEngine (no model)."""

import asyncio
import json
import logging
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from server.arg_types import human_readable_int
from server.args import engine_kwargs, parse_args
from server.server_thread import ServerThread
from server.testing import FakeEngine, build_tokenizer

MODEL = "fake-model"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    with ServerThread(FakeEngine(tok, max_model_len=256), "--served-model-name", MODEL, "alias") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=30)


def http(method: str, url: str, **kw) -> tuple[int, str]:
    async def go():
        async with aiohttp.ClientSession() as s, s.request(method, url, **kw) as r:
            return r.status, await r.text()

    return asyncio.run(go())


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


# ------------------------------------------------------------------------------------------------ completions


def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "alias"]
    assert extra(models[0], "max_model_len") == 256 and extra(models[0], "root") == MODEL
    assert client.models.retrieve("alias").id == "alias"
    assert http("GET", server.base_url + "/health") == (200, "")
    assert http("GET", server.base_url + "/ping")[0] == 200
    status, body = http("GET", server.base_url + "/version")
    assert status == 200 and '"version"' in body


def test_completion_basic(client, tok):
    r = client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=5, extra_body={"return_token_ids": True}
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    (c,) = r.choices
    assert c.finish_reason == "length" and c.logprobs is None
    ids = extra(c, "token_ids")
    assert len(ids) == 5 and tok.decode(ids) == c.text
    assert extra(c, "prompt_token_ids") == tok.encode("The quick brown")
    assert r.usage.prompt_tokens == len(tok.encode("The quick brown"))
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    # the alias is accepted, and responses name the first served name (vLLM); the default max_tokens is 16
    r2 = client.completions.create(model="alias", prompt="The quick brown")
    assert r2.model == MODEL and r2.usage.completion_tokens == 16


def test_completion_echo_and_logprobs(client, tok):
    prompt = "Birds sing every"
    n_prompt = len(tok.encode(prompt))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    for i in range(len(lp.tokens) - 1):
        assert lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i])
    assert "".join(lp.tokens) == c.text
    # echo with max_tokens=0 returns just the prompt (lm-eval-harness style scoring)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
    assert len(r.choices[0].logprobs.tokens) == n_prompt


def test_completion_multi_prompt_n_and_token_prompts(client, tok):
    ids = tok.encode("Children play near")
    r = client.completions.create(
        model=MODEL, prompt=["A river runs", "Old trees stand"], n=2, max_tokens=3, temperature=0.8
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text != r.choices[1].text  # different samples
    assert r.usage.prompt_tokens == len(tok.encode("A river runs")) + len(tok.encode("Old trees stand"))
    assert r.usage.completion_tokens == 12
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3)
    r2 = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3)
    assert r.usage.prompt_tokens == len(ids) and r2.choices[1].text == r.choices[0].text
    r3 = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True)
    assert r3.choices[0].text == "Children play near" + r.choices[0].text


def test_completion_stop_strings_and_stop_token_ids(client, tok):
    prompt = "People walk slowly"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, extra_body={"return_token_ids": True})
    text = base.choices[0].text
    word = text.split()[3]
    cut = text.index(word)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=[word, "zzz"])
    assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
    assert extra(r.choices[0], "stop_reason") == word
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, stop=word, extra_body={"include_stop_str_in_output": True}
    )
    assert r.choices[0].text == text[: cut + len(word)]
    # streaming holds back partial matches and ends at the same place
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=[word], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # stop token ids: generation ends at the first occurrence of the id, which is not in the text
    ids = extra(base.choices[0], "token_ids")
    stop_id = ids[4]
    first = ids.index(stop_id)
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, extra_body={"stop_token_ids": [stop_id], "return_token_ids": True}
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and extra(c, "stop_reason") == stop_id
    assert extra(c, "token_ids") == ids[: first + 1] and c.text == tok.decode(ids[:first])


def test_completion_streaming_matches_and_usage(client):
    kw = dict(model=MODEL, prompt="Night comes with", max_tokens=12, logprobs=1)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    body = chunks[:-1]
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    assert body[-1].choices[0].finish_reason == "length"
    tokens = [t for c in body for t in c.choices[0].logprobs.tokens]
    assert tokens == full.choices[0].logprobs.tokens
    offsets = [o for c in body for o in c.choices[0].logprobs.text_offset]
    assert offsets == full.choices[0].logprobs.text_offset
    # n > 1 streaming: every choice finishes exactly once
    chunks = list(
        client.completions.create(model=MODEL, prompt="Night comes", max_tokens=5, n=3, temperature=1.0, stream=True)
    )
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finished == [0, 1, 2]


def test_request_id_from_the_x_request_id_header_then_the_body(client):
    """vLLM's _base_request_id: the X-Request-Id header names the request, before the body's request_id."""
    kw = dict(model=MODEL, prompt="Hi", max_tokens=1)
    r = client.completions.create(**kw, extra_headers={"X-Request-Id": "from-header"}, extra_body={"request_id": "b"})
    assert r.id == "cmpl-from-header"
    assert client.completions.create(**kw, extra_body={"request_id": "from-body"}).id == "cmpl-from-body"
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_headers={"X-Request-Id": "h"}
    )
    assert r.id == "chatcmpl-h"


def test_continuous_usage_stats_count_each_chunk_s_prompt_and_choice(client, tok):
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries its own prompt's tokens and the tokens its
    choice has so far; only the last, choice-less chunk sums the request (it counted the whole request before)."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    prompts = ["A", "Night comes with the"]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=3, n=2, temperature=1.0, stream=True, stream_options=opts
        )
    )
    lens = [len(tok.encode(p)) for p in prompts]
    for c in chunks[:-1]:
        i = c.choices[0].index
        assert c.usage.prompt_tokens == lens[i // 2] and 1 <= c.usage.completion_tokens <= 3
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    finals = {c.choices[0].index: c.usage.completion_tokens for c in chunks[:-1] if c.choices[0].finish_reason}
    assert finals == {0: 3, 1: 3, 2: 3, 3: 3}
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == sum(lens)  # each prompt once (vLLM)
    assert chunks[-1].usage.completion_tokens == 12
    messages = [{"role": "user", "content": "Where do birds sing?"}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, n=2, temperature=1.0, stream=True, stream_options=opts
        )
    )
    n_prompt = _chat_prompt_len(tok, messages)
    body = chunks[:-1]
    assert all(c.usage.prompt_tokens == n_prompt for c in body)
    assert [c.usage.completion_tokens for c in body if c.choices[0].delta.role] == [0, 0]  # the role chunks
    finals = {c.choices[0].index: c.usage.completion_tokens for c in body if c.choices[0].finish_reason}
    assert finals == {0: 4, 1: 4} and chunks[-1].usage.completion_tokens == 8


# ------------------------------------------------------------------------------------------------ chat


def _chat_prompt_len(tok, messages):
    return len(
        tok.encode(
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )
    )


def test_chat_basic_and_context_filling(client, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    m = r.choices[0].message
    assert m.role == "assistant" and m.content and r.choices[0].finish_reason == "length"
    n_prompt = _chat_prompt_len(tok, messages)
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 6
    # max_completion_tokens wins over the deprecated max_tokens
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, max_tokens=9)
    assert r.usage.completion_tokens == 3
    # no limit: the fake model's script ends with EOS -> "stop" without a stop_reason
    r = client.chat.completions.create(model=MODEL, messages=messages)
    assert r.choices[0].finish_reason == "stop" and extra(r.choices[0], "stop_reason") is None
    # ... and with ignore_eos it fills the rest of the context (max_model_len - prompt)
    r = client.chat.completions.create(model=MODEL, messages=messages, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 256 - n_prompt


def test_chat_n_logprobs_and_content_parts(client):
    r = client.chat.completions.create(
        model=MODEL,
        n=3,
        temperature=1.0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "you"}]}],
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 5
        assert "".join(t.token for t in content) == c.message.content
        for t in content:
            assert len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode())
            assert t.top_logprobs[0].token == t.token  # the fake samples its top-ranked token
    r = client.chat.completions.create(
        model=MODEL, max_tokens=2, logprobs=True, messages=[{"role": "user", "content": "hi"}]
    )
    assert r.choices[0].logprobs.content[0].top_logprobs == []


def test_chat_streaming(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Where do birds sing?"}], max_tokens=10)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    # no include_usage: no usage chunk at all
    chunks = list(client.chat.completions.create(**kw, stream=True, n=2, temperature=0.7))
    assert all(c.usage is None and c.choices for c in chunks)
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    finishes = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
    # asked for by an alias, every chunk still names the first served name (vLLM)
    chunks = list(client.chat.completions.create(**dict(kw, model="alias"), stream=True))
    assert chunks and all(c.model == MODEL for c in chunks)


def test_chat_echo_and_continue_final_message(server, client, tok):
    messages = [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "The quick"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
    )
    assert r.choices[0].message.content.startswith("The quick")
    rendered = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert rendered.endswith("The quick") and r.usage.prompt_tokens == len(tok.encode(rendered))
    # both flags: vLLM's message
    status, body = http(
        "POST",
        server.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "continue_final_message": True},
    )
    assert status == 400 and "Cannot set both `continue_final_message` and `add_generation_prompt`" in body


def test_tokenize_detokenize_and_templates(server, tok):
    url = server.base_url
    status, body = http("POST", url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    data = json.loads(body)
    assert status == 200 and data["tokens"] == tok.encode("hello world") and data["count"] == len(data["tokens"])
    assert data["max_model_len"] == 256 and len(data["token_strs"]) == data["count"]
    status, body = http("POST", url + "/detokenize", json={"tokens": data["tokens"]})
    assert status == 200 and json.loads(body) == {"prompt": "hello world"}
    # a request's chat_template and chat_template_kwargs
    template = "{% for m in messages %}[{{ greeting }}] {{ m['content'] }}{% endfor %}"
    status, body = http(
        "POST",
        url + "/tokenize",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template": template,
            "chat_template_kwargs": {"greeting": "hey"},
        },
    )
    assert status == 200 and json.loads(body)["tokens"] == tok.encode("[hey] hi", add_special_tokens=False)
    status, body = http(
        "POST", url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% if %}"}
    )
    assert status == 400 and "Chat template error" in body


def test_generation_config_defaults_and_chat_template_flag(tok, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    engine = FakeEngine(tok, default_sampling_params={"max_tokens": 7, "temperature": 0.0})
    with ServerThread(engine, "--chat-template", str(path)) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 7  # generation_config's max_new_tokens caps the output
        assert r.usage.prompt_tokens == len(tok.encode("user: hi\nassistant:"))
        # temperature defaults to the generation_config's 0.0 -> greedy -> n > 1 is refused
        with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling, got 2"):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    # an inline template's escapes are decoded as vLLM's load_chat_template decodes them ("\n" typed in a shell is a
    # newline), characters beyond ASCII kept as they are
    inline = r"{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}é→ assistant:"
    with ServerThread(engine, "--chat-template", inline) as srv:
        status, body = http("POST", srv.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and json.loads(body)["tokens"] == tok.encode(
            "user: hi\né→ assistant:", add_special_tokens=False
        )


# ------------------------------------------------------------------------------------------------ metrics, auth, ops


def _scrape(url) -> dict:
    status, text = http("GET", url + "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _value(samples, name, **labels):
    key = (name, tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items())))
    return samples[key]


def test_cache_salt_reaches_the_engine(server, client):
    """cache_salt goes to the engine with the prompt (the engine keys prefix-cache blocks on it: test_engine)."""
    seen = server.engine.prompts_seen
    client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=2, extra_body={"cache_salt": "t1"})
    assert seen[-1]["cache_salt"] == "t1"
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_body={"cache_salt": "t2"}
    )
    assert seen[-1]["cache_salt"] == "t2"
    client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=2)
    assert "cache_salt" not in seen[-1]


def test_metrics_move(server, client):
    before = _scrape(server.base_url)
    for reason in ("stop", "length", "abort"):  # each finish reason's counter exists from the start (vLLM v1)
        assert (
            "vllm:request_success_total",
            (("engine", "0"), ("finished_reason", reason), ("model_name", MODEL)),
        ) in before
    client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=5)
    list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True
        )
    )
    after = _scrape(server.base_url)
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_sum",
        "vllm:inter_token_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
        "vllm:iteration_tokens_total_count",
    ):
        assert _value(after, name) > _value(before, name), name
    assert _value(after, "vllm:generation_tokens_total") - _value(before, "vllm:generation_tokens_total") == 9
    # the requests' max_tokens (5, 4) and their sequences' most tokens (5, 4), once a request (vLLM v1's)
    for name in ("vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens"):
        assert _value(after, name + "_count") - _value(before, name + "_count") == 2, name
        assert _value(after, name + "_sum") - _value(before, name + "_sum") == 9, name
    inference = _value(after, "vllm:request_inference_time_seconds_sum")
    parts = _value(after, "vllm:request_prefill_time_seconds_sum") + _value(
        after, "vllm:request_decode_time_seconds_sum"
    )
    assert inference == pytest.approx(parts, rel=1e-6, abs=1e-9)  # running = prefill + decode
    # nothing left for the next scrape: each one shows every step so far (the histogram lagged a scrape behind)
    again = _scrape(server.base_url)
    for name in ("vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum"):
        assert _value(again, name) == _value(after, name), name
    assert (
        _value(after, "vllm:e2e_request_latency_seconds_count")
        - _value(before, "vllm:e2e_request_latency_seconds_count")
        == 2
    )
    assert _value(after, "vllm:request_success_total", finished_reason="length") >= 2
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert _value(after, gauge) == 0.0
    assert ("vllm:num_preemptions_total", (("engine", "0"), ("model_name", MODEL))) in after


def test_old_metric_names(server, client):
    """The names dashboards of vLLM 0.4-0.10 read, computed as vLLM did (aliases of the current metrics)."""
    before = _scrape(server.base_url)
    client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=4, n=2, temperature=1.0)
    client.completions.create(model=MODEL, prompt="The quick", max_tokens=3)
    after = _scrape(server.base_url)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert _value(after, "vllm:gpu_cache_usage_perc") == _value(after, "vllm:kv_cache_usage_perc")
    assert _value(after, "vllm:num_requests_swapped") == 0 and _value(after, "vllm:cpu_cache_usage_perc") == 0
    for suffix in ("_count", "_sum", "_bucket"):  # the same observations as inter_token_latency_seconds
        labels = {"le": "0.1"} if suffix == "_bucket" else {}
        assert delta("vllm:time_per_output_token_seconds" + suffix, **labels) == delta(
            "vllm:inter_token_latency_seconds" + suffix, **labels
        )
    assert delta("vllm:time_per_output_token_seconds_count") >= 3 + 2  # the gaps after each first token
    # one observation per request, of its n
    assert delta("vllm:request_params_n_count") == 2 and delta("vllm:request_params_n_sum") == 3
    assert delta("vllm:request_params_n_bucket", le="1.0") == 1 and delta("vllm:request_params_n_bucket", le="2.0") == 2
    for name in ("vllm:avg_prompt_throughput_toks_per_s", "vllm:avg_generation_throughput_toks_per_s"):
        assert _value(after, name) >= 0


class _StallingEngine(FakeEngine):
    """Sends DELTA outputs the way the real engine does when a sequence stalls (LLMEngine._finish_stalled): choice
    0 finishes with its last tokens, then choice 1 finishes in an output that carries no new token."""

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *, priority: int = 0):
        assert sampling_params.output_kind is RequestOutputKind.DELTA and sampling_params.n == 2
        ids = self.tokenizer.encode(" quick brown fox", add_special_tokens=False)
        prompt_ids = self._prompt(prompt)[1]

        def piece(index: int, start: int, end: int, finish: str | None = None) -> CompletionOutput:
            return CompletionOutput(index, self.tokenizer.decode(ids[start:end]), ids[start:end], None, None, finish)

        steps = [
            [piece(0, 0, 1), piece(1, 0, 1)],
            [piece(0, 1, 3, "length"), piece(1, 1, 2)],
            [piece(1, 2, 2, "length")],
        ]
        for k, completions in enumerate(steps):
            await asyncio.sleep(0.01)
            finished = k == len(steps) - 1
            yield RequestOutput(request_id, None, prompt_ids, None, completions, finished, RequestMetrics(time.time()))


def test_a_choice_finished_by_an_output_without_tokens(tok):
    """A choice whose finish comes in a DELTA output with no new token (a stalled sequence) still finishes, whole
    and streamed, with the tokens it had; usage and the metrics count every choice's tokens and finish."""
    ids = tok.encode(" quick brown fox", add_special_tokens=False)
    text = tok.decode(ids[:2])
    with ServerThread(_StallingEngine(tok), "--served-model-name", MODEL) as srv:
        body = {"model": MODEL, "n": 2, "max_tokens": 3}
        status, raw = http("POST", srv.base_url + "/v1/completions", json={**body, "prompt": "The"})
        assert status == 200, raw
        whole = json.loads(raw)
        assert [(c["text"], c["finish_reason"]) for c in whole["choices"]] == [
            (tok.decode(ids[:3]), "length"),
            (text, "length"),
        ]
        assert whole["usage"]["completion_tokens"] == 5
        messages = [{"role": "user", "content": "The"}]
        status, raw = http(
            "POST", srv.base_url + "/v1/chat/completions", json={**body, "messages": messages, "stream": True}
        )
        assert status == 200, raw
        chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
        second = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == 1]
        assert "".join(c["delta"].get("content") or "" for c in second) == text
        assert second[-1] == {**second[-1], "delta": {"content": ""}, "finish_reason": "length"}
        samples = _scrape(srv.base_url)
    assert _value(samples, "vllm:request_success_total", finished_reason="length") == 4
    assert _value(samples, "vllm:request_generation_tokens_sum") == 10
    assert _value(samples, "vllm:request_params_n_sum") == 4
    # each sequence counts as a request (vLLM v1's child requests): 2 requests of n=2 are 4 everywhere, and the
    # generation-token readings are the sequences' (3 and 2 tokens each), not the requests' sums
    for name in (
        "vllm:e2e_request_latency_seconds_count",
        "vllm:time_to_first_token_seconds_count",
        "vllm:request_generation_tokens_count",
        "vllm:request_prompt_tokens_count",
    ):
        assert _value(samples, name) == 4, name
    assert _value(samples, "vllm:request_params_n_count") == 2


def test_avg_throughput_gauges_are_the_last_whole_intervals_rates():
    from jaxllm.engine.protocol import EngineStats
    from jaxllm.metrics.prometheus import IntervalThroughput

    now = [100.0]
    t = IntervalThroughput(5.0, clock=lambda: now[0])
    assert t.rates(EngineStats(prompt_tokens=10, generation_tokens=0)) == (0.0, 0.0)  # the first interval starts
    now[0] = 103.0
    assert t.rates(EngineStats(prompt_tokens=40, generation_tokens=30)) == (0.0, 0.0)  # not over yet
    now[0] = 110.0
    assert t.rates(EngineStats(prompt_tokens=110, generation_tokens=50)) == (10.0, 5.0)  # 100 and 50 tokens in 10 s
    now[0] = 112.0
    assert t.rates(EngineStats(prompt_tokens=500, generation_tokens=500)) == (10.0, 5.0)  # held until the next
    now[0] = 120.0
    assert t.rates(EngineStats(prompt_tokens=500, generation_tokens=530)) == (39.0, 48.0)
    now[0] = 130.0
    assert t.rates(EngineStats(prompt_tokens=500, generation_tokens=530)) == (0.0, 0.0)  # idle


def test_api_key(tok, monkeypatch):
    with ServerThread(FakeEngine(tok), "--api-key", "sekret") as srv:
        good = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="sekret", max_retries=0)
        bad = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="a", max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert http("GET", srv.base_url + "/v1/models") == (401, '{"error": "Unauthorized"}')
        assert http("GET", srv.base_url + "/health")[0] == 200  # only /v1/* is guarded
        assert http("GET", srv.base_url + "/metrics")[0] == 200
    assert parse_args(["m"], environ={"VLLM_API_KEY": "v"}).api_key == ["v"]
    assert parse_args(["m"], environ={"VLLM_API_KEY": "v", "JAXLLM_API_KEY": "j"}).api_key == ["j"]
    assert parse_args(["m", "--api-key", "c"], environ={"VLLM_API_KEY": "v"}).api_key == ["c"]
    # several keys (vLLM's --api-key takes a list since 0.10): any one of them opens /v1
    with ServerThread(FakeEngine(tok), "--api-key", "old", "new") as srv:
        for key, ok in (("old", True), ("new", True), ("other", False)):
            c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0)
            if ok:
                assert c.models.list().data
            else:
                with pytest.raises(openai.AuthenticationError):
                    c.models.list()


def test_prompt_tokens_details_flag_reaches_the_server_state(tok):
    from server.serving_common import STATE

    with ServerThread(FakeEngine(tok), "--enable-prompt-tokens-details") as srv:
        assert srv.app[STATE].enable_prompt_tokens_details  # (tests/test_server_engine.py: its usage field)
    with ServerThread(FakeEngine(tok)) as srv:
        assert not srv.app[STATE].enable_prompt_tokens_details


def test_root_path(tok):
    """vLLM's --root-path: routes answer under the proxy's prefix too (and at /, as Starlette's routing), the API
    key guarding /v1 under either."""
    with ServerThread(FakeEngine(tok), "--root-path", "/abc/", "--api-key", "k") as srv:
        for base in (srv.base_url, srv.base_url + "/abc"):
            c = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
            assert c.completions.create(model=MODEL, prompt="a", max_tokens=2).choices
            assert http("GET", base + "/v1/models")[0] == 401  # no key
            assert http("GET", base + "/health")[0] == 200
        assert http("GET", srv.base_url + "/abcd/v1/models")[0] == 404


def test_log_levels_tls_and_port_flags():
    """--log-level (else vLLM's VLLM_LOGGING_LEVEL, else info) sets jaxllm's logs; --uvicorn-log-level only the
    HTTP server's (it used to set both: `--uvicorn-log-level warning` hid the ready line); a certfile alone may hold
    its key (uvicorn takes one); a port out of range is refused before anything starts (an OverflowError at bind)."""
    args = parse_args(["m", "--uvicorn-log-level", "warning"], environ={})
    assert (args.log_level, args.uvicorn_log_level) == ("info", "warning")
    args = parse_args(["m"], environ={"VLLM_LOGGING_LEVEL": "DEBUG"})
    assert (args.log_level, args.uvicorn_log_level) == ("debug", "debug")
    args = parse_args(["m", "--log-level", "error"], environ={"VLLM_LOGGING_LEVEL": "DEBUG"})
    assert (args.log_level, args.uvicorn_log_level) == ("error", "error")
    assert parse_args(["m", "--ssl-certfile", "both.pem"], environ={}).ssl_keyfile is None
    for argv in (["m", "--ssl-keyfile", "k.pem"], ["m", "--port", "99999"]):
        with pytest.raises(SystemExit):
            parse_args(argv, environ={})
    with pytest.raises(SystemExit):
        parse_args(["m"], environ={"VLLM_LOGGING_LEVEL": "loud"})


def test_profile_routes(server, tok, tmp_path):
    assert http("POST", server.base_url + "/start_profile")[0] == 404  # no --profile-dir
    engine = FakeEngine(tok)
    with ServerThread(engine, "--profile-dir", str(tmp_path / "prof")) as srv:
        assert http("POST", srv.base_url + "/start_profile")[0] == 200
        assert http("POST", srv.base_url + "/stop_profile")[0] == 200
    assert engine.profile_calls == [("start", str(tmp_path / "prof")), ("stop",)]


def test_ready_and_stats_log_lines(tok, caplog):
    caplog.set_level(logging.INFO, logger="jaxllm.server")
    with ServerThread(FakeEngine(tok, step_s=0.01), "--log-stats-interval", "0.1") as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        c.completions.create(model=MODEL, prompt="a b c", max_tokens=30)
        time.sleep(0.3)
    text = caplog.text
    assert f"API server ready on http://127.0.0.1:{srv.port}" in text
    lines = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    # every line in vLLM's format; one of them (which one depends on when the first interval ends: on a loaded
    # CI host the request was still waiting at the first) shows the request running
    assert lines and all("GPU KV cache usage: " in x and "Prefix cache hit rate: " in x for x in lines)
    assert any("Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: " in x for x in lines), lines


def test_args():
    assert human_readable_int("32k") == 32000 and human_readable_int("32K") == 32768
    assert human_readable_int("1.5m") == 1_500_000 and human_readable_int("4096") == 4096
    a = parse_args(
        [
            "/m",
            "--max-model-len",
            "32k",
            "-tp",
            "2",
            "--no-enable-prefix-caching",
            "--dtype",
            "bfloat16",
            "--max-num-batched-tokens",
            "8K",
            "--served-model-name",
            "a",
            "b",
        ]
    )
    kw = engine_kwargs(a)
    assert kw["model"] == "/m" and kw["max_model_len"] == 32000 and kw["tensor_parallel_size"] == 2
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is True
    assert kw["max_num_batched_tokens"] == 8192 and kw["dtype"] == "bfloat16" and kw["seed"] == 0
    assert kw["gpu_memory_utilization"] == 0.9 and kw["max_logprobs"] == 20 and kw["block_size"] == 16
    assert "served_model_name" not in kw and a.served_model_name == ["a", "b"]
    assert kw["enable_expert_parallel"] is False
    assert engine_kwargs(parse_args(["/m", "-tp", "8", "--enable-expert-parallel"]))["enable_expert_parallel"] is True
    assert parse_args([]).model is None and parse_args(["--model", "/x"]).model == "/x"
    with pytest.raises(SystemExit):
        parse_args(["/m", "--max-model-len", "lots"])


def test_cors_like_vllm(tok):
    """vLLM's default CORS (any origin, method and header): browser clients on another origin work."""

    async def go(base):
        async with aiohttp.ClientSession() as s:
            pre = {
                "Origin": "http://ui.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            }
            async with s.options(base + "/v1/chat/completions", headers=pre) as r:
                assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
                assert "POST" in r.headers["Access-Control-Allow-Methods"]
                assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": True}
            async with s.post(
                base + "/v1/completions",
                json=body,
                headers={"Origin": "http://ui.example", "Authorization": "Bearer k"},
            ) as r:
                assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
                assert (await r.text()).endswith("data: [DONE]\n\n")
            async with s.get(base + "/v1/models", headers={"Origin": "http://ui.example"}) as r:
                assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == "*"
            async with s.get(base + "/health") as r:  # no Origin: no CORS headers
                assert "Access-Control-Allow-Origin" not in r.headers

    with ServerThread(FakeEngine(tok), "--api-key", "k") as srv:
        asyncio.run(go(srv.base_url))

    async def restricted(base):
        async with aiohttp.ClientSession() as s:
            pre = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
            async with s.options(base + "/v1/completions", headers=pre) as r:
                assert r.status == 400
            async with s.get(base + "/v1/models", headers={"Origin": "http://ui.example"}) as r:
                assert r.headers["Access-Control-Allow-Origin"] == "http://ui.example"
                assert r.headers["Access-Control-Allow-Credentials"] == "true"

    with ServerThread(FakeEngine(tok), "--allowed-origins", '["http://ui.example"]', "--allow-credentials") as srv:
        asyncio.run(restricted(srv.base_url))


def test_explicit_nulls_mean_defaults(server):
    """Clients that send every field send null for the ones they leave unset; where vLLM declares the field
    Optional with a default, null means that default (no 400)."""
    msgs = [{"role": "user", "content": "Where do birds sing?"}]
    nulls = {
        "n": None,
        "stream": None,
        "logprobs": None,
        "top_logprobs": None,
        "temperature": None,
        "stop": None,
        "seed": None,
        "stream_options": None,
        "tools": None,
        "tool_choice": None,
        "response_format": None,
    }
    status, body = http(
        "POST",
        server.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": msgs, "max_tokens": 3, **nulls},
    )
    assert status == 200, body
    r = json.loads(body)
    assert len(r["choices"]) == 1 and r["choices"][0]["logprobs"] is None and r["usage"]["completion_tokens"] == 3
    status, body = http(
        "POST",
        server.base_url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "The quick",
            "max_tokens": 3,
            "stream": None,
            "echo": None,
            "logprobs": None,
            "suffix": None,
            "best_of": None,
        },
    )
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"]
    status, body = http(
        "POST",
        server.base_url + "/v1/completions",  # vLLM's completions `n` is not Optional
        json={"model": MODEL, "prompt": "The quick", "n": None},
    )
    assert status == 400 and "n: Input should be a valid integer" in body


def test_port_in_use_fails_before_the_engine_loads(tok, monkeypatch):
    """As vLLM: the socket is bound before the model loads, so a busy port fails at once, not minutes later."""
    import socket

    import server.serve as serve

    built = []
    monkeypatch.setattr(serve, "build_engine", lambda args: built.append(args) or FakeEngine(tok))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        args = parse_args(["m", "--host", "127.0.0.1", "--port", str(port), "--disable-access-log"])
        with pytest.raises(SystemExit, match=f"Cannot listen on 127.0.0.1:{port}"):
            asyncio.run(serve.run_server(args))
    assert not built

    async def serve_once():  # a free port: the engine is built after the bind, and that socket serves
        stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
        args = parse_args(["m", "--host", "127.0.0.1", "--port", "0", "--disable-access-log"])
        task = asyncio.create_task(serve.run_server(args, stop=stop, on_ready=ready.set_result))
        bound = await asyncio.wait_for(ready, 30)
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{bound}/v1/models") as r:
            status = r.status
        stop.set()
        await task
        return status

    assert asyncio.run(serve_once()) == 200 and len(built) == 1
