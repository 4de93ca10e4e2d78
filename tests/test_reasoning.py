"""Reasoning parsers (--reasoning-parser, vLLM 0.11's): the split of fixed outputs whole and streamed in any pieces,
the prompt rule (enable_thinking false), start-up checks, then through the server on a scripted fake engine
(message and delta fields, tool calls after the reasoning) and on a tiny real model (a structured-output grammar
applies only after the reasoning)."""

import json

import openai
import pytest

from jaxllm.reasoning import REASONING_PARSERS, reasoning_parser
from server.reasoning import ReasoningChoice, ReasoningStream

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

# (parser, chat_template_kwargs, output, whole (reasoning, content), streamed (reasoning, content))
CASES = [
    ("deepseek_r1", None, "<think>I think.</think>The answer.", ("I think.", "The answer."), None),
    ("deepseek_r1", None, "I think.</think>The answer.", ("I think.", "The answer."), None),  # <think> in prompt
    ("deepseek_r1", None, "Still thinking <", ("Still thinking <", None), ("Still thinking <", "")),
    ("deepseek_r1", None, "</think>Answer", ("", "Answer"), None),
    ("deepseek_r1", None, "<think>r</think>", ("r", None), ("r", "")),
    ("kimi_k2", None, "r</think>c", ("r", "c"), None),
    ("qwen3", None, "<think>I think.</think>The answer.", ("I think.", "The answer."), None),
    ("qwen3", None, "The answer.", (None, "The answer."), ("", "The answer.")),
    (
        "qwen3",
        None,
        "I think.</think>The answer.",
        (None, "I think.</think>The answer."),
        ("", "I think.</think>The answer."),
    ),
    # cut off while thinking: the whole response is content, the stream sent reasoning (vLLM 0.11 alike)
    ("qwen3", None, "<think>cut off", (None, "<think>cut off"), ("cut off", "")),
    (
        "qwen3",
        None,
        "a < b and <thinking> is no tag",
        (None, "a < b and <thinking> is no tag"),
        ("", "a < b and <thinking> is no tag"),
    ),
    ("glm45", None, "<think>r</think>c", ("r", "c"), None),
    ("seed_oss", None, "<seed:think>r</seed:think>c", ("r", "c"), None),
    ("seed_oss", None, "r</seed:think>c", ("r", "c"), ("", "r</seed:think>c")),
    ("minimax_m2", None, "<think>r</think>c", ("r", "c"), None),
    ("deepseek_v3", {"thinking": True}, "r</think>c", ("r", "c"), None),
    ("deepseek_v3", None, "r</think>c", (None, "r</think>c"), ("", "r</think>c")),
    ("minimax_m2_append_think", None, "r</think>c", (None, "<think>r</think>c"), ("", "<think>r</think>c")),
]


class _Req:
    def __init__(self, kwargs=None, include=True):
        self.chat_template_kwargs, self.include_reasoning = kwargs, include


def streamed(choice: ReasoningChoice, text: str, step: int) -> tuple[str, str]:
    """Feeds text in pieces of `step` characters; (the reasoning deltas joined, the final content)."""
    stream, reasoning, content = ReasoningStream(choice), "", ""
    cuts = list(range(step, len(text), step)) + [len(text)]
    for k, cut in enumerate(cuts):
        new, so_far = stream.step(text[:cut], final=k == len(cuts) - 1)
        assert so_far.startswith(content)  # content only grows
        reasoning, content = reasoning + new, so_far
    return reasoning, content


@pytest.mark.parametrize("name,kwargs,text,whole,stream", CASES)
def test_split_whole_and_streamed(name, kwargs, text, whole, stream):
    choice = ReasoningChoice(REASONING_PARSERS[name].split(kwargs))
    assert choice.message(text) == whole
    expected = stream or (whole[0] or "", whole[1] or "")
    for step in (1, 2, 3, 7, len(text)):
        assert streamed(choice, text, step) == expected, step


