"""Chat messages as chat-template input, shared by LLM.chat() and the server's chat routes."""

from __future__ import annotations

from typing import Any

TEXT_PART_TYPES = ("text", "input_text")


def flatten_content(content: Any) -> str:
    """A message's content as one string: OpenAI content parts (a list of {"type": "text", "text": ...})
    joined with newlines, as vLLM does for text-only models; None is "". Other part types are a ValueError."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"Message content must be a string or a list of content parts, got {type(content).__name__}.")
    texts = []
    for part in content:
        ptype = part.get("type") if isinstance(part, dict) else type(part).__name__
        if ptype not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise ValueError(
                f"Content part type '{ptype}' is not supported by jaxllm (text-only models); send text parts only."
            )
        texts.append(part["text"])
    return "\n".join(texts)
