"""Bad input over raw HTTP (aiohttp): each gets an OpenAI-shaped 4xx, and the server keeps answering."""

import asyncio
import json

import aiohttp
import pytest

from server.server_thread import ServerThread
from server.testing import FakeEngine, build_tokenizer

MODEL = "fake-model"
MAX_LEN = 64
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    engine = FakeEngine(tok, max_model_len=MAX_LEN)
    with ServerThread(engine, "--max-request-body-bytes", str(LIMIT)) as srv:
        yield srv


def post(url: str, *, data=None, json_body=None, headers=None) -> tuple[int, dict | str]:
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(url, data=data, json=json_body, headers=headers) as r:
                text = await r.text()
                try:
                    return r.status, json.loads(text)
                except ValueError:
                    return r.status, text

    return asyncio.run(go())


def assert_still_serving(server, tok):
    status, body = post(
        server.base_url + "/v1/completions", json_body={"model": MODEL, "prompt": "The quick brown", "max_tokens": 3}
    )
    assert status == 200, body
    assert body["usage"] == {
        "prompt_tokens": len(tok.encode("The quick brown")),
        "completion_tokens": 3,
        "total_tokens": len(tok.encode("The quick brown")) + 3,
    }
    assert body["choices"][0]["finish_reason"] == "length"
    assert server.call(server.engine.live_requests) == [] and server.engine.used_blocks == 0


def _long_prompt(tok, n_tokens):
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 20)
    return ids[:n_tokens]


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]