def test_stream_holds_back_a_tag_split_over_pieces():
    choice = ReasoningChoice(REASONING_PARSERS["qwen3"].split())
    stream, seen = ReasoningStream(choice), []
    text = "<think>ab</think>cd"
    for cut in range(1, len(text) + 1):
        seen.append(stream.step(text[:cut], final=cut == len(text)))
    assert "".join(r for r, _ in seen) == "ab"
    assert all("<" not in r and "<" not in c for r, c in seen)  # no piece of a tag goes out
    assert [c for _, c in seen][text.index("</think>") + 4] == ""  # "</thi": still reasoning, nothing as content


def test_prompt_closed_and_include_reasoning():
    r1 = REASONING_PARSERS["deepseek_r1"]
    assert ReasoningChoice(r1.split(closed=True)).message("x</think>y") == (None, "x</think>y")
    assert streamed(ReasoningChoice(r1.split(closed=True)), "x</think>y", 1) == ("", "x</think>y")
    hidden = ReasoningChoice(r1.split(), include=False)
    assert hidden.message("x</think>y") == (None, "y") and streamed(hidden, "x</think>y", 2) == ("", "y")


@pytest.fixture(scope="module")
def tok():
    from server.testing import build_tokenizer

    t = build_tokenizer()
    t.add_tokens(["<think>", "</think>"])  # not special, as in Qwen3's and DeepSeek-R1's vocabularies
    t.chat_template = QWEN3_TEMPLATE
    return t


def test_prompt_closes_reasoning(tok):
    p = REASONING_PARSERS["qwen3"]
    msgs = [{"role": "user", "content": "hi"}]

    def ids(conversation=msgs, **kw):
        return tok.encode(tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kw))

    assert p.prompt_closes_reasoning(tok, ids(enable_thinking=False))
    assert not p.prompt_closes_reasoning(tok, ids())
    history = msgs + [{"role": "assistant", "content": "<think>\nr\n</think>\n\nok"}, {"role": "user", "content": "b"}]
    assert not p.prompt_closes_reasoning(tok, ids(history))
    assert not p.prompt_closes_reasoning(tok, tok.encode("<|im_start|>assistant\n<think>\n"))


