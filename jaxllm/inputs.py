"""vLLM's prompt types (vllm.inputs): what LLM.generate, LLM.beam_search and the engine's add_request take besides a
plain string or a list of token ids. Plain dicts of the same keys work alike."""

from __future__ import annotations

from typing import Any, TypedDict


class _Text(TypedDict):
    prompt: str  # tokenized by the model's tokenizer (its special tokens added)


class TextPrompt(_Text, total=False):
    multi_modal_data: Any  # refused: jaxllm serves text-only models
    mm_processor_kwargs: dict[str, Any] | None
    cache_salt: str  # prefix-cache pages are shared only between requests of the same salt


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_Tokens, total=False):
    prompt: str  # the text those ids came from, returned as RequestOutput.prompt
    token_type_ids: list[int]
    multi_modal_data: Any  # refused, as TextPrompt's
    mm_processor_kwargs: dict[str, Any] | None
    cache_salt: str


SingletonPrompt = str | TextPrompt | TokensPrompt
PromptType = SingletonPrompt

__all__ = ["TextPrompt", "TokensPrompt", "SingletonPrompt", "PromptType"]
