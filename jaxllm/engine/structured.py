"""Structured outputs: JSON schema, any JSON object, regex, choice and Lark / GBNF grammars, through llguidance.

Why llguidance (vLLM's "guidance" backend) and not xgrammar: it is one self-contained wheel with no
dependencies, where xgrammar needs torch (jaxllm needs torch only to read .bin checkpoints); it takes all of
vLLM's constraint kinds, GBNF included; and a next-token mask costs ~25 us per sequence (median; 0.1-0.5 ms
worst case) for a 128k vocabulary on one CPU core, filled for a whole batch on a thread pool.

Data flow, per sequence of a constrained request:
  add_request: Grammars.compile(params) -> grammar text (a ValueError names the field if it does not compile);
               one LLMatcher per sequence; its first mask
  each token:  Grammars.consume(every advanced sequence's (matcher, token)), then Grammars.fill(them) writes each
               one's next-token mask into seq.token_bitmask ([W] int32: token t allowed iff bit t % 32 of word
               t // 32); both on llguidance's thread pool
  each step:   the runner stacks the constrained rows into SamplingMetadata.token_bitmask [Bc, W] and the sampler
               sets every other token's logit to -inf (sampler.py).
A mask needs the sequence's previous token: llm_engine prepares each step and dispatches its model part while
the one before runs, then waits for that step's tokens to advance the matchers and refresh the masks before
the step's sampling is dispatched, so that wait and update overlap the model (its module docstring,
runner.launch).
When the grammar is complete, the mask allows only the EOS tokens.
JSON schemas are compiled strict (strict_json_schema): no keys or items the schema does not name, as xgrammar,
vLLM's default backend, compiles them; a request's disable_additional_properties goes further, as vLLM's guidance
backend reads it (every object schema, bare ones too).
With a reasoning parser (EngineArgs.reasoning_parser, as vLLM's --reasoning-parser), the grammar applies only after
the model's reasoning: until the token that ends it (</think>) a constrained sequence's mask allows every token and
its matcher is not fed; the grammar starts with the token after it. A prompt whose template already closed the
reasoning (jaxllm/reasoning.py) constrains from the first token.
"""

from __future__ import annotations

import functools
import json
import logging
import threading

import numpy as np

from jaxllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@functools.cache
def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as e:
        raise ValueError("Structured outputs need the llguidance package (pip install llguidance).") from e
    from importlib.metadata import version

    installed = version("llguidance")
    if tuple(int(x) for x in installed.split(".")[:2] if x.isdigit()) < (1, 8):
        # 1.6 takes one EOS token only (a TypeError on start-up); 1.7 lets whitespace_pattern's whitespace repeat
        raise ValueError(
            f"Structured outputs need llguidance >= 1.8 (installed: {installed}); pip install -U llguidance."
        )
    return llguidance


