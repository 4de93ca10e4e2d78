"""Loading the tokenizer (and checking the model's config code) the way vLLM does, before any weight loads.

    check_config_code(path, hf, trust_remote_code)   config.json naming its own configuration class (auto_map)
    load_tokenizer(path, trust_remote_code=, tokenizer_mode=) -> tokenizer

trust_remote_code is passed to transformers, which then runs the folder's tokenization_*.py / configuration_*.py
(Baichuan-7B's tokenizer is such a class: a sentencepiece model read by tokenization_baichuan.py, named by auto_map
in tokenizer_config.json). The model itself is always jaxllm's own implementation; its config is read from
config.json. Without the flag, a folder whose config or tokenizer needs its code fails as in vLLM, with vLLM's
message, before weights load or steps compile.
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("jaxllm")

TOKENIZER_MODES = ("auto", "slow")

_TOKENIZER_CODE_MESSAGE = (
    "Failed to load the tokenizer. If the tokenizer is a custom tokenizer not yet available in the HuggingFace "
    "transformers library, consider setting `trust_remote_code=True` in LLM or using the `--trust-remote-code` flag "
    "in the CLI."
)
_CONFIG_CODE_MESSAGE = (
    "Failed to load the model config. If the model is a custom model not yet available in the HuggingFace "
    "transformers library, consider setting `trust_remote_code=True` in LLM or using the `--trust-remote-code` flag "
    "in the CLI."
)


class RemoteCodeError(ValueError, RuntimeError):
    """A folder needs its own code and trust_remote_code is off. vLLM raises RuntimeError for it (transformers a
    ValueError, which jaxllm raises for bad arguments): both catch it."""


def check_config_code(path: str, hf: dict, trust_remote_code: bool) -> None:
    """config.json whose model type transformers does not know and whose auto_map names a configuration class in
    the folder: vLLM (AutoConfig) needs trust_remote_code for it and then runs that code; so does this (jaxllm
    reads the fields from config.json itself, but a folder vLLM refuses, or whose code fails, fails here too)."""
    auto_config = (hf.get("auto_map") or {}).get("AutoConfig")
    if not auto_config:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if hf.get("model_type") in CONFIG_MAPPING_NAMES:
        return  # transformers' own class serves; the folder's code is not needed
    if not trust_remote_code:
        raise RemoteCodeError(
            f"{_CONFIG_CODE_MESSAGE} ({path}/config.json names its configuration class {auto_config!r} in auto_map.)"
        )
    from transformers import AutoConfig

    AutoConfig.from_pretrained(path, trust_remote_code=True)


def load_tokenizer(path: str, *, trust_remote_code: bool = False, tokenizer_mode: str = "auto"):
    """The HF tokenizer of the local folder path. tokenizer_mode "slow": the Python class, as vLLM's
    use_fast=False."""
    if tokenizer_mode == "auto" and not trust_remote_code:
        tokenizer = _load_generic_tokenizer(path)
        if tokenizer is not None:
            return tokenizer
    from transformers import AutoTokenizer

    kwargs = {"use_fast": False} if tokenizer_mode == "slow" else {}
    try:
        # trust_remote_code=False, not None: None makes transformers ask on stdin (and wait 15 s for an answer)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=bool(trust_remote_code), **kwargs)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise RemoteCodeError(
            f"{_TOKENIZER_CODE_MESSAGE} ({path}/tokenizer_config.json names {_tokenizer_auto_map(path)!r} in auto_map.)"
        ) from e
    if not getattr(tokenizer, "is_fast", True):
        logger.warning(
            "Using a slow tokenizer (%s). This might cause a significant slowdown. Consider using a fast "
            "tokenizer instead.",
            type(tokenizer).__name__,
        )
    return tokenizer


def _tokenizer_auto_map(path: str):
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return (json.load(f).get("auto_map") or {}).get("AutoTokenizer")
    except (OSError, ValueError, AttributeError):
        return None


# tokenizer_config.json classes that name the generic Rust-backed tokenizer (v5 spells it TokenizersBackend and keeps
# PreTrainedTokenizerFast as its alias), and config.json model types for which AutoTokenizer honours that class
# as is: no tokenizer class of their own in transformers' TOKENIZER_MAPPING (unlike e.g. qwen2, which it swaps
# for Qwen2Tokenizer, or mistral, MistralCommonBackend where mistral-common is installed).
_GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_GENERIC_TOKENIZER_MODEL_TYPES = ("llama",)


def _load_generic_tokenizer(path: str):
    """The tokenizer AutoTokenizer.from_pretrained(path) gives, built directly, where path is a local folder whose
    tokenizer_config.json names the generic fast class (Llama-3's layout); None elsewhere.

    AutoTokenizer picks the class from the model's config (AutoConfig, then the model type's tables); in
    transformers 5 that chain imports torch, torch._dynamo and torch.distributed.tensor when torch is installed:
    1.5-2.3 s more than this direct load on a 2-core VM (5.23: 3.4 vs 1.05 s, torch never imported; 5.17: 3.8 vs
    2.3 s, its tokenizer module imports torch itself), and slower still while holding the GIL against the weight
    load and warm-up on the main thread: there, with a 128256-token vocabulary, the server and LLM() waited
    1.8-3.5 s for the tokenizer after warm-up (5.23, CPU), and none with this load.
    """
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            tok_cfg = json.load(f)
        with open(os.path.join(path, "config.json")) as f:
            model_cfg = json.load(f)
    except (OSError, ValueError):  # a Hub id, a folder without these files, or broken JSON: AutoTokenizer decides
        return None
    if not (
        isinstance(tok_cfg, dict)
        and isinstance(model_cfg, dict)
        and tok_cfg.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
        and model_cfg.get("model_type") in _GENERIC_TOKENIZER_MODEL_TYPES
        and "auto_map" not in tok_cfg
        and "auto_map" not in model_cfg
        and os.path.isfile(os.path.join(path, "tokenizer.json"))
    ):
        return None
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:  # the class choice above is transformers 5's
        return None
    return transformers.PreTrainedTokenizerFast.from_pretrained(path)
