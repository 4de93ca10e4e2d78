"""The aiohttp application: routes, API-key and error middlewares, the stats log task.

`build_app(engine, args)` depends only on EngineClient, so tests serve a fake engine through the same code.
Serve it with server.http_server's `start_server` and stop it with `stop_server` (which drains): a client that
hangs up cancels its handler, which closes the engine iterator and aborts the request.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import inspect
import json
import logging
import os

from aiohttp import web

import jaxllm
from jaxllm.engine.protocol import EngineClient
from jaxllm.metrics.prometheus import EngineMetrics
from jaxllm.reasoning import reasoning_parser, tags_are_special
from server.admission import ServerLimits
from server.errors import APIError, error_body, model_not_found, parse_json, parse_model, read_body
from server.http_server import set_server_header, start_server, stop_server
from server.lora import ServedLoRAs, load_lora_adapter, load_static, unload_lora_adapter
from server.metrics import StatsLogger
from server.prompt_bound import PromptBound
from server.protocol import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest
from server.serving_chat import create_chat_completion, load_chat_template, rendered_ids
from server.serving_common import STATE, ServerState, encode, log_ignored_fields
from server.serving_completion import create_completion
from server.serving_embedding import create_embedding
from server.serving_responses import create_response, response_not_found
from server.tool_calls import template_tools
from server.tool_parsers import TOOL_PARSERS

__all__ = ["build_app", "start_server", "stop_server"]

logger = logging.getLogger("jaxllm.server")

_STATS_TASK = web.AppKey("jaxllm_stats_task", asyncio.Task)


def build_app(engine: EngineClient, args: argparse.Namespace) -> web.Application:
    """The OpenAI-compatible app for `engine`; `args` is server.args' namespace (missing fields take defaults)."""
    opt = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    names = opt("served_model_name") or [opt("model") or engine.model_name]
    if isinstance(names, str):
        names = [names]
    limits = ServerLimits.from_args(args)
    state = ServerState(
        engine=engine,
        served_model_names=list(names),
        model_root=opt("model") or engine.model_name,
        metrics=EngineMetrics(engine, names[0]),
        chat_template=load_chat_template(opt("chat_template")),
        response_role=opt("response_role") or "assistant",
        return_tokens_as_token_ids=bool(opt("return_tokens_as_token_ids", False)),
        enable_prompt_tokens_details=bool(opt("enable_prompt_tokens_details", False)),
        limits=limits,
        log_requests=bool(opt("enable_log_requests", False)),
        max_log_len=opt("max_log_len"),
        profile_dir=opt("profile_dir"),
        tool_parser=TOOL_PARSERS[opt("tool_call_parser")] if opt("tool_call_parser") else None,
        enable_auto_tools=bool(opt("enable_auto_tool_choice", False)),
        exclude_tools_when_tool_choice_none=bool(opt("exclude_tools_when_tool_choice_none", False)),
        loras=ServedLoRAs(list(names)),
    )
    if engine.get_tokenizer() is None:  # --skip-tokenizer-init: token ids in and out (completions only)
        for flag in ("tool_call_parser", "chat_template"):
            if opt(flag):
                raise ValueError(
                    f"--{flag.replace('_', '-')} needs the tokenizer, which --skip-tokenizer-init leaves out."
                )
    if opt("reasoning_parser"):  # ValueError (the server does not start) when the tags are not tokens
        state.reasoning_parser = reasoning_parser(opt("reasoning_parser"), engine.get_tokenizer())
        state.reasoning_keeps_special_tokens = tags_are_special(state.reasoning_parser, engine.get_tokenizer())
    middlewares = [_error_middleware]
    root_path = (opt("root_path") or "").rstrip("/")
    api_key = opt("api_key")
    if api_key:
        middlewares.insert(0, _auth_middleware(api_key, root_path))
    cors = _Cors(
        opt("allowed_origins") or ["*"],
        opt("allowed_methods") or ["*"],
        opt("allowed_headers") or ["*"],
        bool(opt("allow_credentials", False)),
    )
    middlewares.insert(0, cors.preflight)  # outermost, as vLLM's CORSMiddleware: before the API-key check
    # aiohttp refuses bodies past client_max_size itself; read_body turns that into our 413.
    app = web.Application(middlewares=middlewares, client_max_size=limits.max_body_bytes)
    app.on_response_prepare.append(cors.add_headers)  # every response, streamed and error ones included
    app.on_response_prepare.append(set_server_header)
    app[STATE] = state
    app.on_startup.append(_analyse_tokenizer)
    app.on_cleanup.append(_stop_workers)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/v1/embeddings", create_embedding)
    app.router.add_get("/v1/responses/{response_id}", response_not_found)
    app.router.add_post("/v1/responses/{response_id}/cancel", response_not_found)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    if opt("allow_runtime_lora_updating", False):
        logger.warning(
            "LoRA dynamic loading & unloading is enabled in the API server. This should ONLY be used "
            "for local development!"
        )
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    if opt("lora_modules"):  # loaded before the server answers; one that fails stops it (vLLM)
        modules = list(opt("lora_modules"))
        app.on_startup.append(lambda a: load_static(a[STATE], modules))
    if os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0"):  # vLLM's development routes
        logger.warning("SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!")
        app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
        app.router.add_post("/sleep", sleep)
        app.router.add_post("/wake_up", wake_up)
        app.router.add_get("/is_sleeping", is_sleeping)
    if state.profile_dir:
        app.router.add_post("/start_profile", start_profile)
        app.router.add_post("/stop_profile", stop_profile)
    if not opt("disable_log_stats", False):
        interval = float(opt("log_stats_interval", 10.0) or 10.0)
        app.on_startup.append(lambda a: _start_stats(a, interval))
        app.on_cleanup.append(_stop_stats)
    if root_path:  # vLLM's --root-path (a proxy's prefix): every route under it too, as Starlette routes it
        for route in list(app.router.routes()):
            info = route.resource.get_info() if route.resource is not None else {}
            path = info.get("path") or info.get("formatter")
            if path:
                app.router.add_route(route.method, root_path + path, route.handler)
    return app


