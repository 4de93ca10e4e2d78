"""Reasoning parsers (vLLM's --reasoning-parser): where a thinking model's reasoning ends and its answer begins.

    REASONING_PARSERS: {name: ReasoningParser}       vLLM 0.11's tag-based parsers
    reasoning_parser(name, tokenizer) -> parser      None for no name; ValueError when the tags are not tokens
    parser.split(chat_template_kwargs, closed)       one request's Split: whole(text), stream(text, final)
    parser.prompt_closes_reasoning(tokenizer, ids)   the chat template already ended the reasoning

The server splits a chat completion into reasoning and content (server/reasoning.py); the engine applies a
structured-output grammar only once the reasoning has ended (jaxllm/engine/llm_engine.py), as vLLM does. Both
read the same parser, so `LLM(reasoning_parser=...)` changes structured outputs only, as in vLLM.

What vLLM 0.11's parsers do with a model's text (matched here; token ids are vLLM's, text is ours: the tags must be
single tokens of the vocabulary, as vLLM requires, so both see the same boundaries):
    deepseek_r1, kimi_k2   text before </think> is reasoning, <think> or not (DeepSeek-R1's template puts <think>
                           in the prompt); without </think> everything is reasoning.
    qwen3, glm45           only text between <think> and </think> is reasoning: without both tags (Qwen3 with
                           enable_thinking false) the whole output is content. Streamed, text after <think> is
                           reasoning as it comes, so a stream cut before </think> has sent it as reasoning where
                           the whole response would be content (vLLM does the same).
    seed_oss, minimax_m2   whole: as deepseek_r1 (with <seed:think> tags for seed_oss); streamed: as qwen3.
    deepseek_v3            deepseek_r1 when the request's chat_template_kwargs has thinking true, else all content.
    minimax_m2_append_think  no reasoning: the content is "<think>" + the output.
One rule beyond vLLM's streaming path: when the rendered prompt ends with the end tag (the template closed the
reasoning itself: Qwen3's enable_thinking false, DeepSeek-V3.1 without thinking), the whole output is content,
streamed or not, and a grammar applies from the first token. vLLM does this for tool calls and structured outputs
but not for plain streamed text (where deepseek_r1 would call all of it reasoning); it tests for the end token
anywhere in the prompt, which a multi-turn history that keeps earlier reasoning also has, so here only the
prompt's last token other than whitespace counts.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM 0.11's other parsers, which jaxllm does not implement (not tag-based, or need mistral_common)
UNSUPPORTED = ("ernie45", "granite", "hunyuan_a13b", "mistral", "olmo3", "openai_gptoss", "step3")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    whole_needs_start: bool = False  # non-streamed: without both tags the output is all content (qwen3)
    stream_needs_start: bool = False  # streamed: text before the start tag is content
    extra_tokens: tuple[str, ...] = ()  # other tokens vLLM's parser insists the vocabulary has
    kind: str = "tags"  # "tags" | "deepseek_v3" (tags only with thinking) | "append_think" (no reasoning)

    @property
    def tokens(self) -> tuple[str, ...]:
        return () if self.kind == "append_think" else (self.start, self.end, *self.extra_tokens)

    def split(self, chat_template_kwargs: dict | None = None, closed: bool = False) -> Split:
        """The split of one request's output; closed: the prompt already ended the reasoning."""
        if self.kind == "append_think":
            return Split(self, none=True, prefix="<think>")
        thinking = bool((chat_template_kwargs or {}).get("thinking", False))
        return Split(self, none=closed or (self.kind == "deepseek_v3" and not thinking))

    def end_token_id(self, tokenizer) -> int | None:
        """The token that ends the reasoning, for the engine's grammars (None: a grammar applies at once)."""
        return None if self.kind == "append_think" else tokenizer.get_vocab().get(self.end)

    def prompt_closes_reasoning(self, tokenizer, prompt_ids) -> bool:
        """Whether the prompt's last token that is not whitespace is the end tag (the chat template closed the
        reasoning: the model answers at once)."""
        end = self.end_token_id(tokenizer)
        if end is None:
            return True
        for token in reversed(list(prompt_ids[-16:])):
            if token == end:
                return True
            if tokenizer.decode([token]).strip():
                return False
        return False


