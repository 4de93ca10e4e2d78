"""What both generation routes share: server state, request checks, sampling params (the engine fan-in is in
fan_in.py, the logprobs shapes in logprobs.py).

A route reads its body on the event loop, then turns it into EngineRequests (prompt token ids +
SamplingParams + engine request id) in a worker thread (`Workers`: JSON decoding, validation, chat
templates and tokenization cost seconds for large requests and must not stall other clients' streams). Then
EngineRunner (fan_in.py), admitted by server.admission, adds them all to the engine and merges their DELTA
RequestOutputs into one ordered event stream.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from jaxllm.engine.protocol import EngineClient
from jaxllm.metrics.prometheus import EngineMetrics
from jaxllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    truncate_prompt_ids,
)
from server.admission import Admission, ServerLimits
from server.errors import APIError, model_not_found
from server.prompt_bound import PromptBound
from server.tool_parsers import ToolParser
from server.workers import Workers

logger = logging.getLogger("jaxllm.server")

MAX_N = 128  # OpenAI's bound on `n`


@dataclass
class ServerState:
    engine: EngineClient
    served_model_names: list[str]
    model_root: str
    metrics: EngineMetrics
    chat_template: str | None = None
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    limits: ServerLimits = field(default_factory=ServerLimits)
    log_requests: bool = False
    max_log_len: int | None = None
    profile_dir: str | None = None
    tool_parser: ToolParser | None = None
    enable_auto_tools: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: Any = None  # jaxllm.reasoning.ReasoningParser (--reasoning-parser), checked against the tokenizer
    reasoning_keeps_special_tokens: bool = False  # its tags are special tokens: chat requests keep them in the text
    created: int = field(default_factory=lambda: int(time.time()))
    workers: Workers = field(default_factory=Workers, repr=False)
    admission: Admission | None = field(default=None, repr=False)
    prompt_bound: PromptBound | None = field(default=None, repr=False)  # set at start-up (reads the tokenizer)
    loras: Any = None  # server.lora.ServedLoRAs: the adapters requests may name as their model
    _defaults: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.admission is None:
            self.admission = Admission(self.limits)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def need_tokenizer(self, what: str, param: str | None = None) -> None:
        """A 400 for what needs the tokenizer when the server runs without one (--skip-tokenizer-init)."""
        if self.engine.get_tokenizer() is None:
            raise APIError(
                f"{what} need the tokenizer, which --skip-tokenizer-init leaves out (completions with token-id "
                "prompts work).",
                param=param,
            )

    def check_model(self, name: str | None) -> tuple[str, Any]:
        """(the model name to report back, the LoRARequest of the adapter it names or None), in the route's
        worker thread with the request's other checks. The base model reports its first served name whichever
        one the request used (vLLM), an adapter its own; an unknown name is a 404 (an absent one means the
        default). One lookup gives both, so an adapter unloaded meanwhile is a 404, never the base model."""
        if not name or name in self.served_model_names:
            return self.model_name, None
        lora = None if self.loras is None else self.loras.get(name)
        if lora is None:
            raise model_not_found(name)
        return name, lora

    def default_sampling(self) -> dict[str, Any]:
        """generation_config defaults the engine exposes, as SamplingParams field names (max_tokens is the
        generation_config's max_new_tokens): request fields left out take these values.

        Optional on the engine: `default_sampling_params` as a dict, or a method returning a dict or a
        SamplingParams (then only the fields that differ from SamplingParams' defaults count)."""
        if self._defaults is None:
            d = getattr(self.engine, "default_sampling_params", None)
            if callable(d):
                d = d()
            if isinstance(d, SamplingParams):
                base = SamplingParams().to_dict()
                d = {k: v for k, v in d.to_dict().items() if k in base and v != base[k]}
            self._defaults = dict(d or {})
            if self._defaults:
                logger.info("Default sampling params from the engine's generation config: %s", self._defaults)
        return self._defaults


STATE = web.AppKey("jaxllm_state", ServerState)


# ------------------------------------------------------------------------------------------ request checks


def log_ignored_fields(req, route: str) -> None:
    extra = req.model_extra or {}
    if extra:
        logger.warning("%s: ignoring unknown request fields %s", route, sorted(extra))


def reject_unsupported(req) -> None:
    """Known fields that would change the output but that jaxllm cannot honour yet: a 400, never ignored; and
    `n` within OpenAI's bound (n=10000 would queue 10,000 sequences ahead of everyone else)."""
    if req.n > MAX_N:
        raise APIError(
            f"Invalid 'n': integer above maximum value. Expected a value <= {MAX_N}, but got {req.n} instead.",
            param="n",
        )
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(
            f"best_of is not supported by jaxllm (got best_of={req.best_of}, n={req.n}); use n.", param="best_of"
        )
    if req.prompt_embeds is not None:
        raise APIError("prompt_embeds is not supported by jaxllm.", param="prompt_embeds")
    if req.logits_processors is not None:
        raise APIError("Custom logits_processors are not supported by jaxllm.", param="logits_processors")
    if req.cache_salt is not None and not req.cache_salt:
        raise APIError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    if req.stream_options is not None and not req.stream:
        raise APIError("Stream options can only be defined when `stream=True`.", param="stream_options")
    if req.stream and req.prompt_logprobs is not None and (req.prompt_logprobs > 0 or req.prompt_logprobs == -1):
        raise APIError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")


def resolve_max_tokens(
    state: ServerState,
    requested: int | None,
    prompt_len: int,
    *,
    prompt_param: str,
    max_tokens_param: str = "max_tokens",
    clamp: bool = False,
) -> int:
    """min(request's limit, room left in the context, generation_config max_new_tokens), after vLLM's checks.
    clamp: a limit past the room left is cut to it instead of refused (vLLM's Responses API)."""
    limit = state.engine.max_model_len
    if prompt_len >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            param=prompt_param,
        )
    if requested is not None and prompt_len + requested > limit and not clamp:
        raise APIError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum "
            f"context length is {limit} tokens and your request has {prompt_len} input tokens "
            f"({requested} > {limit} - {prompt_len}).",
            param=max_tokens_param,
        )
    candidates = [limit - prompt_len]
    if requested is not None:
        candidates.append(requested)
    cap = state.default_sampling().get("max_tokens")
    if cap:
        candidates.append(int(cap))
    return min(candidates)


