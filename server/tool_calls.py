"""Tool calling in /v1/chat/completions, as vLLM does it.

The request's `tools` always go to the chat template (unless --exclude-tools-when-tool-choice-none and
tool_choice is "none"). What tool_choice then does:
    "none"      plain content.
    named       {"type": "function", "function": {"name": N}}: the output is constrained to N's parameters
                schema and becomes one call of N with the output as its arguments (finish_reason unchanged).
    "required"  the output is constrained to a JSON list of {"name", "parameters"} objects, one per call, each
                one of the tools; finish_reason "tool_calls".
    "auto"      (the default when tools are sent) needs --enable-auto-tool-choice and --tool-call-parser: the
                model writes calls in its own format and server.tool_parsers turns them into tool calls;
                finish_reason "tool_calls" when it made any.
parallel_tool_calls=false keeps only the first call.

A stream sends a named call's arguments as they are generated; "required" and "auto" calls go out whole, one
delta each, as soon as they are complete (vLLM splits them into name and argument fragments; clients that join
the fragments get the same message). Content the parser might still claim (a started "<tool_call>") is held
back until it knows.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxllm.sampling_params import StructuredOutputsParams
from server.errors import APIError
from server.tool_parsers import Call, Parsed, ToolParser, array_items

_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolChoice:
    """What a chat request's tool_choice asks for; `mode` is "named", "required" or "auto"."""

    mode: str
    name: str | None = None
    parser: ToolParser | None = None
    parallel: bool = True

    def parse(self, text: str, final: bool) -> Parsed:
        if self.mode == "required":
            items, _ = array_items(text)
            calls = [
                Call(o["name"], json.dumps(o["parameters"], ensure_ascii=False))
                for o in items
                if isinstance(o, dict) and isinstance(o.get("name"), str) and "parameters" in o
            ]
            return Parsed("" if calls or not final else text, calls)
        if self.mode == "auto":
            return self.parser.parse(text, final)
        return Parsed("", [Call(self.name, text)])

    def streamer(self) -> Callable[[str, bool], Parsed]:
        """parse for one stream's growing text (server.tool_parsers: the auto parser's streamer)."""
        return self.parser.streamer() if self.mode == "auto" else self.parse

    def message_fields(self, text: str) -> dict[str, Any]:
        """content and tool_calls of the whole response's message."""
        parsed = self.parse(text, final=True)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        content = parsed.content  # "" for a named call and for "required" calls, as in vLLM
        if self.mode == "auto" and calls and not content:
            content = None
        return {"content": content, "tool_calls": [_call_json(c, tool_call_id()) for c in calls]}

    def finish_reason(self, called: bool, engine_reason: str | None) -> str | None:
        """vLLM's: "tool_calls" when the model called a tool ("auto"), or finished its calls ("required")."""
        if self.mode == "named" or engine_reason not in ("stop", "length"):
            return engine_reason
        return "tool_calls" if called and (self.mode == "auto" or engine_reason == "stop") else engine_reason


def _call_json(call: Call, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def resolve_tool_choice(req, *, auto_enabled: bool, parser: ToolParser | None) -> ToolChoice | None:
    """Checks tools / tool_choice with vLLM's messages (400s); None when the output is plain content. Sets
    skip_special_tokens=False where the configured parser needs its markers (vLLM's adjust_request)."""
    tools, choice = req.tools, req.tool_choice
    if choice is None:  # absent: "auto" when there are tools; an explicit null: parse only if auto is enabled
        explicit = "tool_choice" in req.model_fields_set
        choice = "auto" if tools and not (explicit and not (auto_enabled and parser)) else "none"
    if choice == "none":
        return None
    if tools is None:
        raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "required" and not tools:
        return None  # OpenAI: "required" with no tools behaves as "none"
    parallel = req.parallel_tool_calls is not False
    if parser is not None:
        req.skip_special_tokens = req.skip_special_tokens and not parser.keep_special_tokens
    if choice == "required":
        return ToolChoice("required", parallel=parallel)
    if choice == "auto":
        if not (auto_enabled and parser is not None):
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                param="tool_choice",
            )
        return ToolChoice("auto", parser=parser, parallel=parallel)
    if not isinstance(choice, dict):
        raise APIError(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are supported.',
            param="tool_choice",
        )
    function = choice.get("function")
    if not isinstance(function, dict):
        raise APIError(f"Invalid value for `function`: `{function}` in `tool_choice`! {_USAGE}", param="tool_choice")
    if "name" not in function:
        raise APIError(f"Expected field `name` in `function` in `tool_choice`! {_USAGE}", param="tool_choice")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise APIError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}", param="tool_choice")
    if not any(t.function.name == name for t in tools):
        raise APIError(
            "The tool specified in `tool_choice` does not match any of the specified `tools`", param="tool_choice"
        )
    return ToolChoice("named", name=name, parallel=parallel)