class Grammars:
    """The engine's grammar compiler and mask filler: one llguidance tokenizer (built on first use: ~1 s for a
    128k vocabulary) and one thread pool."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, reasoning=None):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width
        self.reasoning = reasoning  # jaxllm.reasoning.ReasoningParser, or None
        self.reasoning_end = None if reasoning is None else reasoning.end_token_id(tokenizer)
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer = None
        self._error: ValueError | None = None  # why the llguidance tokenizer could not be built (not retried)
        self._executor = None

    @property
    def tokenizer(self):
        """llguidance's tokenizer, built on first use: by the first constrained request, in the engine loop. The
        build holds the GIL throughout (~1 s for a 128k vocabulary, on the 2-core VM), so wherever it runs the
        engine loop waits for it: built on a thread after start-up, it cost the throughput run right after
        LLM() 3% on an H200 (h200_grammar_tokenizer_ab_*.json), and during start-up 1.3-1.7 s of every warm
        start (startup_ab_51be3a6_vs_94e0ead.json), structured outputs or not. A failure is kept and raised
        again (ValueError), not retried."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._tokenizer is None:
                try:
                    self._tokenizer, self._executor = self._build()
                except ValueError as e:
                    self._error = e
                    raise
            return self._tokenizer

    def _build(self):
        llg = _llguidance()
        hf = self._hf_tokenizer
        n_vocab = max(self.vocab_size, len(hf))
        backend = getattr(hf, "backend_tokenizer", None)
        try:
            if backend is not None and backend.padding is None and backend.truncation is None:
                # what llguidance.hf.from_tokenizer does, less its copy of the Rust tokenizer (made to switch
                # padding and truncation off; 0.6 of its 1.6 s for Llama-3's vocabulary)
                tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=self._eos or None)
            else:
                tokenizer = llg.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=self._eos or None)
        except ValueError:  # a decoder llguidance does not read (Metaspace), or a slow tokenizer
            try:
                wrapper = llg.TokenizerWrapper(_PieceTokenizer(hf, self._eos))
                tokenizer = llg.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=self._eos or None)
            except Exception as e:  # noqa: BLE001 - reported to the request that asked
                raise ValueError(f"Structured outputs are not available with this tokenizer: {e}") from e
        return tokenizer, llg.LLExecutor()

    def compile(self, so: StructuredOutputsParams) -> str:
        """so's grammar in llguidance's format; ValueError (naming the field) if it is not valid."""
        llg = _llguidance()
        flexible = {"whitespace_flexible": not so.disable_any_whitespace}
        if so.whitespace_pattern is not None:
            flexible["whitespace_pattern"] = so.whitespace_pattern
        if so.json is not None:
            schema = _schema(so.json, "structured_outputs.json")
            schema = (
                _no_additional_properties(schema) if so.disable_additional_properties else strict_json_schema(schema)
            )
            field, grammar = "json", llg.LLMatcher.grammar_from_json_schema(schema, defaults=flexible)
        elif so.json_object:
            field, grammar = (
                "json_object",
                llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=flexible),
            )
        elif so.regex is not None:
            field, grammar = "regex", llg.grammar_from("regex", ascii_shorthands(so.regex))
        elif so.choice is not None:
            field, grammar = "choice", llg.grammar_from("choice", json.dumps(so.choice))
        elif so.structural_tag is not None:  # free text; from a trigger on, one of the structures (llguidance's)
            tags = [
                llg.StructTag(
                    trigger=t,
                    begin=b,
                    grammar=strict_json_schema(_schema(schema, "structured_outputs.structural_tag: a schema")),
                    end=e,
                )
                for t, b, schema, e in so.structural_tag_structures()
            ]
            field, grammar = "structural_tag", llg.grammar_from("lark", llg.StructTag.to_grammar(tags))
        else:
            try:  # Lark, or GBNF (converted)
                field, grammar = "grammar", llg.grammar_from("grammar", so.grammar)
            except ValueError as e:
                raise ValueError(f"structured_outputs.grammar is not valid: {e}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{field} is not valid: {error}")
        return grammar

    def waits_for_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether a constrained request with this prompt reasons first (its grammar starts after reasoning_end)."""
        return self.reasoning_end is not None and not self.reasoning.prompt_closes_reasoning(
            self._hf_tokenizer, prompt_ids
        )

    def allow_all(self) -> np.ndarray:
        """The mask of a sequence that is still reasoning: every token."""
        return np.full((self.vocab_size + 31) // 32, -1, np.int32)

    def matcher(self, grammar: str):
        matcher = _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"Grammar error: {matcher.get_error()}")
        return matcher

    def consume(self, pairs: list) -> list[bool]:
        """Feeds each (matcher, token) pair its token; whether each was allowed (a refused one leaves its matcher
        in an error state). Several go to llguidance's thread pool."""
        if len(pairs) == 1:
            return [pairs[0][0].consume_token(pairs[0][1])]
        return _llguidance().numpy.consume_token_par(self._executor, pairs) if pairs else []

    def fill(self, matchers: list) -> np.ndarray:
        """The next-token masks of these matchers: [len(matchers), ceil(vocab_size / 32)] int32, filled on
        llguidance's thread pool."""
        llg = _llguidance()
        masks = llg.numpy.allocate_token_bitmask(len(matchers), self.tokenizer.vocab_size)
        llg.numpy.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], masks)
        masks = masks[:, : (self.vocab_size + 31) // 32]
        if self.vocab_size % 32:  # the tokenizer's ids past the model's vocabulary cannot be sampled
            masks[:, -1] &= (1 << self.vocab_size % 32) - 1
        return masks


class _PieceTokenizer:
    """What llguidance's TokenizerWrapper reads, for SentencePiece-style vocabularies whose decoder llguidance's
    own HF reader does not know: each token's bytes from its piece ('▁' is a space, <0xNN> one byte)."""

    def __init__(self, hf, eos: list[int]):
        special = set(hf.all_special_ids)
        self.tokens = []
        for i, piece in enumerate(hf.convert_ids_to_tokens(list(range(len(hf))))):
            if piece is None:
                self.tokens.append(b"")
            elif i not in special and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                self.tokens.append(bytes([int(piece[3:5], 16)]))
            else:
                self.tokens.append(piece.replace("▁", " ").encode())
        self.special_token_ids = sorted(special)
        self.eos_token_id = eos[0] if eos else hf.eos_token_id
        self.bos_token_id = hf.bos_token_id
        self._hf = hf

    def __call__(self, text: str) -> list[int]:
        # The vocabulary's model alone: the full tokenizer would prepend a space ('▁') to the text. A character
        # no token has stops the tokenization there: <unk> would claim to spell it.
        ids = []
        for t in self._hf.backend_tokenizer.model.tokenize(text.replace(" ", "▁")):
            if t.id == self._hf.unk_token_id:
                break
            ids.append(t.id)
        return ids


# \d, \w, \s as ASCII classes (vLLM's default backend, xgrammar, reads them so, as llguidance reads a JSON schema's
# "pattern"); llguidance's own regex syntax takes them as Unicode classes, so a regex "\d{3}" let Arabic-Indic or
# Myanmar digits through. Inside a bracket class the positive ones become ranges; a negated one stays as written.
_SHORTHANDS = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\x0B\\x0C\\r "}


def ascii_shorthands(regex: str) -> str:
    """regex with \\d \\w \\s \\D \\W \\S outside bracket classes, and \\d \\w \\s inside them, as ASCII classes."""
    out, i, depth, first = [], 0, 0, False  # depth: nested bracket classes; first: at a class's first member (a "]"
    # there is a literal)
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            n = regex[i + 1]
            body = _SHORTHANDS.get(n.lower())
            if body is None or (depth and n.isupper()):
                out.append(c + n)
            elif depth:
                out.append(body)
            else:
                out.append(f"[{'^' if n.isupper() else ''}{body}]")
            i, first = i + 2, False
            continue
        if c == "[":  # in llguidance's (Rust) syntax a "[" inside a class opens a nested or POSIX class
            depth, first = depth + 1, True
            out.append(c)
            if regex.startswith("^", i + 1):
                out.append("^")
                i += 1
            i += 1
            continue
        if c == "]" and depth and not first:
            depth -= 1
        first = False
        out.append(c)
        i += 1
    return "".join(out)


def _schema(schema, what: str) -> dict:
    """A JSON schema given as a dict or its JSON text, as a dict; what: the field, named by the ValueError."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{what} must be a JSON schema object, got {type(schema).__name__}.")
    return schema


def _no_additional_properties(schema):
    """vLLM's disable_additional_properties: every object schema without additionalProperties gets false."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


# Keywords whose values are schemas (a dict of them, a list of them, or one), where strict_json_schema looks for
# object and array schemas; every other keyword's value (const, enum, default, examples, required...) is data and
# stays as it is, however much it looks like a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMAS = (
    "additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems", "contains",
    "not", "if", "then", "else", "propertyNames",
)  # fmt: skip