_LEGACY_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}


def structured_outputs(req) -> StructuredOutputsParams | None:
    """The request's output constraint, as vLLM reads it: `structured_outputs`, else the legacy guided_*
    fields; then response_format json_object / json_schema sets its json_object / json. Grammars are compiled
    (and refused with a 400 if invalid) when the engine adds the request."""
    so = req.structured_outputs
    if so is not None:
        param = "structured_outputs"
        if not isinstance(so, dict):
            raise APIError(f"structured_outputs must be an object, got {type(so).__name__}.", param=param)
        unknown = sorted(set(so) - {f.name for f in dataclasses.fields(StructuredOutputsParams)})
        if unknown:
            raise APIError(f"structured_outputs has unknown fields {unknown}.", param=param)
        kw = dict(so)
    else:
        kw = {key: getattr(req, name) for name, key in _LEGACY_GUIDED.items() if getattr(req, name) is not None}
        param = next((name for name in _LEGACY_GUIDED if getattr(req, name) is not None), None)
        if list(kw) == ["whitespace_pattern"]:  # a whitespace pattern alone constrains nothing
            kw = {}
    rf = req.response_format
    if rf is not None and rf.type != "text":
        param = "response_format"
        if rf.type == "json_object":
            kw["json_object"] = True
        elif rf.type == "json_schema":
            js = rf.json_schema
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if schema is None:
                raise APIError(
                    "response_format of type 'json_schema' needs json_schema.schema (the JSON schema).", param=param
                )
            kw["json"] = schema
        elif rf.type == "structural_tag":  # vLLM's: free text with constrained tool-call tags
            tag = {"structures": rf.structures, "triggers": rf.triggers, "format": rf.format}
            kw["structural_tag"] = json.dumps({k: v for k, v in tag.items() if v is not None})
        else:
            raise APIError(
                f"response_format type '{rf.type}' is not supported; use 'text', 'json_object', 'json_schema' or "
                "'structural_tag'.",
                param=param,
            )
    if not kw:
        return None
    try:
        return StructuredOutputsParams(**kw)
    except (TypeError, ValueError) as e:
        raise APIError(str(e), param=param) from None


