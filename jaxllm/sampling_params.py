"""SamplingParams: vLLM's per-request generation settings, defaults and validation messages."""

from __future__ import annotations

import copy
import enum
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_GREEDY_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller positive temperatures are raised to it
logger = logging.getLogger("jaxllm")


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's enum)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes (LLM.generate and LLM.chat set this)


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint (json schema, json_object, regex, choice or a Lark /
    GBNF grammar) on a request's output; compiled by the engine (jaxllm/engine/structured.py)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False  # accepted: jaxllm has one backend, so there is nothing to fall back to
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        kinds = {
            k: getattr(self, k)
            for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
            if getattr(self, k) is not None
        }
        _check(
            len(kinds) <= 1,
            f"You can only use one kind of structured outputs constraint but multiple are specified: {kinds}",
        )
        _check(
            len(kinds) == 1,
            f"You must use one kind of structured outputs constraint but none are specified: {self.__dict__}",
        )
        if self.structural_tag is not None:
            self.structural_tag_structures()  # checked here: a bad one is a 400 before the engine sees it
        _check(
            self.json_object in (None, True),
            f"structured_outputs.json_object must be true when given, got {self.json_object!r}.",
        )
        _check(
            self.regex is None or isinstance(self.regex, str),
            f"structured_outputs.regex must be a string, got {self.regex!r:.80}.",
        )
        _check(
            self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
            f"structured_outputs.grammar must be a non-empty string, got {self.grammar!r:.80}.",
        )
        _check(
            self.choice is None
            or (
                isinstance(self.choice, (list, tuple))
                and len(self.choice) > 0
                and all(isinstance(c, str) for c in self.choice)
            ),
            f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r:.80}.",
        )
        _check(
            self.json is None or isinstance(self.json, (str, dict)),
            f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got {self.json!r:.80}.",
        )
        if self.choice is not None:
            self.choice = list(self.choice)

    def structural_tag_structures(self) -> list[tuple[str, str, Any, str]]:
        """structural_tag (vLLM's JSON text: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}) as
        (trigger, begin, schema, end) per structure: free text, except that text from a trigger on must be one of
        the structures (its begin, JSON of its schema, its end). ValueError naming the field if malformed."""
        name = "structured_outputs.structural_tag"
        tag: Any = self.structural_tag
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except json.JSONDecodeError as e:
                raise ParameterError(f"{name} is not valid JSON: {e}", parameter="structural_tag") from None
        _check(isinstance(tag, dict), f"{name} must be a JSON object, got {tag!r:.80}.", "structural_tag")
        _check(
            "format" not in tag,
            f"{name}: the 'format' form (xgrammar's newer structural tags) is not supported by jaxllm; give "
            "'structures' and 'triggers'.",
            "structural_tag",
        )
        structures, triggers = tag.get("structures"), tag.get("triggers")
        _check(
            isinstance(triggers, list) and len(triggers) > 0 and all(isinstance(t, str) and t for t in triggers),
            f"{name} needs 'triggers': a non-empty list of non-empty strings, got {triggers!r:.80}.",
            "structural_tag",
        )
        _check(
            isinstance(structures, list) and len(structures) > 0,
            f"{name} needs 'structures': a non-empty list of {{begin, schema, end}}, got {structures!r:.80}.",
            "structural_tag",
        )
        out: list[tuple[str, str, Any, str]] = []
        for s in structures:
            ok = isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
            _check(
                ok and isinstance(s.get("schema"), (dict, str)), f"{name}: bad structure {s!r:.120}.", "structural_tag"
            )
            trigger: Any = next((t for t in triggers if s["begin"].startswith(t)), None)
            _check(
                trigger is not None,
                f"{name}: structure begin {s['begin']!r} starts with none of the triggers {triggers}.",
                "structural_tag",
            )
            out.append((trigger, s["begin"], s["schema"], s["end"]))
        return out


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before v0.11


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # vLLM's field: None or n (vLLM V1, like jaxllm, samples no extra sequences)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's name before v0.11: moved to structured_outputs
    # jaxllm's, not vLLM's: the caller reads the text only from the finished output (FINAL_ONLY implies it; the
    # server's non-streaming routes set it, as they read every output for metrics). Without stop strings the
    # engine then decodes the tokens once, when the sequence finishes, and earlier outputs carry no text (a DELTA
    # request's finished output carries all of it).
    final_text_only: bool = False
    # Filled by the engine, not by users: EOS ids from generation_config (stop unless ignore_eos).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.") from None
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}.") from None
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.guided_decoding is not None:
            _check(self.structured_outputs is None, "Give structured_outputs or guided_decoding, not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}.",
        )
        if 0 < self.temperature < _MIN_TEMPERATURE:  # vLLM's: raised to 0.01 with a warning (not greedy)
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors nan or inf in tensors. We have "
                "maxed it out to %s.",
                self.temperature,
                _MIN_TEMPERATURE,
                _MIN_TEMPERATURE,
            )
            self.temperature = _MIN_TEMPERATURE
        if self.seed == -1:  # vLLM's: -1 means no seed
            self.seed = None
        self._verify()
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _check_types(self) -> None:
        """Each field's type, before anything reads it: a wrong one (logprobs=1.5, stop=[1], stop_token_ids=5)
        otherwise passed construction and failed the whole batch mid-run with a TypeError."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            _check(
                value is None and name in _OPTIONAL or _is_int(value),
                f"{name} must be an integer, got {value!r}.",
                name,
            )
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            number = _is_int(value) or isinstance(value, (float, np.floating))
            _check(number, f"{name} must be a number, got {value!r}.", name)
        stop = self.stop
        _check(
            stop is None
            or isinstance(stop, str)
            or isinstance(stop, (list, tuple))
            and all(isinstance(x, str) for x in stop),
            f"stop must be a string or a list of strings, got {stop!r}.",
            "stop",
        )
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            _check(
                ids is None or isinstance(ids, (list, tuple)) and all(_is_int(t) for t in ids),
                f"{name} must be a list of integers, got {ids!r}.",
                name,
            )

    def _verify(self) -> None:
        _check(self.n >= 1, f"n must be at least 1, got {self.n}.", "n")  # (types: _check_types)
        if self.best_of is not None:
            _check(
                self.best_of >= self.n,
                f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.",
                "best_of",
            )
            _check(
                self.best_of == self.n,
                f"best_of > n is not supported by jaxllm (as in vLLM V1), got best_of={self.best_of}; use n.",
                "best_of",
            )
        t = self.truncate_prompt_tokens
        _check(
            t is None or t >= 1 or t == -1,
            f"truncate_prompt_tokens must be an integer >= 1 or -1, got {t}",
            "truncate_prompt_tokens",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.",
            "presence_penalty",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
            "frequency_penalty",
        )
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
            "repetition_penalty",
        )
        _check(
            self.temperature >= 0.0 and math.isfinite(self.temperature),
            f"temperature must be non-negative, got {self.temperature}.",
            "temperature",
        )
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        _check(
            self.top_k >= 0,
            f"top_k must be 0 (disable), or at least 1, got {self.top_k}.",
            "top_k",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        _check(
            self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.", "min_tokens"
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
                "min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(value >= -1, f"{name} must be non-negative, got {value}.", name)
        _check(all(s != "" for s in self.stop or ()), "stop cannot contain an empty string.", "stop")
        _check(
            not (self.stop and not self.detokenize),  # stop strings are matched in the detokenized text
            "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
            "stop",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or ()),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}.",
            "stop_token_ids",
        )
        _check(
            all(math.isfinite(v) for v in (self.logit_bias or {}).values()),
            f"logit_bias values must be finite, got {self.logit_bias}.",
            "logit_bias",
        )
        _check(
            self.bad_words is None or all(isinstance(w, str) and w for w in self.bad_words),
            f"bad_words must be a list of non-empty strings, got {self.bad_words!r}.",
            "bad_words",
        )
        if self.allowed_token_ids is not None:
            _check(
                len(self.allowed_token_ids) > 0, "allowed_token_ids is not allowed to be empty.", "allowed_token_ids"
            )
        if self.temperature < _GREEDY_EPS:
            _check(self.n == 1, f"n must be 1 when using greedy sampling, got {self.n}.", "n")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids in the vocabulary, logprob counts within max_logprobs."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                wanted = vocab_size if value == -1 else value
                limit = vocab_size if max_logprobs == -1 else max_logprobs
                asked = f"-1 (the whole vocabulary, {vocab_size} tokens)" if value == -1 else value
                _check(
                    wanted <= limit, f"Requested {name} of {asked}, which is greater than max allowed: {limit}.", name
                )
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            bad = [t for t in ids if not 0 <= t < vocab_size]
            _check(not bad, f"{name} contains out-of-vocab token ids {bad[:5]} (vocab size {vocab_size}).", name)
        bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
        _check(
            not bad, f"logit_bias contains out-of-vocab token ids {bad[:5]} (vocab size {vocab_size}).", "logit_bias"
        )

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "all_stop_token_ids"}


def truncate_prompt_ids(ids: list[int], truncate: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: max_model_len; None: all of it)."""
    if truncate is None:
        return ids
    k = max_model_len if truncate == -1 else truncate
    if k > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len ({max_model_len})."
            " Please, select a smaller truncation size."
        )
    return ids[-k:] if k > 0 else []


_INT_FIELDS = (
    "n",
    "best_of",
    "top_k",
    "seed",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)
_OPTIONAL = ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")


def _is_int(x) -> bool:
    """An integer, Python's or numpy's; not a bool (True would pass as 1)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


class ParameterError(ValueError):
    """A bad request parameter: a ValueError that names its field (vLLM's VLLMValidationError), so the server's
    400 can carry it as the OpenAI error's `param`."""

    def __init__(self, message: str, *, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


def _check(ok: bool, message: str, parameter: str | None = None) -> None:
    if not ok:
        raise ParameterError(message, parameter=parameter)


@dataclass
class BeamSearchParams:
    """vLLM's LLM.beam_search parameters (jaxllm/beam_search.py): beam_width beams kept a step, up to max_tokens
    new tokens each; temperature as in sampling (0: the model's own log-probabilities); length_penalty the exponent
    of the length that divides a beam's summed log-probability in its score."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, f"{name} must be an integer of at least 1, got {value!r}.", name)
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            ok = (_is_int(value) or isinstance(value, (float, np.floating))) and math.isfinite(value)
            _check(ok, f"{name} must be a finite number, got {value!r}.", name)
        _check(self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}.", "temperature")
