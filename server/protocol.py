"""OpenAI (and vLLM-extra) request and response models.

Requests accept unknown fields (they land in `model_extra` and are logged as ignored). Fields that are known
but that jaxllm cannot honour are declared as `Any` and refused with a 400 by the serving code, never ignored.
Responses are dumped with `exclude_unset=True` where OpenAI omits a field (stream deltas), so every field a
chunk must carry (finish_reason, logprobs) is set explicitly by its constructor.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

# Token ids must be real ints: "1" or true are type errors, not token 1.
TokenIds = list[StrictInt]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # vLLM: torch.long's range


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ResponseFormat(OpenAIModel):
    type: str
    json_schema: Any = None
    structures: Any = None  # type "structural_tag" (vLLM's): [{begin, schema, end}]
    triggers: Any = None
    format: Any = None  # structural_tag's newer xgrammar form (refused)


class _SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's and vLLM's extras).

    Sampling knobs default to None so that the engine's generation_config defaults can fill them.
    """

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Seed | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    # Structured outputs (serving_common.structured_outputs reads them; the guided_* fields are vLLM's legacy
    # names; jaxllm has one backend, llguidance, whatever guided_decoding_backend names)
    response_format: ResponseFormat | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    # vLLM's beam search: n beams, scored with length_penalty (jaxllm/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Known fields we cannot honour: refused with 400 when set (see serving_common.reject_unsupported).
    prompt_embeds: Any = None
    logits_processors: Any = None

    # Fields vLLM declares Optional with a default: an explicit null (clients that send every field) means
    # the default there, so it must here too, not a 400.
    _null_means_default: ClassVar[tuple[str, ...]] = ("stream",)

    @model_validator(mode="before")
    @classmethod
    def _nulls_to_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in cls._null_means_default):
            data = {k: v for k, v in data.items() if not (v is None and k in cls._null_means_default)}
        return data


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True
    _null_means_default = ("stream", "echo")


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class FunctionDefinition(OpenAIModel):
    name: StrictStr
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # vLLM extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    include_reasoning: bool = True  # with --reasoning-parser: false leaves the reasoning out (server/reasoning.py)
    _null_means_default = ("stream", "n", "logprobs")
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: TokenIds


# ----------------------------------------------------------------------------------------------- responses


class ResponseModel(BaseModel):
    """Dumped with exclude_unset=True: every field is emitted (nulls included, as OpenAI does) except the
    optional extras listed in `_omit_when_unset`, which appear only when a route sets them."""

    _omit_when_unset: ClassVar[frozenset[str]] = frozenset()

    def model_post_init(self, context: Any) -> None:
        self.__pydantic_fields_set__.update(set(type(self).model_fields) - self._omit_when_unset)

    def to_json(self) -> str:
        return self.model_dump_json(exclude_unset=True)


class PromptTokenUsageInfo(ResponseModel):
    cached_tokens: int | None = None


class UsageInfo(ResponseModel):
    _omit_when_unset = frozenset({"prompt_tokens_details"})
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None  # --enable-prompt-tokens-details


class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    _omit_when_unset = frozenset({"prompt_logprobs", "prompt_token_ids", "token_ids"})


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    _omit_when_unset = frozenset({"usage"})


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(ResponseModel):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    # with --reasoning-parser only (vLLM 0.11.1+ sends both names, server/reasoning.py)
    reasoning: str | None = None
    reasoning_content: str | None = None
    _omit_when_unset = frozenset({"reasoning", "reasoning_content"})


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    _omit_when_unset = frozenset({"token_ids"})


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None
    _omit_when_unset = frozenset({"prompt_logprobs", "prompt_token_ids"})


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    _omit_when_unset = frozenset({"role", "content", "reasoning", "reasoning_content", "tool_calls"})


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    _omit_when_unset = frozenset({"token_ids"})


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    _omit_when_unset = frozenset({"usage"})


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
