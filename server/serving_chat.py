"""POST /v1/chat/completions: messages -> chat template -> token ids -> n choices, streaming or not."""

from __future__ import annotations

import codecs
import os
import time
from typing import Any

from aiohttp import web

from jaxllm.entrypoints.chat_utils import flatten_content
from server.errors import APIError, parse_json, parse_model, read_body
from server.fan_in import (
    ChoiceState,
    EngineRequest,
    EngineRunner,
    RequestState,
    choice_usage,
    output_size,
    usage_of,
)
from server.logprobs import TokenNamer, chat_logprobs, prompt_logprobs_json
from server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from server.reasoning import ReasoningChoice, ReasoningStream, reasoning_fields
from server.serving_common import (
    SSE,
    STATE,
    ServerState,
    beam_search_params,
    encode,
    log_ignored_fields,
    log_request,
    make_sampling_params,
    reject_unsupported,
    resolve_max_tokens,
    truncate_prompt,
)
from server.tool_calls import (
    ToolChoice,
    ToolStream,
    parse_history_arguments,
    resolve_tool_choice,
    template_tools,
    tool_constraint,
)

# apply_chat_template arguments a request's chat_template_kwargs may not override.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "tokenize",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
    "return_assistant_tokens_mask",
    "chat_template",
}


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file path, or the template itself (anything with braces or newlines), its backslash
    escapes decoded as vLLM's load_chat_template decodes them."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        # vLLM decodes an inline template's escapes ("\\n" typed on a command line is a newline); characters
        # beyond latin-1 go through as \\u escapes, so that they come back as they were
        return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    raise ValueError(f"The supplied chat template ({value}) looks like a file path, but it failed to be opened.")


def to_conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as template input: content parts flattened to one string (text-only models), tool-call
    arguments in the history parsed to dicts."""
    conversation = []
    for m in messages:
        msg = m.model_dump(exclude_none=True)
        try:
            msg["content"] = flatten_content(m.content)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        conversation.append(msg)
    parse_history_arguments(conversation)
    return conversation


def render_chat(
    state: ServerState,
    conversation: list[dict],
    *,
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict | None,
    tools: list | None = None,
    documents: list | None = None,
) -> str:
    if continue_final_message and add_generation_prompt:
        raise APIError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    tokenizer = state.engine.get_tokenizer()
    template = chat_template or state.chat_template
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise APIError(
            "This model's tokenizer has no chat template: start the server with --chat-template, "
            "or send `chat_template` in the request.",
            param="chat_template",
        )
    kwargs: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    if tools:
        kwargs["tools"] = tools
    if documents:
        kwargs["documents"] = documents
    kwargs.update({k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS})
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
    except Exception as e:  # jinja errors, raise_exception() in templates, bad continue_final_message, ...
        raise APIError(f"Chat template error: {type(e).__name__}: {e}", param="messages") from None
    if not isinstance(text, str):
        raise APIError("The chat template did not render to text.")
    return text


def rendered_ids(state: ServerState, req, *, tools: list | None = None, truncating: bool = False) -> list[int]:
    """The token ids of a request's `messages` through the chat template (its chat_template, add_generation_prompt,
    continue_final_message, chat_template_kwargs; add_special_tokens unset is False): /tokenize's and
    /v1/embeddings' chat forms."""
    text = render_chat(
        state,
        to_conversation(req.messages),
        chat_template=req.chat_template,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs,
        tools=tools,
    )
    add_special = bool(req.add_special_tokens)
    return encode(state, text, add_special, param="messages", truncating=truncating, generating=False)


def reject_unsupported_chat(req: ChatCompletionRequest) -> None:
    if req.functions or req.function_call not in (None, "none"):
        raise APIError("Function calling is not supported by jaxllm yet.", param="functions")
    if req.modalities not in (None, ["text"]) or req.audio is not None:
        raise APIError("Only text output is supported.", param="modalities")
    if req.prediction is not None:
        raise APIError("Predicted outputs (`prediction`) are not supported by jaxllm.", param="prediction")
    if req.web_search_options is not None:
        raise APIError("web_search_options is not supported by jaxllm.", param="web_search_options")
    if req.top_logprobs is not None:
        if req.top_logprobs < 0 and req.top_logprobs != -1:
            raise APIError("`top_logprobs` must be a positive value.", param="top_logprobs")
        if req.top_logprobs > 0 and not req.logprobs:
            raise APIError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await read_body(request, state.limits.max_body_bytes, state.limits.timeout_request_body)
    ctx, engine_req = await state.workers.run(_prepare, state, raw, request.headers.get("X-Request-Id"), size=len(raw))
    if ctx.req.stream:
        return await _stream(request, ctx, engine_req)
    async with EngineRunner(state, [engine_req], ctx.req.priority) as run:
        await run.start()
        (rs,) = await run.run_to_end()
    text = await state.workers.run(_final_response, ctx, rs, size=output_size([rs]))
    return web.json_response(text=text)