@dataclass(frozen=True)
class Split:
    """One request's reading of its output text: whole (the response) or streamed (the text so far)."""

    parser: ReasoningParser
    none: bool = False  # no reasoning: everything is content
    prefix: str = ""  # put before the content (minimax_m2_append_think)

    def whole(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output, as vLLM's extract_reasoning (either may be None)."""
        p = self.parser
        if self.none:
            return None, self.prefix + text
        if p.whole_needs_start and (p.start not in text or p.end not in text):
            return None, text
        before, tag, after = text.partition(p.start)
        rest = after if tag else before
        if p.end not in rest:
            return (None, rest) if p.whole_needs_start else (rest, None)
        reasoning, _, content = rest.partition(p.end)
        return reasoning, content or None

    def stream(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far; each only grows as text does. Until the end tag is seen, a
        trailing piece of text that could begin a tag is held back (unless final)."""
        p = self.parser
        if self.none:
            return "", self.prefix + text
        if not final and p.end not in text:
            text = text[: len(text) - _partial_tag(text, (p.start, p.end))]
        if p.stream_needs_start:
            before, tag, rest = text.partition(p.start)
            if not tag:
                return "", text
            reasoning, end, after = rest.partition(p.end)
            return reasoning, before + after
        reasoning, end, content = text.partition(p.end)
        return reasoning.replace(p.start, "", 1), content


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of text that a tag begins with (and is not the whole tag)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


REASONING_PARSERS: dict[str, ReasoningParser] = {
    p.name: p
    for p in (
        ReasoningParser("deepseek_r1"),
        ReasoningParser("kimi_k2"),  # vLLM registers DeepSeekR1ReasoningParser under this name too
        ReasoningParser("qwen3", whole_needs_start=True, stream_needs_start=True),
        ReasoningParser("glm45", whole_needs_start=True, stream_needs_start=True, extra_tokens=("<|assistant|>",)),
        ReasoningParser("seed_oss", start="<seed:think>", end="</seed:think>", stream_needs_start=True),
        ReasoningParser("minimax_m2", stream_needs_start=True),
        ReasoningParser("deepseek_v3", kind="deepseek_v3"),
        ReasoningParser("minimax_m2_append_think", kind="append_think"),
    )
}


def check_name(name: str | None) -> None:
    """ValueError naming the choices for a parser jaxllm does not have (vLLM's message for an unknown one)."""
    if name and name not in REASONING_PARSERS:
        if name in UNSUPPORTED:
            raise ValueError(
                f"reasoning parser {name!r} (vLLM's) is not supported by jaxllm; it has {', '.join(REASONING_PARSERS)}."
            )
        raise ValueError(f"invalid reasoning parser: {name} (chose from {{ {','.join(REASONING_PARSERS)} }})")


def reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    """The parser called name for this tokenizer; ValueError when the name is unknown or its tags are not tokens
    of the vocabulary (vLLM fails each request then; here the start-up fails, before any weights load)."""
    if not name:
        return None
    check_name(name)
    parser = REASONING_PARSERS[name]
    vocab = tokenizer.get_vocab()
    missing = [t for t in parser.tokens if t not in vocab]
    if missing:
        raise ValueError(
            f"--reasoning-parser {name}: the tokenizer has no {' or '.join(missing)} token, so this "
            "model does not write its reasoning the way this parser reads it (vLLM: reasoning parser "
            "could not locate think start/end tokens in the tokenizer!)."
        )
    return parser


def tags_are_special(parser: ReasoningParser, tokenizer) -> bool:
    """Whether the tags are special tokens, which detokenization drops unless skip_special_tokens is false."""
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.get_vocab()
    return any(vocab.get(t) in special for t in parser.tokens)