# ----------------------------------------------------------------------------------------------- middlewares


class _Cors:
    """CORS as vLLM configures Starlette's CORSMiddleware (--allowed-origins / --allowed-methods /
    --allowed-headers / --allow-credentials; by default any origin, method and header), so browser clients
    on another origin can call the API: preflight OPTIONS requests are answered, responses carry
    Access-Control-Allow-Origin."""

    _ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"

    def __init__(self, origins: list[str], methods: list[str], headers: list[str], credentials: bool):
        self.any_origin = "*" in origins
        self.origins = set(origins)
        self.methods = self._ALL_METHODS if "*" in methods else ", ".join(m.upper() for m in methods)
        self.any_header = "*" in headers
        self.headers = ", ".join(
            sorted(
                {"accept", "accept-language", "content-language", "content-type"} | {h.lower() for h in headers} - {"*"}
            )
        )
        self.credentials = credentials

    def _allow_origin(self, origin: str, headers) -> bool:
        if not (self.any_origin or origin in self.origins):
            return False
        if self.any_origin and not self.credentials:
            headers["Access-Control-Allow-Origin"] = "*"
        else:
            headers["Access-Control-Allow-Origin"] = origin
            headers.add("Vary", "Origin")
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return True

    @web.middleware
    async def preflight(self, request: web.Request, handler):
        origin = request.headers.get("Origin")
        if request.method != "OPTIONS" or origin is None or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        resp = web.Response(status=200, text="OK")
        if not self._allow_origin(origin, resp.headers):
            return web.Response(status=400, text="Disallowed CORS origin")
        resp.headers["Access-Control-Allow-Methods"] = self.methods
        requested = request.headers.get("Access-Control-Request-Headers")
        resp.headers["Access-Control-Allow-Headers"] = requested if self.any_header and requested else self.headers
        resp.headers["Access-Control-Max-Age"] = "600"
        return resp

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and "Access-Control-Allow-Origin" not in response.headers:  # preflights have it
            self._allow_origin(origin, response.headers)