def test_unknown_or_unfit_parsers_are_refused(tok, capsys):
    from server.args import parse_args
    from server.testing import build_tokenizer

    for name, what in (
        ("nope", "invalid choice: 'nope' (choose from 'deepseek_r1', 'kimi_k2', 'qwen3'"),
        ("granite", "'granite' is one of vLLM's reasoning parsers that jaxllm does not implement"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_args(["m", "--reasoning-parser", name])
        assert e.value.code == 2 and what in capsys.readouterr().err
    assert parse_args(["m", "--enable-reasoning", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match=r"invalid reasoning parser: nope \(chose from \{ deepseek_r1,kimi_k2"):
        reasoning_parser("nope", tok)
    with pytest.raises(ValueError, match="the tokenizer has no <think> or </think> token"):
        reasoning_parser("qwen3", build_tokenizer())
    from jaxllm.engine.args import EngineArgs

    with pytest.raises(ValueError, match="invalid reasoning parser"):
        EngineArgs.from_kwargs(model="m", reasoning_parser="nope").validate()
    args = EngineArgs.from_kwargs(model="m", reasoning_parser="qwen3", enable_reasoning=True)
    assert args.reasoning_parser == "qwen3"


# ------------------------------------------------------------------------------------ through the server


def _scripted_engine(tok):
    from server.testing import FakeEngine

    class Scripted(FakeEngine):
        """Writes self.text (then EOS) from its start, whatever the prompt."""

        def say(self, text: str) -> None:
            self.script = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_token_id]

        def _offset(self, ids, j, seed):
            return 0

    return Scripted(tok, max_model_len=512)


@pytest.fixture(scope="module")
def servers(tok):
    from server.server_thread import ServerThread

    r1, qwen3 = _scripted_engine(tok), _scripted_engine(tok)
    with (
        ServerThread(
            r1,
            "--reasoning-parser",
            "deepseek_r1",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--enable-reasoning",
        ) as a,
        ServerThread(qwen3, "--reasoning-parser", "qwen3") as b,
    ):
        yield {"deepseek_r1": (a, r1), "qwen3": (b, qwen3)}


def _chat(srv, stream=False, **body):
    """The whole response's first choice as JSON, or a stream's deltas (as JSON dicts) and finish_reason."""
    from tests.test_server_api import http

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, **body}
    status, text = http("POST", srv.base_url + "/v1/chat/completions", json={**body, "stream": stream})
    assert status == 200, text
    if not stream:
        return json.loads(text)["choices"][0]
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    return deltas, [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]


def _joined(deltas, key):
    return "".join(d.get(key) or "" for d in deltas)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_server_splits_reasoning_whole_and_streamed(servers, name):
    srv, engine = servers[name]
    engine.say("<think>Sky is blue.</think>Blue.")
    choice = _chat(srv)
    assert choice["message"] == {
        "role": "assistant",
        "content": "Blue.",
        "tool_calls": [],
        "reasoning": "Sky is blue.",
        "reasoning_content": "Sky is blue.",
    }
    deltas, finish = _chat(srv, stream=True)
    assert finish == "stop" and deltas[0] == {"role": "assistant", "content": "", "reasoning_content": None}
    assert _joined(deltas, "reasoning") == _joined(deltas, "reasoning_content") == "Sky is blue."
    assert _joined(deltas, "content") == "Blue."
    assert all("reasoning_content" in d for d in deltas)  # vLLM 0.11.2 sends it (null) in every delta
    last_reasoning = max(i for i, d in enumerate(deltas) if d.get("reasoning"))
    assert not any(d.get("content") for d in deltas[:last_reasoning]) or name == "qwen3"
    # without the start tag (the template put it in the prompt): deepseek_r1 still reads reasoning, qwen3 content
    engine.say("Sky is blue.</think>Blue.")
    message = _chat(srv)["message"]
    deltas, _ = _chat(srv, stream=True)
    if name == "deepseek_r1":
        assert (message["reasoning"], message["content"]) == ("Sky is blue.", "Blue.")
    else:
        assert (message["reasoning"], message["content"]) == (None, "Sky is blue.</think>Blue.")
    assert (_joined(deltas, "reasoning") or None, _joined(deltas, "content")) == (
        message["reasoning"],
        message["content"],
    )
    message = _chat(srv, include_reasoning=False)["message"]
    assert message["reasoning"] is None and message["content"] in ("Blue.", "Sky is blue.</think>Blue.")


def test_responses_api_puts_reasoning_in_its_own_item(servers):
    """/v1/responses with --reasoning-parser: a reasoning item (reasoning_text) before the message, whole and
    streamed (the SDK's event types parse every event)."""
    srv, engine = servers["deepseek_r1"]
    engine.say("<think>Sky is blue.</think>Blue.")
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    r = client.responses.create(model="fake-model", input="hi", max_output_tokens=300)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Sky is blue." and r.output_text == "Blue."
    events = list(client.responses.create(model="fake-model", input="hi", max_output_tokens=300, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("Sky is blue.", "Blue.")
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"] and events[-1].type == "response.completed"
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


def test_responses_api_function_calls(servers):
    """/v1/responses with function tools (flat, as the Responses API writes them) and a hermes parser: the model's
    call is a function_call item after the reasoning item, whole and streamed (argument deltas, then done events),
    the Response echoes the tools; the next turn sends the output items back with a function_call_output, which
    the template sees as the assistant's call and a tool message."""
    srv, engine = servers["deepseek_r1"]
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    engine.say(f"<think>I need the weather.</think>{call}")
    r = client.responses.create(model="fake-model", input="Weather in Paris?", tools=tools, max_output_tokens=300)
    assert [item.type for item in r.output] == ["reasoning", "function_call"] and r.status == "completed"
    fc = r.output[1]
    assert (fc.name, fc.arguments, fc.status) == ("get_weather", '{"city": "Paris"}', "completed")
    assert fc.call_id.startswith("chatcmpl-tool-") and fc.id.startswith("fc_") and r.output_text == ""
    assert [t.name for t in r.tools] == ["get_weather"] and r.tool_choice == "auto"
    events = list(
        client.responses.create(
            model="fake-model", input="Weather in Paris?", tools=tools, max_output_tokens=300, stream=True
        )
    )
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == '{"city": "Paris"}'
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output[1].arguments == args
    assert final.output[1].status == "completed" and final.output[1].id == done.item_id
    # the next turn: the output items and the call's result go back as input
    engine.say("<think>Got it.</think>Sunny.")
    history = [{"role": "user", "content": "Weather in Paris?"}] + [item.model_dump() for item in r.output]
    history.append({"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 21 C"})
    r2 = client.responses.create(model="fake-model", input=history, tools=tools, max_output_tokens=300)
    assert [item.type for item in r2.output] == ["reasoning", "message"] and r2.output_text == "Sunny."
    prompt = engine.prompts_seen[-1]
    text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt["prompt_token_ids"])
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text
    # a named choice constrains nothing here (the script is what it is) but is echoed and parsed as a call
    engine.say('<think>Rome.</think>{"city": "Rome"}')
    named = {"type": "function", "name": "get_weather"}
    r3 = client.responses.create(model="fake-model", input="x", tools=tools, tool_choice=named, max_output_tokens=50)
    assert [i.type for i in r3.output] == ["reasoning", "function_call"]
    assert (r3.output[1].name, r3.output[1].arguments) == ("get_weather", '{"city": "Rome"}')
    assert r3.tool_choice.name == "get_weather"
    # cut off by max_output_tokens inside the call: the response and its last item are incomplete, whole and streamed
    engine.say(f"<think>x</think>{call}")
    cut = client.responses.create(model="fake-model", input="x", tools=tools, max_output_tokens=12)
    events = list(
        client.responses.create(model="fake-model", input="x", tools=tools, max_output_tokens=12, stream=True)
    )
    done_items = [e.item for e in events if e.type == "response.output_item.done"]
    for out in (cut.output, events[-1].response.output, done_items):
        assert [i.status for i in out if i.type != "reasoning"][-1:] == ["incomplete"]
    assert cut.status == events[-1].response.status == "incomplete"
    # "auto" without tools is OpenAI's default: plain text
    engine.say("<think>x</think>Hi.")
    assert client.responses.create(model="fake-model", input="x", tool_choice="auto").output_text == "Hi."
    for kw, message in [
        (dict(tools=[{"type": "web_search_preview"}]), "tool type 'web_search_preview' is not supported"),
        (dict(input=[{"type": "reasoning", "summary": [{"type": "summary_text", "text": None}]}]), "string 'text'"),
        (dict(input=[{"type": "function_call_output", "call_id": "c"}]), r"input\[0\]\.output must be"),
        (dict(tools=tools, tool_choice={"type": "file_search"}), "is not supported"),
        (dict(tools=tools, tool_choice={"type": "function", "name": "nope"}), "does not match any"),
        (dict(input=[{"type": "function_call", "call_id": "c", "name": "f"}]), "needs a string 'arguments'"),
        (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]), "not valid JSON"),
        (dict(input=[{"type": "item_reference", "id": "x"}]), "item type 'item_reference' is not supported"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.responses.create(**{"model": "fake-model", "input": "x", "max_output_tokens": 5, **kw})
        assert e.value.body["param"] in ("tools", "tool_choice", "input"), e.value.body


def test_responses_input_items_join_as_vllm_joins_them():
    from server.serving_responses import input_messages

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "42"}]}
    reasoning = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]}
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert input_messages([{"role": "user", "content": "q"}, reasoning, said, call, call | {"call_id": "c2"}, out]) == [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "ok",
            "reasoning_content": "think",
            "tool_calls": [tool_call, tool_call | {"id": "c2"}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert input_messages([call]) == [{"role": "assistant", "content": None, "tool_calls": [tool_call]}]


def test_enable_thinking_false_is_all_content(servers):
    for name in ("deepseek_r1", "qwen3"):
        srv, engine = servers[name]
        engine.say("Plain answer.</think>still content")
        message = _chat(srv, chat_template_kwargs={"enable_thinking": False})["message"]
        assert (message["reasoning"], message["content"]) == (None, "Plain answer.</think>still content")
        deltas, _ = _chat(srv, stream=True, chat_template_kwargs={"enable_thinking": False})
        assert _joined(deltas, "reasoning") == "" and _joined(deltas, "content") == message["content"]


def test_tool_calls_come_from_the_content_only(servers):
    srv, engine = servers["deepseek_r1"]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    engine.say(f"<think>Should I {call}? No.</think>Sunny.")
    choice = _chat(srv, tools=tools)
    assert choice["message"]["tool_calls"] == [] and choice["message"]["content"] == "Sunny."
    assert choice["message"]["reasoning"] == f"Should I {call}? No." and choice["finish_reason"] == "stop"
    engine.say(f"<think>I need the weather.</think>{call}")
    choice = _chat(srv, tools=tools)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] == "I need the weather."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    assert choice["message"]["content"] is None
    deltas, finish = _chat(srv, stream=True, tools=tools)
    assert finish == "tool_calls" and _joined(deltas, "reasoning") == "I need the weather."
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or []] == ["get_weather"]
    assert _joined(deltas, "content") == ""


