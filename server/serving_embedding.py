"""POST /v1/embeddings: OpenAI's Embeddings API on an embedding model (served with --runner pooling, or
--convert / --task embed), as vLLM serves it: each input's embedding (jaxllm/pooling_params.py: the last token's
final-normed hidden state, normalized), as floats or base64 (little-endian float32, what the openai SDK asks for by
default and decodes).

Taken: input (a string, a list of strings, a list of token ids, or a list of those) or vLLM's chat form (messages
through the chat template, with add_generation_prompt, continue_final_message, chat_template, chat_template_kwargs),
encoding_format, dimensions (Matryoshka models), user, and vLLM's truncate_prompt_tokens, add_special_tokens,
normalize, priority and request_id. A generative model answers with a 400 (it has no embeddings), as vLLM's does.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any, Literal

import numpy as np
from aiohttp import web

from jaxllm.pooling_params import PoolingParams
from server.errors import APIError, parse_json, parse_model, read_body
from server.fan_in import EngineRequest, EngineRunner
from server.protocol import ChatMessage, OpenAIModel, random_id
from server.serving_chat import rendered_ids
from server.serving_common import STATE, ServerState, check_token_ids, encode, log_ignored_fields, truncate_prompt


class EmbeddingRequest(OpenAIModel):
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None  # vLLM's chat form: the conversation through the chat template
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # default: True for input, False for messages (vLLM's)
    add_generation_prompt: bool = False  # messages only
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    normalize: bool | None = None
    priority: int = 0
    request_id: str | None = None


async def create_embedding(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await read_body(request, state.limits.max_body_bytes, state.limits.timeout_request_body)
    req, model, requests = await state.workers.run(
        _prepare, state, raw, request.headers.get("X-Request-Id"), size=len(raw)
    )
    async with EngineRunner(state, requests, req.priority) as run:
        await run.start()
        states = await run.run_to_end()
    outputs = [rs.last for rs in states]
    return web.json_response(text=await state.workers.run(_response, req, model, requests, outputs))


def _prepare(state: ServerState, raw: bytes, header_id: str | None) -> tuple[EmbeddingRequest, str, list]:
    req = parse_model(EmbeddingRequest, parse_json(raw))
    log_ignored_fields(req, "/v1/embeddings")
    model, lora = state.check_model(req.model)
    if getattr(state.engine, "pooler", None) is None:
        raise APIError(
            "The model does not support Embeddings API: serve an embedding model with --runner pooling "
            "(or --convert embed).",
            param="model",
        )
    t = req.truncate_prompt_tokens
    if t is not None and t < 1 and t != -1:  # (the offline check's words)
        raise APIError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {t}", param="truncate_prompt_tokens")
    params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    request_id = f"embd-{header_id or req.request_id or random_id('')[1:]}"
    requests = []
    for i, ids in enumerate(_inputs(state, req)):
        requests.append(EngineRequest({"prompt_token_ids": ids}, params, f"{request_id}-{i}", ids, None, lora))
    return req, model, requests


def _inputs(state: ServerState, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, truncated if asked (messages: one input, the rendered conversation)."""
    if (req.input is None) == (req.messages is None):
        raise APIError("Send exactly one of `input` or `messages`.", param="input")
    truncating = req.truncate_prompt_tokens is not None
    if req.messages is not None:
        ids = rendered_ids(state, req, truncating=truncating)
        return [truncate_prompt(ids, req.truncate_prompt_tokens, state.engine.max_model_len)]
    items: list[Any]
    if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)):
        items = [req.input]
    else:
        items = list(req.input)
    if not items:
        raise APIError("input must not be empty.", param="input")
    out = []
    for item in items:
        if isinstance(item, str):
            add_special = req.add_special_tokens is not False
            ids = encode(state, item, add_special, param="input", truncating=truncating, generating=False)
        else:
            check_token_ids(item, state.engine.vocab_size)
            ids = list(item)
        ids = truncate_prompt(ids, req.truncate_prompt_tokens, state.engine.max_model_len)
        if not ids:
            raise APIError("An input cannot be empty.", param="input")
        out.append(ids)
    return out


def _response(req: EmbeddingRequest, model: str, requests: list[EngineRequest], outputs: list) -> str:
    data = []
    for i, out in enumerate(outputs):
        vector = np.asarray(out.outputs.data, np.float32)
        if req.encoding_format == "base64":
            embedding: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode()
        else:
            embedding = vector.tolist()
        data.append({"index": i, "object": "embedding", "embedding": embedding})
    tokens = sum(len(r.prompt_ids) for r in requests)
    return json.dumps(
        {
            "id": requests[0].request_id.rsplit("-", 1)[0],
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
    )
