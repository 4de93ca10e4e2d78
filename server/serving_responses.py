"""POST /v1/responses: OpenAI's Responses API (vLLM serves it too). A request becomes a chat request
(instructions as the system message, then the input's items as messages), runs as /v1/chat/completions runs it,
and comes back as a Response: a message item with the output text (with --reasoning-parser, a reasoning item
before it; function_call items for the tool calls), streamed as the API's typed events.

Taken: input (a string, or items: messages whose content is a string or input_text / output_text parts,
function_call and function_call_output items, reasoning items), instructions, max_output_tokens (cut to the
context's room, as vLLM's), temperature, top_p, text.format (text, json_object, json_schema: a structured output),
tools (function tools, flat as the Responses API writes them), tool_choice ("none", "auto", "required" or
{"type": "function", "name"}: the chat route's modes, "auto" with --enable-auto-tool-choice and
--tool-call-parser), parallel_tool_calls, stream, user, metadata, store (ignored: nothing is stored, as vLLM without
VLLM_ENABLE_RESPONSES_API_STORE). Input items become chat messages as vLLM joins them: a function_call (and a
reasoning item, whose text the template sees as reasoning_content) joins the assistant message before it, a
function_call_output is a tool message. Refused with a 400 naming the field: other tool types (web search, file
search, MCP, ...), other item types, background, output logprobs, prompt templates; previous_response_id (and GET
/v1/responses/{id}) is a 404 (no response is stored), as in vLLM. A response cut off by max_output_tokens has status
"incomplete" (OpenAI's); its stream still ends with response.completed, as vLLM's does (the openai SDK's stream
helper waits for it).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from server.errors import APIError, parse_json, parse_model, read_body
from server.fan_in import EngineRunner, RequestState, output_size
from server.protocol import ChatCompletionRequest, OpenAIModel, random_id
from server.serving_chat import prepare_chat
from server.serving_common import STATE, ServerState, log_ignored_fields


class ResponsesRequest(OpenAIModel):
    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: dict | None = None
    truncation: str | None = None
    prompt: Any = None
    request_id: str | None = None


# what the Responses API's `include` may name (OpenAI's list, as vLLM's request model takes it)
INCLUDABLE = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
)
ROLES = ("user", "system", "developer", "assistant")
# chat-route field names in errors -> the Responses request's own
_PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text",
}


def _content(content: Any, i: int, field: str = "content") -> str:
    """A message item's content (a function_call_output's output) as one string: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise APIError(f"input[{i}]: content part type {kind!r} is not supported (text only).", param="input")
            if not isinstance(part.get("text"), str):
                raise APIError(f"input[{i}]: a {kind} part needs a string 'text'.", param="input")
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError(f"input[{i}].{field} must be a string or a list of text parts.", param="input")