def _prepare(state: ServerState, raw: bytes, header_id: str | None = None) -> tuple[_Ctx, EngineRequest]:
    """The request's engine request (in a worker thread: decoding, validation, the chat template and
    tokenization)."""
    req = parse_model(ChatCompletionRequest, parse_json(raw), sliced=("messages",))
    log_ignored_fields(req, "/v1/chat/completions")
    return prepare_chat(state, req, header_id)


def prepare_chat(
    state: ServerState,
    req: ChatCompletionRequest,
    header_id: str | None = None,
    request_id: str | None = None,
    clamp_max_tokens: bool = False,
) -> tuple[_Ctx, EngineRequest]:
    """A parsed chat request's engine request (also /v1/responses', translated: serving_responses.py);
    request_id: the engine request's id (default: chatcmpl-<X-Request-Id, request_id or random>);
    clamp_max_tokens: a limit past the context's room is cut to it (the Responses API's rule), not refused."""
    model, lora = state.check_model(req.model)
    state.need_tokenizer("Chat requests (the chat template)", param="messages")
    reject_unsupported(req)
    reject_unsupported_chat(req)
    tool_choice = resolve_tool_choice(req, auto_enabled=state.enable_auto_tools, parser=state.tool_parser)

    conversation = to_conversation(req.messages)
    tools = template_tools(req.tools, req.tool_choice, state.exclude_tools_when_tool_choice_none)
    text = render_chat(
        state,
        conversation,
        chat_template=req.chat_template,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs,
        tools=tools,
        documents=req.documents,
    )
    truncating = req.truncate_prompt_tokens is not None
    ids = truncate_prompt(
        encode(state, text, req.add_special_tokens, param="messages", truncating=truncating),
        req.truncate_prompt_tokens,
        state.engine.max_model_len,
    )
    if not ids:
        raise APIError("The decoder prompt cannot be empty", param="messages")
    reasoning = ReasoningChoice.for_request(state.reasoning_parser, req, state.engine.get_tokenizer(), ids)
    if reasoning is not None and state.reasoning_keeps_special_tokens:  # the tags are special tokens here
        req.skip_special_tokens = False
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(
        state, requested, len(ids), prompt_param="messages", max_tokens_param=limit_param, clamp=clamp_max_tokens
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = make_sampling_params(
        state,
        req,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        constraint=tool_constraint(tool_choice, req.tools),
        param_names={"logprobs": "top_logprobs", "max_tokens": limit_param},
        beam_search=req.use_beam_search,
    )
    beam = beam_search_params(state, req, max_tokens)
    request_id = request_id or f"chatcmpl-{header_id or req.request_id or random_id('')[1:]}"  # vLLM's order
    log_request(state, request_id, text, params)
    prompt = {"prompt_token_ids": ids, "prompt": text}
    if req.cache_salt:  # prefix-cache blocks are shared only between requests with the same salt
        prompt["cache_salt"] = req.cache_salt
    engine_req = EngineRequest(prompt, params, request_id, ids, text, lora, beam)

    role = state.response_role if req.add_generation_prompt else conversation[-1]["role"]
    echo = ""
    if req.echo and conversation and conversation[-1].get("role") == role:
        echo = conversation[-1].get("content") or ""
    req.messages = []  # rendered: not needed for the response, and it can be a million objects (see Workers)
    return _Ctx(state, req, request_id, model, role, echo, tool_choice, reasoning), engine_req


def _final_response(ctx: _Ctx, rs: RequestState) -> str:
    req = ctx.req
    resp = ChatCompletionResponse(
        id=ctx.request_id,
        created=ctx.created,
        model=ctx.model,
        usage=usage_of([rs], ctx.state.enable_prompt_tokens_details),
        choices=[ctx.final_choice(rs, j) for j in range(len(rs.choices))],
    )
    if req.prompt_logprobs is not None and rs.last is not None:
        resp.prompt_logprobs = prompt_logprobs_json(rs.prompt_logprobs)
    if req.return_token_ids:
        resp.prompt_token_ids = list(rs.request.prompt_ids)
    return resp.to_json()


class _Ctx:
    def __init__(
        self,
        state: ServerState,
        req: ChatCompletionRequest,
        request_id: str,
        model: str,
        role: str,
        echo: str,
        tool_choice: ToolChoice | None,
        reasoning: ReasoningChoice | None = None,
    ):
        self.state = state
        self.tool_choice = tool_choice
        self.tool_streams = [ToolStream(tool_choice) for _ in range(req.n)] if tool_choice else []
        self.reasoning = reasoning  # --reasoning-parser: tool calls and content come from the text after it
        self.reasoning_streams = [ReasoningStream(reasoning) for _ in range(req.n)] if reasoning else []
        self.req = req
        self.request_id = request_id
        self.model = model
        self.role = role
        self.echo = echo
        self.created = int(time.time())
        as_ids = req.return_tokens_as_token_ids or state.return_tokens_as_token_ids
        self.name = TokenNamer(state.engine.get_tokenizer(), bool(as_ids))
        self.top = (req.top_logprobs or 0) if req.logprobs else 0

    def _logprobs(self, c: ChoiceState, start: int, ids: list[int]) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        entries = c.logprobs[start : start + len(ids)]
        return ChatLogprobs(content=chat_logprobs(self.name, ids, entries, self.top))

    def final_choice(self, rs: RequestState, j: int) -> ChatChoice:
        c = rs.choices[j]
        text, fields = c.text, {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.message(c.text)
            fields = reasoning_fields(reasoning)
        if self.tool_choice is None:
            content = self.echo + text if text is not None else self.echo or None
            message, finish = ChatResponseMessage(role=self.role, content=content, **fields), c.finish_reason
        else:
            message = ChatResponseMessage(role=self.role, **self.tool_choice.message_fields(text or ""), **fields)
            finish = self.tool_choice.finish_reason(bool(message.tool_calls), c.finish_reason)
        choice = ChatChoice(
            index=j,
            message=message,
            logprobs=self._logprobs(c, 0, c.token_ids),
            finish_reason=finish,
            stop_reason=c.stop_reason,
        )
        if self.req.return_token_ids:
            choice.token_ids = list(c.token_ids)
        return choice

    def chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        resp = ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model, choices=choices)
        resp.usage = usage
        return resp.to_json()

    def delta_message(self, reasoning: str | None = None, **fields) -> DeltaMessage:
        """A stream delta; with a reasoning parser every one carries reasoning_content, as vLLM 0.11.2's."""
        if self.reasoning is not None:
            fields.update(reasoning_fields(reasoning) if reasoning else {"reasoning_content": None})
        return DeltaMessage(**fields)

    def delta(self, rs: RequestState, j: int) -> ChatStreamChoice | None:
        c = rs.choices[j]
        start = c.sent_tokens
        ids = c.token_ids[start:]
        c.sent_tokens = len(c.token_ids)
        finish = None if c.finish_sent else c.finish_reason
        c.finish_sent = c.finish_sent or finish is not None
        reasoning, content = "", c.text  # content: all of it so far
        if self.reasoning_streams:
            reasoning, content = self.reasoning_streams[j].step(c.text, final=finish is not None)
        if self.tool_choice is not None:
            stream = self.tool_streams[j]
            text, calls = stream.step(content, final=finish is not None)
            if finish is not None:
                finish = self.tool_choice.finish_reason(stream.sent_calls > 0, finish)
        else:
            text, calls, c.sent_text = content[c.sent_text :], [], len(content)
        fields = {"content": text} if text or not (calls or reasoning) else {}
        delta = self.delta_message(reasoning, **fields, **({"tool_calls": calls} if calls else {}))
        if not (
            text
            or calls
            or reasoning
            or finish is not None
            or (ids and (self.req.logprobs or self.req.return_token_ids))
        ):
            return None
        choice = ChatStreamChoice(
            index=j,
            delta=delta,
            logprobs=self._logprobs(c, start, ids),
            finish_reason=finish,
            stop_reason=c.stop_reason if finish else None,
        )
        if self.req.return_token_ids:
            choice.token_ids = ids
        return choice


async def _stream(request: web.Request, ctx: _Ctx, engine_req: EngineRequest) -> web.StreamResponse:
    req = ctx.req
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
    sse = SSE(request)
    async with EngineRunner(ctx.state, [engine_req], req.priority) as run:
        await run.start()  # invalid input still gets a status code
        await sse.open()
        # continuous_usage_stats: each chunk the prompt's tokens and its choice's so far (vLLM's; 0 before any)
        usage = (lambda j: choice_usage(run.states[0], j)) if continuous else (lambda j: None)
        try:
            try:
                for j in range(req.n):
                    first = ChatStreamChoice(
                        index=j, delta=ctx.delta_message(role=ctx.role, content=""), logprobs=None, finish_reason=None
                    )
                    await sse.send(ctx.chunk([first], usage(None)))
                    if ctx.echo:
                        echo = ChatStreamChoice(
                            index=j, delta=ctx.delta_message(content=ctx.echo), logprobs=None, finish_reason=None
                        )
                        await sse.send(ctx.chunk([echo], usage(None)))
                async for _, rs in run.events():
                    for j, c in enumerate(rs.choices):
                        if c.finish_sent:
                            continue
                        choice = ctx.delta(rs, j)
                        if choice is not None:
                            await sse.send(ctx.chunk([choice], usage(j)))
            except APIError as e:
                await sse.error(e)
            else:
                if include_usage:
                    resp = ChatCompletionStreamResponse(
                        id=ctx.request_id,
                        created=ctx.created,
                        model=ctx.model,
                        choices=[],
                        usage=usage_of(run.states, ctx.state.enable_prompt_tokens_details),
                    )
                    await sse.send(resp.to_json())
            await sse.done()
        except ConnectionError:
            pass  # the client went away mid-write: leaving the runner aborts whatever is unfinished
    return sse.response
