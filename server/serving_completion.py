"""POST /v1/completions: prompts (text, token ids, or lists of either) x n choices, streaming or not.

Choice index = prompt index * n + sample index, as OpenAI and vLLM number them.
"""

from __future__ import annotations

import time

from aiohttp import web

from server.errors import APIError, parse_json, parse_model, read_body
from server.fan_in import EngineRequest, EngineRunner, RequestState, choice_usage, output_size, usage_of
from server.logprobs import TokenNamer, completion_logprobs, prompt_logprobs_json
from server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    random_id,
)
from server.serving_common import (
    SSE,
    STATE,
    ServerState,
    beam_search_params,
    check_token_ids,
    encode,
    log_ignored_fields,
    log_request,
    make_sampling_params,
    reject_unsupported,
    resolve_max_tokens,
    truncate_prompt,
)


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await read_body(request, state.limits.max_body_bytes, state.limits.timeout_request_body)
    ctx, requests = await state.workers.run(_prepare, state, raw, request.headers.get("X-Request-Id"), size=len(raw))
    if ctx.req.stream:
        return await _stream(request, ctx, requests)
    async with EngineRunner(state, requests, ctx.req.priority) as run:
        await run.start()
        states = await run.run_to_end()
    text = await state.workers.run(_final_response, ctx, states, size=output_size(states))
    return web.json_response(text=text)


def _prepare(state: ServerState, raw: bytes, header_id: str | None = None) -> tuple[_Ctx, list[EngineRequest]]:
    """The request's engine requests (in a worker thread: decoding, validation and tokenization)."""
    req = parse_model(CompletionRequest, parse_json(raw))
    log_ignored_fields(req, "/v1/completions")
    model, lora = state.check_model(req.model)
    reject_unsupported(req)
    if req.suffix is not None:
        raise APIError("suffix is not currently supported", param="suffix")
    if req.logprobs is not None and req.logprobs < 0 and req.logprobs != -1:
        raise APIError(f"logprobs must be non-negative, got {req.logprobs}.", param="logprobs")

    request_id = f"cmpl-{header_id or req.request_id or random_id('')[1:]}"  # vLLM's order
    echo_only = req.echo and req.max_tokens == 0  # OpenAI echoes the prompt alone when max_tokens is 0
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = req.logprobs
    requests = []
    for i, (text, ids) in enumerate(_prompts(state, req)):
        max_tokens = resolve_max_tokens(state, 1 if echo_only else req.max_tokens, len(ids), prompt_param="prompt")
        params = make_sampling_params(
            state,
            req,
            max_tokens=max_tokens,
            logprobs=req.logprobs,
            prompt_logprobs=prompt_logprobs,
            beam_search=req.use_beam_search,
        )
        beam = beam_search_params(state, req, max_tokens)
        prompt = {"prompt_token_ids": ids} if text is None else {"prompt_token_ids": ids, "prompt": text}
        if req.cache_salt:  # prefix-cache blocks are shared only between requests with the same salt
            prompt["cache_salt"] = req.cache_salt
        rid = f"{request_id}-{i}"
        log_request(state, rid, text if text is not None else ids, params)
        requests.append(EngineRequest(prompt, params, rid, ids, text, lora, beam))
    return _Ctx(state, req, request_id, model, echo_only), requests


def _final_response(ctx: _Ctx, states: list[RequestState]) -> str:
    choices = [
        ctx.piece(i, rs, j, first=True, always=True) for i, rs in enumerate(states) for j in range(len(rs.choices))
    ]
    return CompletionResponse(
        id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=ctx.usage(states)
    ).to_json()


