"""Incremental detokenization and stop strings, per sequence, on the host.

IncrementalDetokenizer turns appended token ids into text deltas whose concatenation is the decoded output.
Decoding token by token is wrong for byte-level BPE (a character's UTF-8 bytes can span tokens) and for
sentencepiece (a piece's leading space is dropped at the start of a decode, and byte-fallback pieces <0xE4>
carry single bytes). So, as vLLM does, it decodes a short window of tokens twice: the tokens already shown
(prefix_offset..read_offset) and the same plus the new ones (prefix_offset..end); the delta is the second text
minus the first. While the window's text ends in U+FFFD (an incomplete character), nothing is emitted and the
offsets stay, so a replacement char is never shown that a later token turns into a real character; flush()
emits what is still held when the sequence ends, but for a last character that never completed (vLLM's output
never ends in U+FFFD either). The window starts a few tokens into the prompt, so the first
output token decodes in context (sentencepiece keeps its leading space, as vLLM's output text does).

StopChecker finds stop strings in the accumulated output text, truncates it, and says how much of the text is
safe to stream: all but the last max(len(stop)) - 1 characters, which could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token (vLLM: the same)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        """tokenizer: a Hugging Face tokenizer (anything with decode(ids, skip_special_tokens=...,
        clean_up_tokenization_spaces=...)). spaces_between_special_tokens is passed to decode, which honours it
        where the tokenizer implements it."""
        self.tokenizer = tokenizer
        self._kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
            # vLLM's incremental text is never cleaned up: cleanup rewrites across window boundaries.
            "clean_up_tokenization_spaces": False,
        }
        self._fast = _rust_backend(tokenizer)
        context = self._prompt_context(list(prompt_token_ids))
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)
        self.output_token_ids: list[int] = []
        self.text = ""  # output text so far (what append/flush returned, concatenated)
        self.held = 0  # tokens added by hold() that no append/flush has decoded yet

    def _prompt_context(self, prompt: list[int]) -> list[int]:
        """The last few prompt tokens, extended (up to 24) past a leading partial character."""
        for n in range(_PROMPT_CONTEXT, min(len(prompt), 24) + 1):
            if _REPLACEMENT not in self._decode(prompt[-n:]):
                return prompt[-n:]
        return prompt[-_PROMPT_CONTEXT:]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=self._kwargs["skip_special_tokens"])
        try:
            return self.tokenizer.decode(ids, **self._kwargs)
        except TypeError:  # a tokenizer without spaces_between_special_tokens
            self._kwargs.pop("spaces_between_special_tokens", None)
            return self.tokenizer.decode(ids, **self._kwargs)

    def hold(self, token_id: int) -> None:
        """Adds an output token without decoding it: the next append() or flush() decodes it with the tokens after
        it, in one decode of the window. The text is the same as appending them one at a time (tests/
        test_detokenizer.py); the engine holds the tokens of requests that only want their final text."""
        self.output_token_ids.append(token_id)
        self._ids.append(token_id)
        self.held += 1

    def append(self, token_ids: int | Sequence[int]) -> str:
        """Adds output tokens; returns the new text (possibly "")."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.held = 0
        self.output_token_ids.extend(token_ids)
        self._ids.extend(token_ids)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete
        return self._advance(new_text)

    def flush(self) -> str:
        """Text held back by hold(), or because it ended in an incomplete character; call once when the sequence
        ends. A character still incomplete then (max_tokens cut it) is left out, as vLLM's detokenizers never
        emit a text that ends in U+FFFD: the output ends with the last whole character."""
        self.held = 0
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :]).rstrip(_REPLACEMENT)
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._advance(new_text)

    def _advance(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text) :]
        # The next window starts at the first unshown token; drop ids before it so memory stays small.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text += delta
        return delta


def _rust_backend(tokenizer: Any) -> tokenizers.Tokenizer | None:
    """The Rust tokenizer behind a HF fast tokenizer whose decode is the stock one: calling it directly gives
    the same text (cleanup off) without the Python layers, about 10x faster per call."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    stock = getattr(cls.decode, "__qualname__", "") == "PreTrainedTokenizerBase.decode" and getattr(
        cls._decode, "__qualname__", ""
    ) in ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")
    return backend if stock and isinstance(backend, tokenizers.Tokenizer) else None


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string found (CompletionOutput.stop_reason)
    text_end: int  # the output text is text[:text_end]


class _NoText:
    """The detokenizer of an engine without a tokenizer (skip_tokenizer_init): its requests never detokenize."""

    held = 0

    def flush(self) -> str:
        return ""


NO_TEXT = _NoText()


class StopChecker:
    """Stop strings of one sequence. check() after each text delta; visible_text() for streaming."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # Characters that could be the start of a stop string; with the stop string kept in the output nothing
        # needs holding back: text after a match is cut before it is ever streamed.
        self.hold_back = max(map(len, self.stop)) - 1 if self.stop and not include_stop_str_in_output else 0

    def check(self, text: str, num_new_chars: int) -> StopMatch | None:
        """The earliest stop string that ends inside the last num_new_chars characters of text (earlier text
        was checked before), or None."""
        return find_stop(text, num_new_chars, self.stop, self.include_stop_str_in_output)

    def visible_text(self, text: str, finished: bool) -> str:
        """The prefix of text that may be streamed: all of it once finished, else all but hold_back chars."""
        if finished or not self.hold_back:
            return text
        return text[: max(len(text) - self.hold_back, 0)]


def find_stop(
    text: str, num_new_chars: int, stop: Sequence[str], include_stop_str_in_output: bool = False
) -> StopMatch | None:
    """Finds the earliest stop string ending in the new tail of text (ties: the first in `stop`) and where the
    output is cut: before the stop string, or after it with include_stop_str_in_output."""
    if not stop or num_new_chars <= 0:
        return None
    best: tuple[int, int, str] | None = None  # (start, index in stop, string)
    for k, s in enumerate(stop):
        # A match must end in the new text: start at or after len(text) - num_new_chars - len(s) + 1.
        index = text.find(s, max(len(text) - num_new_chars - len(s) + 1, 0))
        if index >= 0 and (best is None or index < best[0]):
            best = (index, k, s)
    if best is None:
        return None
    index, _, s = best
    return StopMatch(s, index + len(s) if include_stop_str_in_output else index)