def _auth_middleware(api_key: str | list[str], root_path: str = ""):
    """/v1/* (also under --root-path) needs 'Authorization: Bearer <key>' with one of the keys (vLLM's --api-key
    takes several)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key)
    expected = [f"Bearer {k}".encode() for k in keys]

    @web.middleware
    async def auth(request: web.Request, handler):
        path = request.path
        if root_path and path.startswith(root_path + "/"):
            path = path[len(root_path) :]
        if request.method != "OPTIONS" and path.startswith("/v1"):
            given = request.headers.get("Authorization", "").encode()
            if not any([hmac.compare_digest(given, e) for e in expected]):  # every key compared: no early exit
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return auth


@web.middleware
async def _error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        resp = web.json_response(e.body(), status=e.status, headers=e.headers)
        if e.close:
            resp.force_close()
            if e.status == 408:  # the client stopped sending: close now, not after aiohttp lingers for the rest
                await resp.prepare(request)
                await resp.write_eof()
                request.protocol.force_close()
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.json_response(error_body(e.reason or str(e), e.status), status=e.status)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(error_body(f"Internal error: {type(e).__name__}: {e}", 500), status=500)


# ----------------------------------------------------------------------------------------------- small routes


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine.errored or state.admission.draining:  # load balancers: send no more requests here
        return web.Response(status=503)
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": jaxllm.__version__})


def _card(state: ServerState, name: str) -> ModelCard:
    lora = state.loras.get(name) if name not in state.served_model_names else None
    if lora is not None:  # vLLM's adapter card: its folder as root, the base model it adapts as parent
        return ModelCard(
            id=name,
            created=state.created,
            root=lora.lora_path,
            parent=lora.base_model_name or state.model_name,
            max_model_len=state.engine.max_model_len,
        )
    return ModelCard(
        id=name, created=state.created, root=state.model_root, parent=None, max_model_len=state.engine.max_model_len
    )


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    names = state.served_model_names + list(state.loras.requests)
    return web.json_response(text=ModelList(data=[_card(state, n) for n in names]).to_json())


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name not in state.served_model_names and state.loras.get(name) is None:
        raise model_not_found(name)
    return web.json_response(text=_card(state, name).to_json())


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await read_body(request, state.limits.max_body_bytes, state.limits.timeout_request_body)
    return web.json_response(text=await state.workers.run(_tokenize, state, raw, size=len(raw)))


def _tokenize(state: ServerState, raw: bytes) -> str:
    """The /tokenize response (in a worker thread). A text longer than the context is counted, as vLLM does,
    unless it cannot fit the context at all (server.prompt_bound)."""
    req = parse_model(TokenizeRequest, parse_json(raw), sliced=("messages",))
    log_ignored_fields(req, "/tokenize")
    state.check_model(req.model)
    state.need_tokenizer("/tokenize and /detokenize")
    if (req.prompt is None) == (req.messages is None):
        raise APIError("Send exactly one of `prompt` or `messages`.")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = encode(state, req.prompt, add_special, param="prompt", generating=False)
    else:
        ids = rendered_ids(state, req, tools=template_tools(req.tools))
    body = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = state.engine.get_tokenizer().convert_ids_to_tokens(ids)
    return json.dumps(body)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await read_body(request, state.limits.max_body_bytes, state.limits.timeout_request_body)
    return web.json_response(text=await state.workers.run(_detokenize, state, raw, size=len(raw)))


def _detokenize(state: ServerState, raw: bytes) -> str:
    req = parse_model(DetokenizeRequest, parse_json(raw))
    log_ignored_fields(req, "/detokenize")
    state.check_model(req.model)
    state.need_tokenizer("/tokenize and /detokenize")
    bad = [t for t in req.tokens if not 0 <= t < state.engine.vocab_size]
    if bad:
        raise APIError(
            f"Token id {bad[0]} is out of vocabulary (vocab size {state.engine.vocab_size}).", param="tokens"
        )
    return json.dumps({"prompt": state.engine.get_tokenizer().decode(req.tokens)})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _maybe_await(value) -> None:
    if inspect.isawaitable(value):
        await value


async def start_profile(request: web.Request) -> web.Response:
    state = request.app[STATE]
    os.makedirs(state.profile_dir, exist_ok=True)
    logger.info("Starting profiler; traces go to %s", state.profile_dir)
    try:
        await _maybe_await(state.engine.start_profile(state.profile_dir))
    except RuntimeError as e:  # e.g. a profile is already running
        raise APIError(str(e)) from None
    return web.Response(status=200)


async def stop_profile(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        await _maybe_await(state.engine.stop_profile())
    except RuntimeError as e:  # e.g. no profile is running
        raise APIError(str(e)) from None
    logger.info("Profiler stopped; view with: tensorboard --logdir %s (or xprof)", state.profile_dir)
    return web.Response(status=200)


async def _engine_op(request: web.Request, name: str, *args):
    """The engine's sleep-mode / cache operation name(*args): a 400 naming why it cannot (not enabled, requests
    running, data-parallel replicas)."""
    op = getattr(request.app[STATE].engine, name, None)
    if op is None:
        raise APIError(f"{name} is not supported by this engine (data-parallel replicas).")
    try:
        return await op(*args)
    except ValueError as e:
        raise APIError(str(e)) from None


async def reset_prefix_cache(request: web.Request) -> web.Response:
    await _engine_op(request, "reset_prefix_cache")
    return web.Response(status=200)


async def sleep(request: web.Request) -> web.Response:
    """POST /sleep?level=1 (VLLM_SERVER_DEV_MODE=1; the server needs --enable-sleep-mode)."""
    level = request.query.get("level", "1")
    if not level.isdigit():
        raise APIError(f"level must be an integer, got {level!r}.", param="level")
    await _engine_op(request, "sleep", int(level))
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    """POST /wake_up, or /wake_up?tags=weights&tags=kv_cache for a part."""
    tags = request.query.getall("tags", None)
    await _engine_op(request, "wake_up", list(tags) if tags else None)
    return web.Response(status=200)


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": bool(await _engine_op(request, "is_sleeping"))})


# ----------------------------------------------------------------------------------------------- stats log


async def _analyse_tokenizer(app: web.Application) -> None:
    """The prompt character bound reads the whole vocabulary (half a second for 150k tokens): in a thread."""
    state = app[STATE]
    if state.engine.get_tokenizer() is None:  # --skip-tokenizer-init: prompts are token ids, counted as they come
        return
    state.prompt_bound = await state.workers.run(PromptBound, state.engine.get_tokenizer(), state.engine.max_model_len)
    if state.prompt_bound.chars_per_token is None:
        logger.info(
            "Prompts too long for the context are found by tokenizing them (this tokenizer may drop "
            "characters, so no character-length bound is safe)"
        )


async def _stop_workers(app: web.Application) -> None:
    app[STATE].workers.shutdown()


async def _start_stats(app: web.Application, interval: float) -> None:
    app[_STATS_TASK] = asyncio.create_task(StatsLogger(app[STATE].metrics, interval).run())


async def _stop_stats(app: web.Application) -> None:
    task = app.get(_STATS_TASK)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