def _prompts(state: ServerState, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """Each prompt as (text or None, token ids), truncated if asked."""
    p = req.prompt
    if isinstance(p, str):
        items = [p]
    elif p and isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise APIError("prompt must not be an empty list.", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = encode(
                state, item, req.add_special_tokens, param="prompt", truncating=req.truncate_prompt_tokens is not None
            )
            text = item
        else:
            check_token_ids(item, state.engine.vocab_size)
            ids, text = list(item), None
        truncated = truncate_prompt(ids, req.truncate_prompt_tokens, state.engine.max_model_len)
        if len(truncated) != len(ids):
            ids, text = truncated, None
        if not ids:
            raise APIError("The decoder prompt cannot be empty", param="prompt")
        out.append((text, ids))
    return out


class _Ctx:
    """Per-request formatting: echo, logprobs, token-id fields, running text offsets per choice."""

    def __init__(self, state: ServerState, req: CompletionRequest, request_id: str, model: str, echo_only: bool):
        self.state = state
        self.req = req
        self.request_id = request_id
        self.model = model
        self.echo_only = echo_only
        self.created = int(time.time())
        self.tokenizer = state.engine.get_tokenizer()
        as_ids = req.return_tokens_as_token_ids or state.return_tokens_as_token_ids
        self.name = TokenNamer(self.tokenizer, bool(as_ids))
        self.offsets: dict[int, int] = {}

    def usage(self, states: list[RequestState]):
        usage = usage_of(states, self.state.enable_prompt_tokens_details)
        if self.echo_only:  # the one token generated to satisfy the engine is not returned
            usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
        return usage

    def piece(self, i: int, rs: RequestState, j: int, first: bool, always: bool = False) -> CompletionChoice | None:
        """What choice j of prompt i has not sent yet (all of it when not streaming); None if nothing."""
        c = rs.choices[j]
        req = self.req
        index = i * req.n + j
        text, ids, entries = "", [], []
        if first and req.echo:
            r = rs.request
            if r.prompt_text is not None:
                text = r.prompt_text
            else:  # token ids: their text (none without a tokenizer, as generated text has none then)
                text = self.tokenizer.decode(r.prompt_ids) if self.tokenizer is not None else ""
            ids = list(r.prompt_ids)
            if req.logprobs is not None:
                pl = rs.prompt_logprobs
                entries = list(pl) if pl is not None else [None] * len(ids)
        new_ids: list[int] = []
        if not self.echo_only:
            text += c.text[c.sent_text :]
            new_ids = c.token_ids[c.sent_tokens :]
            ids += new_ids
            if req.logprobs is not None:
                entries += c.logprobs[c.sent_tokens : c.sent_tokens + len(new_ids)]
        c.sent_text, c.sent_tokens = len(c.text), len(c.token_ids)
        finish = None if c.finish_sent else c.finish_reason
        c.finish_sent = c.finish_sent or finish is not None
        if not (always or text or finish is not None or (ids and (req.logprobs is not None or req.return_token_ids))):
            return None
        logprobs = None
        if req.logprobs is not None:
            logprobs, self.offsets[index] = completion_logprobs(
                self.name, ids, entries, req.logprobs, self.offsets.get(index, 0)
            )
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=c.stop_reason if finish is not None else None,
        )
        if req.return_token_ids:
            choice.token_ids = new_ids
            if first:
                choice.prompt_token_ids = list(rs.request.prompt_ids)
        if req.prompt_logprobs is not None and first and rs.last is not None:
            choice.prompt_logprobs = prompt_logprobs_json(rs.prompt_logprobs)
        return choice


async def _stream(request: web.Request, ctx: _Ctx, requests: list[EngineRequest]) -> web.StreamResponse:
    req = ctx.req
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
    sse = SSE(request)
    async with EngineRunner(ctx.state, requests, req.priority) as run:
        await run.start()  # invalid input still gets a status code
        await sse.open()
        started: set[tuple[int, int]] = set()
        try:
            try:
                async for i, rs in run.events():
                    for j, c in enumerate(rs.choices):
                        if c.finish_sent:
                            continue
                        choice = ctx.piece(i, rs, j, first=(i, j) not in started)
                        if choice is None:
                            continue
                        started.add((i, j))
                        chunk = CompletionStreamResponse(
                            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[choice]
                        )
                        if continuous:  # this prompt's and this choice's counts so far (vLLM's)
                            chunk.usage = choice_usage(rs, None if ctx.echo_only else j)
                        await sse.send(chunk.to_json())
            except APIError as e:
                await sse.error(e)
            else:
                if include_usage:
                    chunk = CompletionStreamResponse(
                        id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[], usage=ctx.usage(run.states)
                    )
                    await sse.send(chunk.to_json())
            await sse.done()
        except ConnectionError:
            pass  # the client went away mid-write: leaving the runner aborts whatever is unfinished
    return sse.response
