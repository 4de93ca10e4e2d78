"""Refusing a prompt that cannot fit the context by its length in characters, before it is tokenized.

Tokenizing costs about a second per million characters here and gigabytes for a 50 MB prompt, all to learn
that it is too long. For most LLM tokenizers a bound is exact and cheap: a tokenizer that keeps every input
character (byte-level BPE; SentencePiece-style BPE with byte fallback) needs one token per at most L
characters, L being its longest token's text (a byte-level token's text is its bytes, and a character is at
least one byte). So a prompt of C characters has at least C / L tokens, and one with C > (max_model_len - 1) * L
cannot leave room for a single output token. Two things can shrink the text before it becomes tokens, and the
bound allows for both: Unicode composition (NFC/NFKC turn at most 4 characters into one, so L is multiplied
by 4 when the normalizer composes) and whitespace that some tokenizers drop or fold into a token (Strip,
whitespace pre-tokenizers, lstrip/rstrip added tokens): only non-space characters are counted.

Any step that can drop other characters (stripping accents, removing control characters, an unknown-character
token that swallows a run, WordPiece's [UNK] for a long word, a precompiled SentencePiece normalizer, a slow
Python tokenizer) disables the bound: such prompts are tokenized in full, as before (in the worker threads).
The analysis reads the tokenizer's pipeline once, then checks it against a few adversarial strings.
"""

from __future__ import annotations

import json
import logging
import math

logger = logging.getLogger("jaxllm.server")

_COMPOSING = 4  # NFC/NFKC: the longest canonical decomposition of one character is 4 characters
_SPACES = "".join(c for c in map(chr, range(0x3001)) if c.isspace())  # all 29 of str.isspace()'s characters

# Components that keep every non-space character (a factor: how many input characters one output character
# can stand for). Anything not listed, or listed as None, may drop characters.
_NORMALIZERS = {
    "NFD": 1,
    "NFKD": 1,
    "NFC": _COMPOSING,
    "NFKC": _COMPOSING,
    "Lowercase": 1,
    "Prepend": 1,
    "Strip": 1,
    "ByteLevel": 1,
}
_PRE_TOKENIZERS = {
    "ByteLevel",
    "Metaspace",
    "Digits",
    "UnicodeScripts",
    "Whitespace",
    "WhitespaceSplit",
    "BertPreTokenizer",
    "FixedLength",
    "Split",
    "Punctuation",
}

# Strings that make a lossy tokenizer show itself: control characters, runs of combining marks, private-use
# and unassigned characters, a long word, composable sequences.
_PROBES = (
    "\x00\x01\x02\x1b\x7f\x80\x9f" * 30,
    "a" + "\u0301" * 200,
    "\ue000\U000f0000\U0010fffd" * 60,
    "x" * 400,
    "e\u0301" * 200,
    "\u1100\u1161\u11a8" * 60,
    "\u200b\u200d\ufeff" * 60,
    "\U0001f600" * 100,
)


def chars_per_token(tokenizer) -> int | None:
    """The most characters (spaces not counted) one token of `tokenizer` can stand for, or None when the
    tokenizer may drop characters (then no character bound is safe)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        factor = _normalizer_factor(_state(backend.normalizer))
        if factor is None or not _pre_tokenizer_ok(_state(backend.pre_tokenizer)):
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        if not _model_ok(backend.model, vocab, _state(backend.pre_tokenizer)):
            return None
        bound = factor * max(len(t) for t in vocab)
    except Exception:  # an unfamiliar tokenizer: no bound rather than a wrong one
        logger.debug("no prompt character bound for this tokenizer", exc_info=True)
        return None
    for probe in _PROBES:
        if len(tokenizer.encode(probe, add_special_tokens=False)) * bound < non_space_len(probe):
            logger.warning(
                "The tokenizer drops characters of %r: over-long prompts are tokenized in full before they are refused",
                probe[:12],
            )
            return None
    return bound


def non_space_len(text: str) -> int:
    return len(text) - sum(text.count(c) for c in _SPACES)


class PromptBound:
    """Refuses texts that cannot fit `max_model_len` tokens; `check` costs nothing for texts that could."""

    def __init__(self, tokenizer, max_model_len: int):
        self.max_model_len = max_model_len
        self.chars_per_token = chars_per_token(tokenizer)

    def too_long(self, text: str, max_tokens: int) -> bool:
        """True when `text` has more than `max_tokens` tokens whatever they are."""
        per = self.chars_per_token
        if per is None or len(text) <= max_tokens * per:
            return False
        return non_space_len(text) > max_tokens * per

    def check(self, text: str, *, param: str | None, generating: bool = True) -> None:
        """Raises the context-length 400 for a text that cannot fit: max_model_len - 1 tokens when generating
        (one token must be left for the output), max_model_len for /tokenize."""
        from server.errors import APIError

        limit = self.max_model_len - 1 if generating else self.max_model_len
        if self.too_long(text, limit):
            m = self.max_model_len
            at_least = math.ceil(non_space_len(text) / self.chars_per_token)
            raise APIError(
                f"This model's maximum context length is {m} tokens. However, your request has at "
                f"least {at_least} input tokens ({len(text)} characters; a token of this tokenizer "
                f"holds at most {self.chars_per_token}). Please reduce the length of the input "
                "messages.",
                param=param,
            )


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_factor(state: dict | None) -> int | None:
    if state is None:
        return 1
    kind = state.get("type")
    if kind == "Sequence":
        factor = 1
        for part in state.get("normalizers", []):
            f = _normalizer_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # " " -> "▁" keeps every character; a pattern replaced by less text does not
        pattern = state.get("pattern", {})
        if "String" in pattern and len(state.get("content", "")) >= len(pattern["String"]):
            return 1
        return None
    if kind == "BertNormalizer":
        return None if state.get("clean_text") or state.get("strip_accents") is not False else 1
    return _NORMALIZERS.get(kind)


def _pre_tokenizer_ok(state: dict | None) -> bool:
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_ok(p) for p in state.get("pretokenizers", []))
    if kind in ("Split", "Punctuation") and str(state.get("behavior", "")).lower() == "removed":
        pattern = state.get("pattern", {})  # only removing spaces is harmless (they are not counted)
        return "String" in pattern and pattern["String"].isspace()
    return kind in _PRE_TOKENIZERS


def _model_ok(model, vocab: dict, pre_tokenizer: dict | None) -> bool:
    """Every character reaches some token: through bytes (byte fallback, or a byte-level alphabet the vocab
    holds in full), or one unknown token per character (never a fused run)."""
    kind = type(model).__name__
    if kind not in ("BPE", "Unigram"):
        return False  # WordPiece and WordLevel turn whole words into one unknown token
    if getattr(model, "byte_fallback", False) and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    if kind == "BPE" and _has_byte_level(pre_tokenizer):
        from tokenizers.pre_tokenizers import ByteLevel

        return all(ch in vocab for ch in ByteLevel.alphabet())
    return kind == "BPE" and model.unk_token is not None and not model.fuse_unk


def _has_byte_level(state: dict | None) -> bool:
    if state is None:
        return False
    if state.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in state.get("pretokenizers", []))
    return state.get("type") == "ByteLevel"