def test_server_refuses_a_vocabulary_without_the_tags():
    from server.server_thread import ServerThread
    from server.testing import FakeEngine, build_tokenizer

    with pytest.raises(ValueError, match="--reasoning-parser deepseek_r1: the tokenizer has no <think>"):
        with ServerThread(FakeEngine(build_tokenizer()), "--reasoning-parser", "deepseek_r1"):
            pass


# ------------------------------------------------------------------- structured outputs on a tiny real model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama whose vocabulary has <think> and </think>, served with --reasoning-parser deepseek_r1."""
    from transformers import AutoTokenizer

    from server.args import parse_args
    from server.serve import build_engine
    from server.server_thread import ServerThread
    from tests.tiny_models import make_tiny_model_dir, save_tiny_tokenizer

    model_dir, model = make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny_think")))
    save_tiny_tokenizer(model_dir, model.config.vocab_size - 2, json_text=True)
    t = AutoTokenizer.from_pretrained(model_dir)
    t.add_tokens(["<think>", "</think>"])
    t.chat_template = QWEN3_TEMPLATE.replace("<|im_start|>", "<s>").replace("<|im_end|>", "</s>")
    t.save_pretrained(model_dir)
    assert len(t) == model.config.vocab_size
    args = parse_args(
        [
            model_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--enforce-eager",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--block-size",
            "8",
            "--served-model-name",
            "tiny",
            "--disable-access-log",
            "--reasoning-parser",
            "deepseek_r1",
        ]
    )
    engine = build_engine(args)
    with ServerThread(engine, args=args) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120), t
    bm = engine.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "KV blocks leaked"