# (name, path, kwargs for post(), status, substring of error.message)
CASES = [
    (
        "malformed json",
        COMPLETIONS,
        {"data": b'{"model": "fake-model", "prompt": ', "headers": {"Content-Type": "application/json"}},
        400,
        "Invalid JSON",
    ),
    ("not an object", COMPLETIONS, {"json_body": ["prompt"]}, 400, "must be a JSON object"),
    (
        "nested too deeply",
        COMPLETIONS,
        {
            "data": b'{"prompt": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            "headers": {"Content-Type": "application/json"},
        },
        400,
        "nested too deeply",
    ),
    (
        "NaN logit bias",
        COMPLETIONS,
        {"data": b'{"prompt": "a", "logit_bias": {"5": NaN}}', "headers": {"Content-Type": "application/json"}},
        400,
        "NaN is not a JSON number",
    ),
    (
        "Infinity penalty",
        CHAT,
        {
            "data": b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": -Infinity}',
            "headers": {"Content-Type": "application/json"},
        },
        400,
        "-Infinity is not a JSON number",
    ),
    ("empty body", CHAT, {"data": b"", "headers": {"Content-Type": "application/json"}}, 400, "body is empty"),
    (
        "binary body",
        CHAT,
        {"data": b"\xff\xfe\x00", "headers": {"Content-Type": "application/json"}},
        400,
        "Invalid JSON",
    ),
    (
        "wrong content type",
        COMPLETIONS,
        {"data": b'{"prompt": "a"}', "headers": {"Content-Type": "text/plain"}},
        400,
        "Unsupported Content-Type 'text/plain'",
    ),
    ("form content type", CHAT, {"data": {"messages": "x"}}, 400, "application/x-www-form-urlencoded"),
    ("missing prompt", COMPLETIONS, {"json_body": {"model": MODEL}}, 400, "prompt: Field required"),
    ("missing messages", CHAT, {"json_body": {"model": MODEL}}, 400, "messages: Field required"),
    ("prompt wrong type", COMPLETIONS, {"json_body": {"prompt": 5}}, 400, "prompt"),
    ("token ids as strings", COMPLETIONS, {"json_body": {"prompt": [["1", "2"]]}}, 400, "prompt"),
    ("messages wrong type", CHAT, {"json_body": {"messages": "hi"}}, 400, "messages: Input should be a valid list"),
    ("message without role", CHAT, {"json_body": {"messages": [{"content": "x"}]}}, 400, "messages.0.role"),
    (
        "temperature string",
        CHAT,
        {"json_body": {"messages": USER, "temperature": "hot"}},
        400,
        "temperature: Input should be a valid number",
    ),
    ("max_tokens float", COMPLETIONS, {"json_body": {"prompt": "a", "max_tokens": 2.5}}, 400, "max_tokens"),
    ("n string", COMPLETIONS, {"json_body": {"prompt": "a", "n": "many"}}, 400, "n: Input should be a valid"),
    ("stream not bool", CHAT, {"json_body": {"messages": USER, "stream": "perhaps"}}, 400, "stream"),
    (
        "negative temperature",
        CHAT,
        {"json_body": {"messages": USER, "temperature": -0.5}},
        400,
        "temperature must be non-negative, got -0.5.",
    ),
    ("top_p zero", COMPLETIONS, {"json_body": {"prompt": "a", "top_p": 0}}, 400, "top_p must be in (0, 1], got 0"),
    (
        "top_k -5",
        COMPLETIONS,
        {"json_body": {"prompt": "a", "top_k": -5}},
        400,
        "top_k must be 0 (disable), or at least 1, got -5.",
    ),
    ("min_p 2", CHAT, {"json_body": {"messages": USER, "min_p": 2}}, 400, "min_p must be in [0, 1], got 2"),
    (
        "presence_penalty 3",
        CHAT,
        {"json_body": {"messages": USER, "presence_penalty": 3}},
        400,
        "presence_penalty must be in [-2, 2], got 3",
    ),
    (
        "repetition_penalty 0",
        CHAT,
        {"json_body": {"messages": USER, "repetition_penalty": 0}},
        400,
        "repetition_penalty must be greater than zero, got 0",
    ),
    (
        "max_tokens 0",
        CHAT,
        {"json_body": {"messages": USER, "max_tokens": 0}},
        400,
        "max_tokens must be at least 1, got 0.",
    ),
    (
        "min_tokens > max_tokens",
        COMPLETIONS,
        {"json_body": {"prompt": "a", "max_tokens": 3, "min_tokens": 5}},
        400,
        "min_tokens must be less than or equal to max_tokens=3, got 5.",
    ),
    (
        "empty stop",
        COMPLETIONS,
        {"json_body": {"prompt": "a", "stop": [""]}},
        400,
        "stop cannot contain an empty string.",
    ),
    (
        "greedy n=2",
        CHAT,
        {"json_body": {"messages": USER, "temperature": 0, "n": 2}},
        400,
        "n must be 1 when using greedy sampling, got 2.",
    ),
    ("n=0", COMPLETIONS, {"json_body": {"prompt": "a", "n": 0}}, 400, "n must be at least 1, got 0."),
    ("seed past int64", COMPLETIONS, {"json_body": {"prompt": "a", "seed": 2**63}}, 400, "seed"),
    (
        "truncate past max_model_len",
        COMPLETIONS,
        {"json_body": {"prompt": "a", "truncate_prompt_tokens": MAX_LEN + 1}},
        400,
        f"truncate_prompt_tokens value ({MAX_LEN + 1}) is greater than max_model_len ({MAX_LEN}). Please, select a "
        "smaller truncation size.",
    ),
    (
        "prompt_logprobs with stream",
        COMPLETIONS,
        {"json_body": {"prompt": "a", "prompt_logprobs": 1, "stream": True}},
        400,
        "`prompt_logprobs` are not available when `stream=True`.",
    ),
    (
        "logprobs > max",
        COMPLETIONS,
        {"json_body": {"prompt": "a", "logprobs": 21}},
        400,
        "Requested logprobs of 21, which is greater than max allowed: 20.",
    ),
    (
        "top_logprobs without logprobs",
        CHAT,
        {"json_body": {"messages": USER, "top_logprobs": 2}},
        400,
        "`logprobs` must be set to true",
    ),
    (
        "stop_token_ids out of vocab",
        COMPLETIONS,
        {"json_body": {"prompt": "a", "stop_token_ids": [10**6]}},
        400,
        "out-of-vocab",
    ),
    (
        "prompt token out of vocab",
        COMPLETIONS,
        {"json_body": {"prompt": [1, 10**6]}},
        400,
        "Token id 1000000 is out of vocabulary",
    ),
    (
        "empty prompt",
        COMPLETIONS,
        {"json_body": {"prompt": "", "add_special_tokens": False}},
        400,
        "prompt cannot be empty",
    ),
    ("logit_bias bad key", COMPLETIONS, {"json_body": {"prompt": "a", "logit_bias": {"x": 1}}}, 400, "logit_bias"),
    (
        "unknown model",
        COMPLETIONS,
        {"json_body": {"model": "gpt-9", "prompt": "a"}},
        404,
        "The model `gpt-9` does not exist.",
    ),
    (
        "unknown model (chat)",
        CHAT,
        {"json_body": {"model": "gpt-9", "messages": USER}},
        404,
        "The model `gpt-9` does not exist.",
    ),
    (
        "tools without auto tool choice",
        CHAT,
        {"json_body": {"messages": USER, "tools": TOOLS}},
        400,
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
    ),
    (
        "tool_choice without tools",
        CHAT,
        {"json_body": {"messages": USER, "tool_choice": "required"}},
        400,
        "When using `tool_choice`, `tools` must be set.",
    ),
    (
        "tool_choice bad string",
        CHAT,
        {"json_body": {"messages": USER, "tools": TOOLS, "tool_choice": "any"}},
        400,
        'Invalid value for `tool_choice`: any! Only named tools, "none", "auto" or "required" are supported.',
    ),
    (
        "tool_choice without function",
        CHAT,
        {"json_body": {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function"}}},
        400,
        "Invalid value for `function`: `None` in `tool_choice`!",
    ),
    (
        "tool_choice without name",
        CHAT,
        {"json_body": {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}},
        400,
        "Expected field `name` in `function` in `tool_choice`!",
    ),
    (
        "tool_choice unknown tool",
        CHAT,
        {
            "json_body": {
                "messages": USER,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            }
        },
        400,
        "The tool specified in `tool_choice` does not match any of the specified `tools`",
    ),
    (
        "tool without a name",
        CHAT,
        {"json_body": {"messages": USER, "tools": [{"type": "function", "function": {}}], "tool_choice": "none"}},
        400,
        "tools.0.function.name: Field required",
    ),
    (
        "history arguments not JSON",
        CHAT,
        {
            "json_body": {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
                + USER
            }
        },
        400,
        "messages[0].tool_calls: arguments are not valid JSON",
    ),
    (
        "json_schema without its schema",
        CHAT,
        {"json_body": {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}},
        400,
        "needs json_schema.schema",
    ),
    (
        "response_format type",
        CHAT,
        {"json_body": {"messages": USER, "response_format": {"type": "xml"}}},
        400,
        "response_format type 'xml' is not supported",
    ),
    (
        "two structured constraints",
        COMPLETIONS,
        {"json_body": {"prompt": "a", "structured_outputs": {"choice": ["a"], "regex": "a+"}}},
        400,
        "You can only use one kind of structured outputs constraint",
    ),
    (
        "structured_outputs unknown field",
        CHAT,
        {"json_body": {"messages": USER, "structured_outputs": {"choise": ["a"]}}},
        400,
        "structured_outputs has unknown fields ['choise']",
    ),
    (
        "guided_choice empty",
        COMPLETIONS,
        {"json_body": {"prompt": "a", "guided_choice": []}},
        400,
        "structured_outputs.choice must be a non-empty list of strings",
    ),
    (
        "structural_tag",
        CHAT,
        {"json_body": {"messages": USER, "structured_outputs": {"structural_tag": "{}"}}},
        400,
        "structured_outputs.structural_tag needs 'triggers'",
    ),
    (
        "image part",
        CHAT,
        {
            "json_body": {
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
            }
        },
        400,
        "Content part type 'image_url'",
    ),
    ("beam search", COMPLETIONS, {"json_body": {"prompt": "a", "use_beam_search": True}}, 400, "Beam search"),
    ("best_of", COMPLETIONS, {"json_body": {"prompt": "a", "best_of": 3}}, 400, "best_of is not supported"),
    ("suffix", COMPLETIONS, {"json_body": {"prompt": "a", "suffix": "b"}}, 400, "suffix is not currently supported"),
    (
        "empty cache_salt",
        COMPLETIONS,
        {"json_body": {"prompt": "a", "cache_salt": ""}},
        400,
        "Parameter 'cache_salt' must be a non-empty string if provided.",
    ),
    (
        "stream_options without stream",
        CHAT,
        {"json_body": {"messages": USER, "stream_options": {}}},
        400,
        "Stream options can only be defined when `stream=True`.",
    ),
    (
        "engine rejects",
        COMPLETIONS,
        {"json_body": {"prompt": "ENGINE_REJECTS this", "stream": True}},
        400,
        "fake engine rejected this prompt",
    ),
    ("unknown route", "/v1/audio/transcriptions", {"json_body": {"input": "a"}}, 404, "Not Found"),
]


@pytest.mark.parametrize("name,path,kwargs,status,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, tok, name, path, kwargs, status, message):
    got_status, body = post(server.base_url + path, **kwargs)
    assert got_status == status, body
    err = body["error"]
    assert message in err["message"], err
    assert err["code"] == status and isinstance(err["type"], str) and "param" in err
    assert_still_serving(server, tok)


def test_prompt_longer_than_context(server, tok):
    ids = _long_prompt(tok, MAX_LEN + 6)
    status, body = post(server.base_url + COMPLETIONS, json_body={"model": MODEL, "prompt": ids})
    assert status == 400 and body["error"]["message"] == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, your request has {MAX_LEN + 6} input "
        "tokens. Please reduce the length of the input messages."
    )
    ids = _long_prompt(tok, MAX_LEN - 10)
    status, body = post(server.base_url + COMPLETIONS, json_body={"model": MODEL, "prompt": ids, "max_tokens": 20})
    assert status == 400 and body["error"]["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 20. This model's maximum context length is "
        f"{MAX_LEN} tokens and your request has {MAX_LEN - 10} input tokens (20 > {MAX_LEN} - {MAX_LEN - 10})."
    )
    # the same through chat, where the prompt is the rendered template
    text = tok.decode(_long_prompt(tok, MAX_LEN))
    status, body = post(server.base_url + CHAT, json_body={"messages": [{"role": "user", "content": text}]})
    assert (
        status == 400
        and "This model's maximum context length is 64 tokens. However, your request has" in body["error"]["message"]
    )
    # truncate_prompt_tokens keeps the last k tokens instead
    status, body = post(
        server.base_url + COMPLETIONS,
        json_body={"prompt": _long_prompt(tok, MAX_LEN + 6), "truncate_prompt_tokens": 20, "max_tokens": 2},
    )
    assert status == 200 and body["usage"]["prompt_tokens"] == 20
    assert_still_serving(server, tok)


def test_oversized_body(server, tok):
    big = json.dumps({"model": MODEL, "prompt": "a " * LIMIT}).encode()
    status, body = post(server.base_url + COMPLETIONS, data=big, headers={"Content-Type": "application/json"})
    assert status == 413 and "exceeds the limit of 1048576 bytes" in body["error"]["message"]

    async def chunks():  # no Content-Length: refused while reading
        for _ in range(24):
            yield b"a" * 100_000

    status, body = post(server.base_url + COMPLETIONS, data=chunks(), headers={"Content-Type": "application/json"})
    assert status == 413 and body["error"]["type"] == "RequestTooLargeError"
    assert_still_serving(server, tok)


def test_unknown_fields_are_accepted_and_logged(server, tok, caplog):
    status, body = post(
        server.base_url + CHAT,
        json_body={"messages": USER, "max_tokens": 2, "frobnicate": 1, "metadata": {"a": "b"}, "tool_choice": "none"},
    )
    assert status == 200, body
    assert "ignoring unknown request fields ['frobnicate', 'metadata']" in caplog.text
    assert_still_serving(server, tok)


def test_generic_content_type_is_read_as_json(server, tok):
    # aiohttp labels raw bytes application/octet-stream, as many HTTP tools do when none is given
    status, body = post(server.base_url + COMPLETIONS, data=b'{"prompt": "a", "max_tokens": 1}')
    assert status == 200, body


def test_request_id_in_use_leaves_the_running_request_alone(tok):
    """A request that reuses the request_id of one still running gets a 400, and the running one is neither
    aborted nor left waiting: it finishes with all its tokens (the rejected request used to abort it by id)."""
    engine = FakeEngine(tok, max_model_len=MAX_LEN, step_s=0.02)
    body = {"model": MODEL, "prompt": "The quick brown", "max_tokens": 30, "ignore_eos": True, "request_id": "dup"}

    async def go(url):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            async with s.post(url, json={**body, "stream": True}) as first:
                assert first.status == 200
                await first.content.readline()  # the first event: the request is running
                async with s.post(url, json=body) as second:
                    dup = (second.status, await second.json())
                text = (await first.read()).decode()
        return dup, [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]

    with ServerThread(engine) as srv:
        (status, err), events = asyncio.run(go(srv.base_url + COMPLETIONS))
        assert status == 400 and "already running" in err["error"]["message"], err
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert engine.aborted == [] and srv.call(engine.live_requests) == []