def strict_json_schema(schema, _in_all_of: bool = False):
    """schema as xgrammar compiles it by default (strict_mode=True: vLLM's default backend, "auto", is xgrammar for
    the schemas it takes): an object schema with properties but neither additionalProperties nor
    unevaluatedProperties takes no other keys, and an array schema with prefixItems but neither items nor
    unevaluatedItems no other items. llguidance (jaxllm's backend) allows both unless told, so they are written
    out. Left alone: a bare {"type": "object"} / {"type": "array"} (any object / array, as json_object asks and
    xgrammar's basic rules allow), and a schema beside allOf / anyOf / oneOf / $ref or inside an allOf (keys that
    those add would be refused by a local additionalProperties, which only sees its own properties)."""
    if isinstance(schema, list):  # items as a list (draft 4's tuples)
        return [strict_json_schema(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_json_schema(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_json_schema(v) for v in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [strict_json_schema(v, _in_all_of=True) for v in out["allOf"]]
    for key in _SCHEMAS:
        if key in out:
            out[key] = strict_json_schema(out[key])
    if _in_all_of or any(k in out for k in ("allOf", "anyOf", "oneOf", "$ref")):
        return out
    if (
        ("properties" in out or "patternProperties" in out)
        and "additionalProperties" not in out
        and "unevaluatedProperties" not in out
    ):
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    return out
