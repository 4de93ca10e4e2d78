"""Tool-call parsers for tool_choice="auto" (`--enable-auto-tool-choice --tool-call-parser NAME`): each turns a
model's own tool-call format back into OpenAI tool calls, as vLLM's parser of the same name does.

    hermes       Hermes, Qwen2.5, Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated.
    llama3_json  Llama 3.1 / 3.2: {"name": ..., "parameters": {...}}, optionally after <|python_tag|>, several
                 separated by ";". Only an output that starts with a call is parsed (as vLLM's parser does).
    mistral      Mistral: [TOOL_CALLS] then a JSON list of {"name": ..., "arguments": {...}}.
    pythonic     Llama 3.2 / Gemma 3 with vLLM's pythonic templates: the whole output is a Python list of calls,
                 [get_weather(city="Paris"), get_time(zone="cet")], keyword arguments of literal values.

A parser is one function of the text generated so far: parse(text, final) -> Parsed. `content` is the text
that is certainly not part of a call and `calls` the calls complete so far. A stream sends what grew since its
last step, and a whole response is parse(text, final=True), so a stream adds up to the same message: content
only ever grows, and a call, once complete, never changes. A stream calls its parser's `streamer()` once and then
that function at every step: the same Parsed as `parse` on the same text, where a parser can reuse its earlier
steps' work because the text only grows (pythonic: its character scan resumes where it stopped, so a stream of L
characters costs O(L) there, not O(L^2); the others' per-step work is C-level string and JSON scanning).

When no call parses, the whole output is the content (vLLM: `tools_called` false). A call that does not parse
among others that do is dropped with a warning (vLLM would return the whole output as content; a stream here
has already sent the good calls).
"""

from __future__ import annotations

import ast
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("jaxllm.server")


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text


@dataclass
class Parsed:
    content: str
    calls: list[Call] = field(default_factory=list)