def tool_constraint(choice: ToolChoice | None, tools) -> StructuredOutputsParams | None:
    """The output constraint of a named or "required" tool choice (it replaces any other, as in vLLM)."""
    if choice is None or choice.mode == "auto":
        return None
    if choice.mode == "named":
        params = next(t.function.parameters for t in tools if t.function.name == choice.name)
        # vLLM leaves a tool without a parameters schema unconstrained; its arguments must still be an object.
        return StructuredOutputsParams(json=params) if params else StructuredOutputsParams(json_object=True)
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": t.function.parameters or {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                }
                for t in tools
            ],
        },
    }
    defs: dict[str, Any] = {}
    for t in tools:
        for name, sub in ((t.function.parameters or {}).get("$defs") or {}).items():
            if defs.get(name, sub) != sub:
                raise APIError(f"Tool definition '{name}' has multiple schemas, which is not supported.", param="tools")
            defs[name] = sub
    if defs:
        schema["$defs"] = defs
    return StructuredOutputsParams(json=schema)


def template_tools(tools, tool_choice=None, exclude_when_none: bool = False) -> list[dict] | None:
    """The tools as the chat template sees them (vLLM: each tool's model_dump())."""
    if tools is None or (exclude_when_none and tool_choice == "none"):
        return None
    return [t.model_dump() for t in tools]


def parse_history_arguments(conversation: list[dict]) -> None:
    """Assistant tool calls in the history carry their arguments as JSON text (OpenAI); chat templates expect
    dicts (transformers), so they are parsed in place, as vLLM does; empty or missing arguments are {}."""
    for i, msg in enumerate(conversation):
        if msg.get("role") != "assistant" or not isinstance(msg.get("tool_calls"), list):
            continue
        for call in msg["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise APIError(f"messages[{i}].tool_calls: each call needs a `function` object.", param="messages")
            args = function.get("arguments")
            if not args:
                function["arguments"] = {}
            elif isinstance(args, str):
                try:
                    function["arguments"] = json.loads(args)
                except json.JSONDecodeError as e:
                    raise APIError(
                        f"messages[{i}].tool_calls: arguments are not valid JSON ({e}).", param="messages"
                    ) from None


@dataclass
class ToolStream:
    """One streamed choice's tool-call state: what was sent of the content and of the calls."""

    choice: ToolChoice
    sent_content: int = 0
    sent_calls: int = 0
    sent_args: int = 0  # named: arguments text sent so far
    parse: Callable[[str, bool], Parsed] = field(init=False, repr=False)

    def __post_init__(self):
        self.parse = self.choice.streamer()

    def step(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content delta and tool-call deltas since the last step."""
        if self.choice.mode == "named":
            delta = text[self.sent_args :]
            if not delta and (self.sent_calls or not final):
                return "", []
            call: dict[str, Any] = {"index": 0, "function": {"arguments": delta}}
            if not self.sent_calls:
                call = {"index": 0, **_call_json(Call(self.choice.name, delta), tool_call_id())}
                self.sent_calls = 1
            self.sent_args = len(text)
            return "", [call]
        parsed = self.parse(text, final)
        calls = parsed.calls if self.choice.parallel else parsed.calls[:1]
        content = parsed.content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(parsed.content))
        deltas = [{"index": k, **_call_json(c, tool_call_id())} for k, c in enumerate(calls) if k >= self.sent_calls]
        self.sent_calls = max(self.sent_calls, len(calls))
        return content, deltas