def beam_search_params(state: ServerState, req, max_tokens: int) -> BeamSearchParams | None:
    """vLLM's use_beam_search: n beams of up to max_tokens (its to_beam_search_params); None without it."""
    if not req.use_beam_search:
        return None
    if not hasattr(state.engine, "beam_search"):
        raise APIError("Beam search is not supported by this engine (data-parallel replicas).", param="use_beam_search")
    if state.engine.max_logprobs != -1 and 2 * req.n > state.engine.max_logprobs:
        raise APIError(
            f"Beam search with n={req.n} needs 2 * n log-probabilities a step, more than --max-logprobs "
            f"({state.engine.max_logprobs}).",
            param="n",
        )
    temperature = req.temperature if req.temperature is not None else state.default_sampling().get("temperature", 1.0)
    try:
        return BeamSearchParams(
            beam_width=req.n,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            temperature=temperature,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:
        field = getattr(e, "parameter", None)
        raise APIError(str(e), param={"beam_width": "n"}.get(field, field)) from None


def make_sampling_params(
    state: ServerState,
    req,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    constraint: StructuredOutputsParams | None = None,
    param_names: dict[str, str] | None = None,
    beam_search: bool = False,
) -> SamplingParams:
    """SamplingParams from a request; its ValueError (vLLM's messages) becomes the 400's message, naming the
    request field (`param_names`: SamplingParams field -> request field where they differ). `constraint`
    (a tool choice's) replaces the request's own structured outputs."""
    defaults = state.default_sampling()

    def pick(name: str, fallback):
        value = getattr(req, name)
        return defaults.get(name, fallback) if value is None else value

    logit_bias = None
    if req.logit_bias:
        if len(req.logit_bias) > state.engine.vocab_size:  # before a Python loop over a million entries
            raise APIError(
                f"logit_bias has {len(req.logit_bias)} entries, but the vocabulary has only "
                f"{state.engine.vocab_size} tokens.",
                param="logit_bias",
            )
        try:
            logit_bias = {int(k): max(-100.0, min(100.0, float(v))) for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError("logit_bias keys must be token ids (integers as strings).", param="logit_bias") from None
    try:
        params = SamplingParams(
            n=req.n,
            temperature=1.0 if beam_search else pick("temperature", 1.0),  # (beam search: n beams, not samples)
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=logit_bias,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            structured_outputs=constraint or structured_outputs(req),
            # Each output carries only what is new (vLLM's OpenAI server asks for DELTA too); fan_in.ChoiceState
            # joins them, streaming or not.
            output_kind=RequestOutputKind.DELTA,
            # A whole response reads the finished output's text alone: tool calls, reasoning and echo are parsed
            # from it, logprobs name tokens by id (per_token.logprob_dict). Streams need the text as it grows.
            final_text_only=not req.stream,
        )
        params.verify_for_model(state.engine.vocab_size, state.engine.max_logprobs)
    except ValueError as e:
        field_name = getattr(e, "parameter", None)
        raise APIError(str(e), param=(param_names or {}).get(field_name, field_name)) from None
    return params


def encode(
    state: ServerState,
    text: str,
    add_special_tokens: bool,
    *,
    param: str,
    truncating: bool = False,
    generating: bool = True,
) -> list[int]:
    """Token ids of `text` (call it in a worker thread). A text that cannot fit the context is refused by its
    length before the tokenizer sees it, unless the request truncates it to its last tokens."""
    if state.engine.get_tokenizer() is None:
        raise APIError(
            f"Text prompts need the tokenizer, which --skip-tokenizer-init leaves out: send `{param}` as token ids.",
            param=param,
        )
    if not truncating and state.prompt_bound is not None:
        state.prompt_bound.check(text, param=param, generating=generating)
    return state.engine.get_tokenizer().encode(text, add_special_tokens=add_special_tokens)


def truncate_prompt(ids: list[int], truncate: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: the model's context length)."""
    try:
        return truncate_prompt_ids(ids, truncate, max_model_len)
    except ValueError as e:
        raise APIError(str(e), param="truncate_prompt_tokens") from None


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"Token id {bad[0]} is out of vocabulary (vocab size {vocab_size}).", param="prompt")


class SSE:
    """A text/event-stream response: `data: <json>\\n\\n` events, ending with `data: [DONE]`."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: str) -> None:
        await self.response.write(b"data: " + payload.encode() + b"\n\n")

    async def error(self, err: APIError) -> None:
        await self.send(json.dumps(err.body()))

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()


def log_request(state: ServerState, request_id: str, prompt: str | list, params: SamplingParams) -> None:
    if not state.log_requests:
        return
    shown = prompt if state.max_log_len is None else prompt[: state.max_log_len]
    logger.info("Received request %s: prompt: %r, params: %s", request_id, shown, params)
