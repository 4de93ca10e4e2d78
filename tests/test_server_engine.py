"""The server in front of the real engine (AsyncLLM built from serve flags) on a tiny random checkpoint.

Checks the EngineClient contract end to end: flags -> from_engine_args, prompts as token ids, streaming,
n, logprobs, validation messages, and that a client hanging up frees the engine's KV blocks.
"""

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from server.server_thread import ServerThread


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from server.serve import build_engine
    from tests.tiny_models import make_tiny_model_dir, tiny_serve_args

    model_dir, _ = make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny")))
    args = tiny_serve_args(model_dir)
    engine = build_engine(args)
    with ServerThread(engine, args=args) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield srv, engine, client


def blocks_free(engine) -> bool:
    bm = engine.engine.scheduler.block_manager
    return not engine.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_usable_blocks


def wait_until(cond, timeout=10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and not cond():
        time.sleep(0.02)
    return cond()


def test_real_engine_routes(served):
    srv, engine, client = served
    tok = engine.get_tokenizer()
    r = client.completions.create(
        model="tiny",
        prompt=[5, 9, 2, 77],
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 5
    assert len(c.logprobs.tokens) == 5 and all(len(t) <= 3 for t in c.logprobs.top_logprobs)
    again = client.completions.create(
        model="tiny",
        prompt=[5, 9, 2, 77],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert c.model_extra["token_ids"] == again.choices[0].model_extra["token_ids"]  # greedy is deterministic

    messages = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        n=2,
        temperature=1.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    assert all(len(ch.logprobs.content) == 6 for ch in r.choices)
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    # vLLM accepts prompt_logprobs=0 with stream (only > 0 or -1 is refused); nothing extra is streamed
    streamed = list(
        client.completions.create(
            model="tiny",
            prompt=[5, 9, 2],
            max_tokens=3,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True, "prompt_logprobs": 0},
        )
    )
    whole = client.completions.create(
        model="tiny", prompt=[5, 9, 2], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"

    with pytest.raises(
        openai.BadRequestError, match="maximum context length is 128 tokens. However, your request has 200 input tokens"
    ):
        client.completions.create(model="tiny", prompt=[5] * 200)
    with pytest.raises(openai.BadRequestError, match="Requested logprobs of 25, which is greater than max"):
        client.completions.create(model="tiny", prompt=[5], logprobs=25)
    with pytest.raises(openai.BadRequestError, match="Got priority 3 but Priority scheduling is not enabled"):
        client.completions.create(model="tiny", prompt=[5], max_tokens=2, extra_body={"priority": 3})
    assert wait_until(lambda: blocks_free(engine)), "KV blocks leaked"


def test_real_engine_hands_the_server_delta_outputs(served, monkeypatch):
    """The server asks the engine for DELTA outputs: over a request of L tokens per choice the outputs it receives
    carry L tokens (and logprobs) per choice, not the L (L + 1) / 2 of cumulative outputs, and joined they are the
    response, streamed or whole, with n 2, logprobs and echo."""
    srv, engine, client = served
    received: dict[str, list] = {}
    generate = engine.generate

    async def recording(prompt, params, request_id, **kw):  # runs on the server's loop
        outputs = received.setdefault(request_id, [])
        gen = generate(prompt, params, request_id, **kw)
        try:
            async for out in gen:
                outputs.append(out)
                yield out
        finally:
            await gen.aclose()

    monkeypatch.setattr(engine, "generate", recording)
    L = 20
    body = dict(
        model="tiny",
        prompt=[5, 9, 2, 77],
        max_tokens=L,
        n=2,
        seed=1,
        logprobs=2,
        echo=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    whole = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True))
    assert len(received) == 2  # the whole request's outputs, then the stream's
    echo = engine.get_tokenizer().decode([5, 9, 2, 77])
    for outputs in received.values():
        assert len(outputs) > 1 and outputs[-1].finished  # one output per step, not one at the end
        for c in whole.choices:
            mine = [o for out in outputs for o in out.outputs if o.index == c.index]
            assert sum(len(o.token_ids) for o in mine) == L  # cumulative outputs: L (L + 1) / 2 = 210
            assert sum(len(o.logprobs) for o in mine) == L
            assert sum((o.token_ids for o in mine), []) == c.model_extra["token_ids"]  # the same seed: the same
            assert echo + "".join(o.text for o in mine) == c.text
            assert [o.finish_reason for o in mine[:-1]] == [None] * (len(mine) - 1)
            assert mine[-1].finish_reason == "length"
    for c in whole.choices:
        parts = [p for ch in chunks for p in ch.choices if p.index == c.index]
        assert "".join(p.text for p in parts) == c.text
        assert sum((p.logprobs.tokens for p in parts), []) == c.logprobs.tokens
    assert whole.usage.completion_tokens == 2 * L
    assert wait_until(lambda: blocks_free(engine)), "KV blocks leaked"


def test_real_engine_disconnect_frees_blocks(served):
    srv, engine, client = served
    aborted = []
    real_abort = engine.engine.abort_request

    def abort_request(request_id):  # runs on the engine thread
        aborted.append(request_id)
        real_abort(request_id)

    engine.engine.abort_request = abort_request

    async def hang_up():
        async with aiohttp.ClientSession() as s:
            async with s.post(
                srv.base_url + "/v1/completions",
                json={"prompt": [5, 9, 2, 77], "max_tokens": 120, "ignore_eos": True, "stream": True},
            ) as r:
                assert r.status == 200
                n = 0
                async for line in r.content:
                    n += line.startswith(b"data: ")
                    if n == 3:
                        break

    try:
        asyncio.run(hang_up())
        assert wait_until(lambda: blocks_free(engine)), "KV blocks leaked after the client hung up"
        assert wait_until(lambda: bool(aborted)) and aborted[0].startswith("cmpl-")
    finally:
        engine.engine.abort_request = real_abort
    assert (
        client.completions.create(
            model="tiny", prompt=[7], max_tokens=2, extra_body={"ignore_eos": True}
        ).usage.completion_tokens
        == 2
    )


def _metrics_text(srv) -> str:
    async def scrape():
        async with aiohttp.ClientSession() as session:
            async with session.get(srv.base_url + "/metrics") as r:
                return await r.text()

    return asyncio.run(scrape())


def test_real_engine_metrics(served):
    srv, engine, client = served
    client.completions.create(model="tiny", prompt=[5, 9], max_tokens=3, extra_body={"ignore_eos": True})
    s = engine.stats()  # the EngineStats snapshot /metrics and the stats log line are built from
    assert s.prompt_tokens > 0 and s.generation_tokens > 0
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(_metrics_text(srv))}
    (info,) = families["vllm:cache_config_info"].samples
    cache = engine.engine.cache_config
    assert info.value == 1 and info.labels["num_gpu_blocks"] == str(cache.num_blocks)
    assert info.labels["block_size"] == str(cache.block_size) and info.labels["cache_dtype"] == "auto"
    assert info.labels["enable_prefix_caching"] == str(cache.enable_prefix_caching) and info.labels["engine"] == "0"
    (usage,) = families["vllm:gpu_cache_usage_perc"].samples
    assert usage.labels == {"model_name": "tiny", "engine": "0"}
    assert usage.value == families["vllm:kv_cache_usage_perc"].samples[0].value


def test_prompt_tokens_details_report_the_prefix_cache(served):
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens is the prompt tokens the prefix
    cache served (vLLM's), chat and completions, stream and not; without the flag the field is absent."""
    srv, engine, client = served
    prompt = "the engine was paged and the blocks were counted " * 4
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)  # fills the cache
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage
    assert plain.prompt_tokens_details is None and "prompt_tokens_details" not in plain.model_dump(exclude_unset=True)
    from server.serving_common import STATE

    state = srv.app[STATE]  # the flag's effect on the running server (a second server would shut the engine down)
    state.enable_prompt_tokens_details = True
    try:
        c = client
        usage = c.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage
        n = len(engine.get_tokenizer().encode(prompt))
        assert usage.prompt_tokens == n and 0 < usage.prompt_tokens_details.cached_tokens < n
        assert usage.prompt_tokens_details.cached_tokens % 8 == 0  # whole blocks (tiny_serve_args: --block-size 8)
        messages = [{"role": "user", "content": prompt}]
        c.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
        chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage
        assert chat.prompt_tokens_details.cached_tokens > 0
        stream = c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1, stream=True, stream_options={"include_usage": True}
        )
        last = [chunk for chunk in stream][-1]
        assert last.usage.prompt_tokens_details.cached_tokens == chat.prompt_tokens_details.cached_tokens
    finally:
        state.enable_prompt_tokens_details = False


