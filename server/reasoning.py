"""Reasoning in /v1/chat/completions (--reasoning-parser; the parsers are jaxllm/reasoning.py's).

A chat message gets the model's reasoning in `reasoning` and `reasoning_content` (the same text: vLLM 0.11.1+
sends both, `reasoning_content` being the deprecated name 0.8-0.11.0 used alone), and the rest in `content`; a
stream sends `delta.reasoning` / `delta.reasoning_content` pieces, then content pieces, split where the end tag
falls whatever the token boundaries. Tool calls are parsed from the content only. include_reasoning=false
(vLLM's request field) leaves the reasoning out; vLLM 0.11 honours it for whole responses only, here streams
leave it out too. /v1/completions is unaffected, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxllm.reasoning import ReasoningParser, Split


@dataclass
class ReasoningChoice:
    """One request's reasoning split: its Split and what it sends."""

    split: Split
    include: bool = True

    @classmethod
    def for_request(cls, parser: ReasoningParser | None, req, tokenizer, prompt_ids: list[int]):
        """None without a parser; the prompt's tail decides whether the template already closed the reasoning."""
        if parser is None:
            return None
        closed = parser.prompt_closes_reasoning(tokenizer, prompt_ids)
        return cls(parser.split(req.chat_template_kwargs, closed), include=req.include_reasoning is not False)

    def message(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of the whole response."""
        reasoning, content = self.split.whole(text)
        return (reasoning if self.include else None), content


@dataclass
class ReasoningStream:
    """One streamed choice: how much of its reasoning went out."""

    choice: ReasoningChoice
    sent: int = 0

    def step(self, text: str, final: bool) -> tuple[str, str]:
        """(the new reasoning to send, all the content so far)."""
        reasoning, content = self.choice.split.stream(text, final)
        new, self.sent = reasoning[self.sent :], len(reasoning)
        return (new if self.choice.include else ""), content


def reasoning_fields(reasoning: str | None) -> dict[str, Any]:
    """A message's or delta's reasoning fields, as vLLM 0.11.2 sends them."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}