def _chat_tool(tool: Any, i: int) -> dict:
    """A Responses function tool (flat: type, name, description, parameters, strict) as a chat tool."""
    kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
    if kind != "function":
        raise APIError(f"tools[{i}]: tool type {kind!r} is not supported (function tools only).", param="tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(f"tools[{i}]: a function tool needs a string 'name'.", param="tools")
    fields = ("name", "description", "parameters")
    return {"type": "function", "function": {k: tool[k] for k in fields if tool.get(k) is not None}}


def _chat_tool_choice(choice: Any) -> Any:
    """ "none" / "auto" / "required" as they are (the chat route checks them); {"type": "function", "name"} as the
    chat route's named choice."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise APIError(
            f'tool_choice {choice!r} is not supported: use "none", "auto", "required" or '
            '{"type": "function", "name": ...}.',
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice.get("name")}}


def _strings(item: dict, i: int, *keys: str) -> list[str]:
    for key in keys:
        if not isinstance(item.get(key), str):
            raise APIError(f"input[{i}]: a {item['type']} item needs a string {key!r}.", param="input")
    return [item[key] for key in keys]


def _output_text(output: Any, i: int) -> str:
    """A function_call_output's output: a string, or text parts joined."""
    return output if isinstance(output, str) else _content(output, i, "output")


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """The input items as chat messages. As vLLM joins them: a function_call is a tool call of the assistant
    message before it (or of a new one), a reasoning item that message's reasoning_content, an assistant message
    item its content if it has none yet; a function_call_output is a tool message."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            if item.get("role") not in ROLES:
                raise APIError(
                    f"input[{i}]: a message's role must be one of {list(ROLES)}, got {item.get('role')!r}.",
                    param="input",
                )
            content = _content(item.get("content"), i)
            if item["role"] == "assistant" and last is not None and last.get("content") is None:
                last["content"] = content
            else:
                messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            call_id, name, arguments = _strings(item, i, "call_id", "name", "arguments")
            try:
                json.loads(arguments or "{}")
            except json.JSONDecodeError as e:
                raise APIError(
                    f"input[{i}]: a function_call's arguments are not valid JSON ({e}).", param="input"
                ) from None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            (call_id,) = _strings(item, i, "call_id")
            output = _output_text(item.get("output"), i)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
            ):
                raise APIError(
                    f"input[{i}]: a reasoning item's content / summary parts need a string 'text'.", param="input"
                )
            text = "\n".join(p["text"] for p in parts)
            if last is not None and "reasoning_content" not in last:
                last["reasoning_content"] = text
            else:
                messages.append({"role": "assistant", "content": None, "reasoning_content": text})
        else:
            raise APIError(
                f"input[{i}]: item type {kind!r} is not supported "
                "(message, function_call, function_call_output and reasoning items only).",
                param="input",
            )
    return messages


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.previous_response_id is not None:
        raise APIError(f"Response with id '{req.previous_response_id}' not found.", 404, param="previous_response_id")
    if req.background:
        raise APIError("background mode needs stored responses, which jaxllm does not keep.", param="background")
    unknown = [x for x in req.include or [] if x not in INCLUDABLE]
    if unknown:
        raise APIError(f"include: unknown values {unknown}; allowed: {list(INCLUDABLE)}.", param="include")
    if "message.output_text.logprobs" in (req.include or []) or req.top_logprobs:
        raise APIError("output logprobs are not supported on /v1/responses by jaxllm.", param="include")
    if req.truncation not in (None, "auto", "disabled"):
        raise APIError(f"truncation must be 'auto' or 'disabled', got {req.truncation!r}.", param="truncation")
    if req.prompt is not None:
        raise APIError("prompt templates are not supported.", param="prompt")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        messages += input_messages(req.input)
    fmt = (req.text or {}).get("format") or {"type": "text"}
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "user": req.user,
    }
    if req.tools is not None:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if "tool_choice" in req.model_fields_set and (req.tools is not None or req.tool_choice != "auto"):
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)  # "auto" without tools: OpenAI's default, nothing
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if fmt.get("type") == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")},
        }
    elif fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt.get("type") != "text":
        raise APIError(f"text.format type {fmt.get('type')!r} is not supported.", param="text")
    return parse_model(ChatCompletionRequest, body)


def _prepare(state: ServerState, raw: bytes, header_id: str | None):
    req = parse_model(ResponsesRequest, parse_json(raw), sliced=("input",))
    log_ignored_fields(req, "/v1/responses")
    response_id = req.request_id or f"resp_{random_id('')[1:]}"  # vLLM's id: the request's request_id
    try:
        ctx, engine_req = prepare_chat(
            state, to_chat_request(req), header_id, request_id=response_id, clamp_max_tokens=True
        )
    except APIError as e:  # named as this route's fields, not the chat request's they became
        e.param = _PARAMS.get(e.param or "", e.param)
        raise
    return req, ctx, engine_req


async def response_not_found(request: web.Request) -> web.Response:
    """GET /v1/responses/{id} (and its cancel): no response is stored, so none is found (vLLM's answer without a
    store)."""
    raise APIError(f"Response with id '{request.match_info['response_id']}' not found.", 404, param="response_id")


class _Response:
    """The Response object of one request, and its output items as they grow (streamed or not)."""

    def __init__(self, req: ResponsesRequest, ctx, params):
        self.req, self.ctx, self.params = req, ctx, params  # params: the SamplingParams it runs with
        self.id = ctx.request_id
        self.items: list[dict] = []

    def body(self, status: str, rs: RequestState | None = None) -> dict:
        req, usage, incomplete = self.req, None, None
        if rs is not None:
            prompt = len(rs.request.prompt_ids)
            out = rs.completion_tokens
            cached = (rs.last.num_cached_tokens or 0) if rs.last is not None else 0
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + out,
            }
            if rs.choices[0].finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.ctx.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata,
            "model": self.ctx.model,
            "output": self.items,
            "parallel_tool_calls": bool(req.parallel_tool_calls) if req.parallel_tool_calls is not None else True,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": self.params.temperature,
            "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [self.tool_json(t) for t in req.tools or []],
            "top_p": self.params.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
        }

    @staticmethod
    def message(text: str, status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "id": f"msg_{random_id('')[1:]}",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part],
        }

    @staticmethod
    def tool_json(tool: dict) -> dict:
        """A function tool as the Response echoes it (OpenAI's FunctionTool fields)."""
        keys = ("name", "description", "parameters", "strict")
        return {"type": "function", **{k: tool.get(k) for k in keys}}

    @staticmethod
    def function_call(call: dict, status: str, arguments: str | None = None) -> dict:
        """A chat tool call ({"id", "function": {"name", "arguments"}}) as a function_call item."""
        fn = call["function"]
        return {
            "id": f"fc_{random_id('')[1:]}",
            "type": "function_call",
            "call_id": call["id"],
            "name": fn["name"],
            "arguments": (fn.get("arguments") or "") if arguments is None else arguments,
            "status": status,
        }

    @staticmethod
    def reasoning(text: str) -> dict:
        return {
            "id": f"rs_{random_id('')[1:]}",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await read_body(request, state.limits.max_body_bytes, state.limits.timeout_request_body)
    req, ctx, engine_req = await state.workers.run(
        _prepare, state, raw, request.headers.get("X-Request-Id"), size=len(raw)
    )
    if req.stream:
        return await _stream(request, req, ctx, engine_req)
    async with EngineRunner(state, [engine_req], ctx.req.priority) as run:
        await run.start()
        (rs,) = await run.run_to_end()
    text = await state.workers.run(_final_response, req, ctx, rs, size=output_size([rs]))
    return web.json_response(text=text)


def _final_response(req: ResponsesRequest, ctx, rs: RequestState) -> str:
    resp = _Response(req, ctx, rs.request.params)
    message = ctx.final_choice(rs, 0).message
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning:
        resp.items.append(resp.reasoning(reasoning))
    if message.content or not message.tool_calls:
        resp.items.append(resp.message(message.content or "", "completed"))
    resp.items += [resp.function_call(call, "completed") for call in message.tool_calls]
    if rs.choices[0].finish_reason == "length":  # cut off by max_output_tokens: the last item is unfinished
        resp.items[-1]["status"] = "incomplete"
    return json.dumps(resp.body("completed", rs))


async def _stream(request: web.Request, req: ResponsesRequest, ctx, engine_req) -> web.StreamResponse:
    """The Responses API's events: created, in_progress; per output item added, (content part added,) its deltas,
    done; completed with the whole response. Reasoning (a --reasoning-parser's) streams as a reasoning item
    before the message."""
    resp = _Response(req, ctx, engine_req.params)
    sse = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    seq = 0

    async def send(kind: str, **fields) -> None:
        nonlocal seq
        event = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        await sse.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

    open_item: dict | None = None  # the item now streaming: {"kind", "index", "item", "text"}

    async def close_item(status: str = "completed") -> None:
        nonlocal open_item
        if open_item is None:
            return
        i, item, text = open_item["index"], open_item["item"], open_item["text"]
        if open_item["kind"] == "function_call":
            await send(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=i,
                name=item["name"],
                arguments=text,
            )
            item = item | {"arguments": text, "status": status}
        elif open_item["kind"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            await send(
                "response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=text, logprobs=[]
            )
            await send("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
            item = resp.message(text, status) | {"id": item["id"]}
        else:
            await send("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0, text=text)
            item = resp.reasoning(text) | {"id": item["id"]}
        resp.items[i] = item
        await send("response.output_item.done", output_index=i, item=item)
        open_item = None

    async def delta(kind: str, text: str | None) -> None:
        nonlocal open_item
        if open_item is not None and open_item["kind"] != kind:
            await close_item()
        if open_item is None:
            i = len(resp.items)
            if kind == "message":
                item = resp.message("", "in_progress") | {"content": []}
            else:
                item = resp.reasoning("") | {"content": []}
            resp.items.append(item)
            open_item = {"kind": kind, "index": i, "item": item, "text": ""}
            await send("response.output_item.added", output_index=i, item=item)
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": []}
                await send(
                    "response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=part
                )
        if text is None:
            return
        open_item["text"] += text
        i, item_id = open_item["index"], open_item["item"]["id"]
        if kind == "message":
            await send(
                "response.output_text.delta", item_id=item_id, output_index=i, content_index=0, delta=text, logprobs=[]
            )
        else:
            await send("response.reasoning_text.delta", item_id=item_id, output_index=i, content_index=0, delta=text)

    async def call_delta(call: dict) -> None:
        """A chat stream's tool-call delta: a new call (it has an id) opens a function_call item; arguments go to
        the open one."""
        nonlocal open_item
        if "id" in call:
            await close_item()
            i = len(resp.items)
            item = resp.function_call(call, "in_progress", arguments="")
            resp.items.append(item)
            open_item = {"kind": "function_call", "index": i, "item": item, "text": ""}
            await send("response.output_item.added", output_index=i, item=item)
        arguments = (call.get("function") or {}).get("arguments") or ""
        if arguments and open_item is not None and open_item["kind"] == "function_call":
            open_item["text"] += arguments
            i, item_id = open_item["index"], open_item["item"]["id"]
            await send("response.function_call_arguments.delta", item_id=item_id, output_index=i, delta=arguments)

    async with EngineRunner(ctx.state, [engine_req], ctx.req.priority) as run:
        await run.start()  # invalid input still gets a status code
        await sse.prepare(request)
        try:
            await send("response.created", response=resp.body("in_progress"))
            await send("response.in_progress", response=resp.body("in_progress"))
            rs = None
            try:
                async for _, rs in run.events():
                    choice = ctx.delta(rs, 0)
                    if choice is None:
                        continue
                    reasoning = getattr(choice.delta, "reasoning_content", None)
                    if reasoning:
                        await delta("reasoning", reasoning)
                    if choice.delta.content:
                        await delta("message", choice.delta.content)
                    for call in choice.delta.tool_calls or []:
                        await call_delta(call)
            except APIError as e:
                await send("error", code=str(e.status), message=e.message, param=e.param)
                await sse.write_eof()
                return sse
            if not any(item["type"] in ("message", "function_call") for item in resp.items):
                await delta("message", None)  # an empty answer is still a message (opened and closed, no delta)
            cut = rs is not None and rs.choices[0].finish_reason == "length"
            await close_item("incomplete" if cut else "completed")  # cut off: the last item is unfinished
            # status "incomplete" when cut off; the event is response.completed either way, as vLLM's stream ends
            await send("response.completed", response=resp.body("completed", rs))
            await sse.write_eof()
        except ConnectionError:
            pass  # the client went away mid-write: leaving the runner aborts the request
    return sse