def _histogram_counts(srv) -> dict[str, float]:
    """Each vllm:*_seconds / request_params_n histogram's _count (the engine's label)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(_metrics_text(srv)):
        for s in family.samples:
            if s.name.endswith("_count"):
                counts[s.name[len("vllm:") : -len("_count")].removesuffix("_seconds")] = s.value
    return counts


def test_beam_search_on_the_server_is_the_offline_one(served, tmp_path):
    """vLLM's use_beam_search (n beams, length_penalty): the server's choices are LLM.beam_search's best beams, in
    order, each its generated tokens and their text (prompt and a final EOS not included), the cumulative
    log-probability as the beam's; chat too; nothing left in the KV cache. Without the engine's beam_search (here
    a fake engine) it is a 400."""
    from jaxllm import LLM, BeamSearchParams
    from server.args import engine_kwargs

    srv, engine, client = served
    prompt = [5, 9, 2, 77, 3]
    before = _histogram_counts(srv)
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        n=3,
        max_tokens=4,
        temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True},
    )
    after = _histogram_counts(srv)  # each beam a finished request in every request histogram, as vLLM counts them
    moved = {name: after[name] - before.get(name, 0) for name in after}
    assert {moved[n] for n in ("e2e_request_latency", "request_prefill_time", "request_decode_time")} == {3}
    assert moved["request_inference_time"] == moved["request_queue_time"] == 3 and moved["request_params_n"] == 1
    llm = LLM(**engine_kwargs(srv.args))
    want = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.5, temperature=0))
    beams = want[0].sequences
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.token_ids for c in r.choices] == [b.tokens[len(prompt) :] for b in beams]
    tok = engine.get_tokenizer()
    for c, b in zip(r.choices, beams, strict=True):
        gen = b.tokens[len(prompt) :]
        assert c.text == tok.decode(gen[:-1] if b.finish_reason == "stop" else gen, skip_special_tokens=True)
        assert c.finish_reason == b.finish_reason
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        n=3,
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "the engine"}],
        n=2,
        max_tokens=3,
        extra_body={"use_beam_search": True},
    )
    assert len(chat.choices) == 2 and all(c.message.content is not None for c in chat.choices)
    assert wait_until(lambda: blocks_free(engine))
    with pytest.raises(openai.BadRequestError, match="needs 2 \\* n log-probabilities"):
        client.completions.create(model="tiny", prompt=prompt, n=11, max_tokens=2, extra_body={"use_beam_search": True})


def test_responses_api(served):
    """/v1/responses (OpenAI's Responses API, as vLLM serves it) through the openai SDK: the same tokens as the chat
    route for the same conversation (instructions as its system message), the SDK's own Response and event types
    parse every body and event, max_output_tokens ends it "incomplete", a JSON schema format constrains it, and
    what is not supported is a 400 (a 404 for previous_response_id, nothing being stored)."""
    srv, engine, client = served
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "the engine"}],
        max_completion_tokens=6,
        temperature=0,
    )
    r = client.responses.create(
        model="tiny", instructions="be brief", input="the engine", max_output_tokens=6, temperature=0
    )
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    items = [
        {"role": "system", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "the engine"}]},
    ]
    assert (
        client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0).output_text
        == r.output_text
    )
    events = list(
        client.responses.create(
            model="tiny", instructions="be brief", input="the engine", max_output_tokens=6, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"  # also when cut off (status "incomplete"), as vLLM's stream ends
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    # text.format json_schema is the chat route's response_format (this tiny tokenizer spells no JSON: translated only)
    from server.serving_responses import ResponsesRequest, to_chat_request

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": schema}}
    chat_req = to_chat_request(ResponsesRequest(input="x", text=fmt))
    assert chat_req.response_format.type == "json_schema" and chat_req.response_format.json_schema["schema"] == schema
    # a grammar this tokenizer cannot follow fails its request with a 400 (it was a 500), the engine goes on
    with pytest.raises(openai.BadRequestError, match="structured-output grammar"):
        client.responses.create(model="tiny", input="the engine", max_output_tokens=8, text=fmt)
    # max_output_tokens past the context's room is cut to it (vLLM's Responses rule), not refused as chat does
    long = client.responses.create(model="tiny", input="the engine", max_output_tokens=100000, temperature=0)
    assert long.usage.input_tokens + long.usage.output_tokens <= 128 and long.max_output_tokens == 100000
    assert long.temperature == 0.0 and r.top_p == 1.0  # the values it ran with
    own = client.responses.create(model="tiny", input="x", max_output_tokens=2, extra_body={"request_id": "abc"})
    assert own.id == "abc"  # vLLM's: the request's request_id is the response's id
    for kw, status, message, param in [
        (dict(max_output_tokens=0), 400, "max_tokens must be at least 1", "max_output_tokens"),
        (dict(include=["bogus"]), 400, "include: unknown values", "include"),
        (dict(truncation="bogus"), 400, "truncation must be", "truncation"),
        (dict(input=[{"role": "bogus", "content": "x"}]), 400, "role must be one of", "input"),
        (dict(input=[{"type": "message", "content": "x"}]), 400, "role must be one of", "input"),
        (dict(input=[{"role": "user", "content": [{"type": "input_text"}]}]), 400, "needs a string 'text'", "input"),
    ]:
        with pytest.raises(openai.APIStatusError, match=message) as e:
            client.responses.create(**{"model": "tiny", "input": "x", **kw})
        assert e.value.status_code == status and e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.NotFoundError, match="Response with id 'resp_x' not found"):
        client.responses.retrieve("resp_x")
    for kw, status, message in [
        (dict(tools=[{"type": "mcp", "server_label": "x"}]), 400, "tool type 'mcp' is not supported"),
        (dict(previous_response_id="resp_x"), 404, "not found"),
        (dict(background=True), 400, "background"),
        (dict(input=[{"type": "item_reference", "id": "x"}]), 400, "item_reference"),
    ]:
        with pytest.raises(openai.APIStatusError, match=message) as e:
            client.responses.create(**{"model": "tiny", "input": "x", **kw})
        assert e.value.status_code == status
    assert wait_until(lambda: blocks_free(engine))


def test_sleep_mode_dev_routes(tmp_path, monkeypatch):
    """vLLM's development routes (VLLM_SERVER_DEV_MODE=1) with --enable-sleep-mode: POST /sleep frees the weights
    and KV cache (requests then get a 400), /wake_up brings them back (the same greedy tokens), GET /is_sleeping
    tells which; /reset_prefix_cache empties the prefix cache."""
    from server.serve import build_engine
    from tests.test_server_api import http
    from tests.tiny_models import make_tiny_model_dir, tiny_serve_args

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    model_dir, _ = make_tiny_model_dir("llama", str(tmp_path / "tiny"))
    args = tiny_serve_args(model_dir, "--enable-sleep-mode")
    engine = build_engine(args)
    body = {"model": "tiny", "prompt": [5, 9, 2, 77, 3, 14, 15, 92, 6], "max_tokens": 4, "temperature": 0}
    with ServerThread(engine, args=args) as srv:
        url = srv.base_url
        status, first = http("POST", url + "/v1/completions", json=body)
        assert status == 200, first
        assert http("POST", url + "/sleep?level=1")[0] == 200
        assert json.loads(http("GET", url + "/is_sleeping")[1]) == {"is_sleeping": True}
        status, text = http("POST", url + "/v1/completions", json=body)
        assert status == 400 and "sleeping" in text
        status, text = http("POST", url + "/sleep?level=2")
        assert status == 400 and "level 2" in text
        assert http("POST", url + "/wake_up?tags=weights")[0] == 200
        assert json.loads(http("GET", url + "/is_sleeping")[1]) == {"is_sleeping": True}  # the KV cache is still away
        assert http("POST", url + "/wake_up")[0] == 200
        assert json.loads(http("GET", url + "/is_sleeping")[1]) == {"is_sleeping": False}
        status, again = http("POST", url + "/v1/completions", json=body)
        assert status == 200 and json.loads(again)["choices"][0]["text"] == json.loads(first)["choices"][0]["text"]
        assert http("POST", url + "/reset_prefix_cache")[0] == 200
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    with ServerThread(engine, args=args) as srv:  # without dev mode the routes are not there
        assert http("POST", srv.base_url + "/sleep")[0] == 404


def test_skip_tokenizer_init(served, tmp_path):
    """--skip-tokenizer-init (vLLM's, as RL frameworks serve): token-id prompts in, token ids out (return_token_ids;
    logprobs named token_id:N), no text; what needs the tokenizer is a 400 naming why."""
    from server.serve import build_engine
    from tests.test_server_api import http
    from tests.tiny_models import tiny_serve_args

    _, ref_engine, client = served
    prompt = [5, 9, 2, 77, 3, 14, 15, 92, 6]
    kw = dict(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    ref = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    args = tiny_serve_args(ref_engine.engine.args.model, "--skip-tokenizer-init")
    engine = build_engine(args)
    assert engine.get_tokenizer() is None
    with ServerThread(engine, args=args) as srv:
        url = srv.base_url
        status, text = http("POST", url + "/v1/completions", json={**kw, "return_token_ids": True, "echo": True})
        assert status == 200, text
        choice = json.loads(text)["choices"][0]
        assert choice["token_ids"] == ref.model_extra["token_ids"] and choice["text"] == ""
        assert choice["logprobs"]["tokens"][-5:] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert choice["logprobs"]["token_logprobs"][-5:] == pytest.approx(ref.logprobs.token_logprobs, abs=1e-5)
        beam = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "n": 2, "use_beam_search": True}
        status, text = http("POST", url + "/v1/completions", json=beam)  # it was a 500 (the tokenizer's EOS)
        assert status == 200 and [c["text"] for c in json.loads(text)["choices"]] == ["", ""], text
        for path, body, what in [
            ("/v1/completions", {"model": "tiny", "prompt": "hi"}, "send `prompt` as token ids"),
            ("/v1/completions", {**kw, "stop": ["x"]}, "stop"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "Chat requests"),
            ("/tokenize", {"prompt": "hi"}, "/tokenize and /detokenize need the tokenizer"),
            ("/detokenize", {"tokens": [5]}, "/tokenize and /detokenize need the tokenizer"),
        ]:
            status, text = http("POST", url + path, json=body)
            assert status == 400 and what in text, (path, text)