@dataclass(frozen=True)
class ToolParser:
    name: str
    parse: Callable[[str, bool], Parsed]
    keep_special_tokens: bool  # vLLM's adjust_request: the call markers are special tokens in some vocabularies
    stream: Callable[[], Callable[[str, bool], Parsed]] | None = None  # a stateful parse for one growing text

    def streamer(self) -> Callable[[str, bool], Parsed]:
        """parse for one stream's text, which only grows from call to call (module docstring)."""
        return self.parse if self.stream is None else self.stream()


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that `marker` starts with (it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def call_from(obj, args_keys: tuple[str, ...]) -> Call | None:
    """{"name": str, <first of args_keys>: value} as a Call (arguments dumped as vLLM does), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in args_keys if k in obj), None)
    if key is None:
        return None
    args = obj[key]
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def array_items(text: str) -> tuple[list, bool]:
    """The complete items of a JSON array `text` starts with (after whitespace), and whether it is closed."""
    decoder = json.JSONDecoder()
    s = text.lstrip()
    if not s.startswith("["):
        return [], False
    items, i = [], 1
    while True:
        while i < len(s) and s[i] in " \t\r\n,":
            i += 1
        if i >= len(s):
            return items, False
        if s[i] == "]":
            return items, True
        try:
            obj, i = decoder.raw_decode(s, i)
        except json.JSONDecodeError:
            return items, False
        items.append(obj)


def _finish(text: str, content: str, calls: list[Call], bad: int, final: bool) -> Parsed:
    if final and not calls:
        return Parsed(text)
    if final and bad:
        logger.warning("tool parser: dropped %d tool call(s) that did not parse in %.200r", bad, text)
    return Parsed(content, calls)


# ------------------------------------------------------------------------------------------------ hermes

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, final: bool) -> Parsed:
    start = text.find(_HERMES_START)
    if start < 0:
        return Parsed(text if final else text[: len(text) - held_suffix(text, _HERMES_START)])
    calls, bad = [], 0
    for part in text[start:].split(_HERMES_START)[1:]:
        body, closed, _ = part.partition(_HERMES_END)
        if not closed and not final:
            break
        try:
            call = call_from(json.loads(body), ("arguments",))
        except json.JSONDecodeError:
            call = None
        if call is None:
            bad += 1
        else:
            calls.append(call)
    return _finish(text, text[:start], calls, bad, final)


# ------------------------------------------------------------------------------------------- llama3_json

_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, final: bool) -> Parsed:
    if not final and (not text or _PYTHON_TAG.startswith(text)):
        return Parsed("")
    body = text[len(_PYTHON_TAG) :] if text.startswith(_PYTHON_TAG) else text
    if not body.startswith("{"):
        return Parsed(text)
    decoder = json.JSONDecoder()
    calls, bad, i = [], 0, 0
    while True:
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
        if i >= len(body):
            break
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            bad += 1
            break
        call = call_from(obj, ("arguments", "parameters"))
        if call is None:
            bad += 1
        else:
            calls.append(call)
    return _finish(text, "", calls, bad, final)


# ----------------------------------------------------------------------------------------------- mistral

_MISTRAL_START = "[TOOL_CALLS]"


def parse_mistral(text: str, final: bool) -> Parsed:
    start = text.find(_MISTRAL_START)
    if start < 0:
        return Parsed(text if final else text[: len(text) - held_suffix(text, _MISTRAL_START)])
    rest = text[start + len(_MISTRAL_START) :].replace(_MISTRAL_START, "")
    items, closed = array_items(rest)
    calls = [c for c in (call_from(o, ("arguments",)) for o in items) if c is not None]
    return _finish(text, text[:start], calls, len(items) - len(calls) + (not closed), final)


# ---------------------------------------------------------------------------------------------- pythonic


class _ListScan:
    """The complete top-level elements (their source text) of the Python list literal a text starts with, and the
    end of the list (None while it is open); brackets inside strings do not count. feed(s) scans s from where the
    previous feed stopped: s must extend the text fed before (a stream's output so far)."""

    def __init__(self):
        self.items: list[str] = []
        self.end: int | None = None
        self.scanned = 0  # characters looked at over all feeds (each once: tests/test_tool_parser_streams.py)
        self._depth, self._quote, self._start, self._i = 0, None, 1, 1

    def feed(self, s: str) -> tuple[list[str], int | None]:
        if self.end is not None:
            return self.items, self.end
        items, depth, quote, start, i = self.items, self._depth, self._quote, self._start, self._i
        while i < len(s):
            c = s[i]
            if quote:
                if c == "\\":
                    i += 1
                elif c == quote:
                    quote = None
            elif c in "'\"":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}" and depth:
                depth -= 1
            elif c == "]" or (c == "," and depth == 0):
                if s[start:i].strip():
                    items.append(s[start:i])
                if c == "]":
                    self.end = i + 1
                    break
                start = i + 1
            i += 1
        self.scanned += i - self._i
        self._depth, self._quote, self._start, self._i = depth, quote, start, i
        return items, self.end


def _python_call(source: str) -> Call | None:
    """name(key=literal, ...) as a Call (vLLM's pythonic parser takes keyword arguments only)."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and not node.args
            and all(kw.arg is not None for kw in node.keywords)
        ):
            return None
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return Call(node.func.id, json.dumps(args, ensure_ascii=False))


def parse_pythonic(text: str, final: bool) -> Parsed:
    return _PythonicStream().parse(text, final)


class _PythonicStream:
    """parse_pythonic for one growing text: the list's scan resumes where it stopped and each element is parsed
    once (its source text is final once the scan has passed it). Its calls go out when the output ends: a list
    followed by more text is prose (vLLM's whole-output parse), so a call streamed earlier could not be taken back."""

    def __init__(self):
        self.scan = _ListScan()
        self.calls: list[Call | None] = []  # per element of scan.items

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()  # its start stays put once there is any: the scan runs over it
        if not body:
            return Parsed(text if final else "")
        if not body.startswith("["):
            return Parsed(text)
        items, end = self.scan.feed(body)
        if final and end is not None and body[end:].strip():
            return Parsed(text)  # a list followed by more text is prose, not calls
        self.calls += map(_python_call, items[len(self.calls) :])
        if not final:  # text may still follow the list and make it prose: no call goes out before the output ends
            return Parsed("")
        calls = [c for c in self.calls if c is not None]
        return _finish(text, "", calls, len(items) - len(calls) + (final and end is None), final)


TOOL_PARSERS = {
    p.name: p
    for p in (
        ToolParser("hermes", parse_hermes, keep_special_tokens=True),
        ToolParser("llama3_json", parse_llama3_json, keep_special_tokens=False),
        ToolParser("mistral", parse_mistral, keep_special_tokens=True),
        ToolParser("pythonic", parse_pythonic, keep_special_tokens=False, stream=lambda: _PythonicStream().parse),
    )
}