def _extra(message, name):
    return (message.model_extra or {}).get(name)


def test_grammar_applies_after_the_reasoning(tiny):
    client, t = tiny
    end, word = t.convert_tokens_to_ids("</think>"), t.convert_tokens_to_ids("▁the")
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "the engine"}],
        temperature=0,
        extra_body={"structured_outputs": {"regex": "(yes|no)"}},
    )
    # </think> first: the grammar takes over from the next token
    r = client.chat.completions.create(max_tokens=20, logit_bias={str(end): 100}, **kw).choices[0]
    assert (_extra(r.message, "reasoning"), r.message.content in ("yes", "no"), r.finish_reason) == ("", True, "stop")
    # no </think>: reasoning, unconstrained (the grammar would refuse this word)
    r = client.chat.completions.create(max_tokens=4, logit_bias={str(word): 100}, **kw).choices[0]
    assert _extra(r.message, "reasoning").split() == ["the"] * 4 and r.message.content is None
    # enable_thinking false: the template closed the reasoning, so the grammar applies at once (</think> refused)
    r = client.chat.completions.create(
        max_tokens=20,
        logit_bias={str(end): 100},
        **kw
        | {
            "extra_body": {
                "structured_outputs": {"regex": "(yes|no)"},
                "chat_template_kwargs": {"enable_thinking": False},
            }
        },
    ).choices[0]
    assert _extra(r.message, "reasoning") is None and r.message.content in ("yes", "no")
