"""Chat messages as chat-template input, shared by LLM.chat() and the server's chat routes."""

from __future__ import annotations

from typing import Any

TEXT_PART_TYPES = ("text", "input_text")
CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's chat_template_content_format values


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


def template_message(message: Any, content_format: str = "string") -> dict:
    """One chat message as the chat template reads it: its content flattened to a string (content_format "string"
    or "auto": text parts joined with newlines) or as a list of text parts ("openai"). A message without a role is
    a ValueError (vLLM reads message["role"]; silently dropping it lost the user's text from the prompt)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"Each chat message must be a dict with a 'role' string, got {message!r:.120}.")
    raw = message.get("content")
    content: Any = flatten_content(raw)  # (also checks the parts: text only)
    if content_format == "openai":  # each text part as its own part; a string as one; None as none
        parts = raw if isinstance(raw, list) else [] if raw is None else [{"text": raw}]
        content = [{"type": "text", "text": part["text"]} for part in parts]
    return {**message, "content": content}
