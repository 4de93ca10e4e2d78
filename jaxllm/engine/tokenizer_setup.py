"""The tokenizer side of start-up, run on its own thread while jax starts and the engine's shapes are worked out
(setup.build_engine_parts): the config's and the tokenizer's code (trust_remote_code), the tokenizer,
generation_config.json's EOS ids and sampling defaults, and the structured outputs' Grammars.
"""

from __future__ import annotations

import json
import logging
import os

from jaxllm.config import ModelConfig
from jaxllm.engine.args import EngineArgs
from jaxllm.engine.model_files import resolve_tokenizer_dir
from jaxllm.engine.tokenizer_load import check_config_code, load_tokenizer

logger = logging.getLogger("jaxllm")


def tokenizer_parts(args: EngineArgs, path: str, hf: dict):
    """The tokenizer thread's work: the config's and the tokenizer's code (trust_remote_code), the tokenizer,
    generation_config.json's EOS ids and sampling defaults, and the structured outputs' Grammars (whose llguidance
    tokenizer is built on first use: Grammars.tokenizer)."""
    from jaxllm.engine.structured import Grammars
    from jaxllm.reasoning import reasoning_parser

    check_config_code(path, hf, args.trust_remote_code)
    vocab_size = ModelConfig.from_hf(hf, dtype=args.dtype).vocab_size
    if args.skip_tokenizer_init:  # vLLM's: token ids in and out; EOS from config.json and generation_config.json
        if args.reasoning_parser:
            raise ValueError("reasoning_parser needs the tokenizer, which skip_tokenizer_init=True leaves out.")
        config_eos = hf.get("eos_token_id")
        eos, defaults = generation_config(args.generation_config, path, None, args.override_generation_config)
        eos |= set(config_eos if isinstance(config_eos, list) else [] if config_eos is None else [config_eos])
        return None, eos, defaults, None
    tokenizer = load_tokenizer(
        resolve_tokenizer_dir(args, path), trust_remote_code=args.trust_remote_code, tokenizer_mode=args.tokenizer_mode
    )
    if len(tokenizer) > vocab_size:
        logger.warning(
            "The tokenizer has %d tokens, more than the model's vocab_size %d: prompts holding the others are refused.",
            len(tokenizer),
            vocab_size,
        )
    eos, defaults = generation_config(args.generation_config, path, tokenizer, args.override_generation_config)
    # --reasoning-parser: its tags must be tokens of this vocabulary (a ValueError before any weights load)
    reasoning = reasoning_parser(args.reasoning_parser, tokenizer)
    grammars = Grammars(tokenizer, vocab_size, eos, reasoning)
    return tokenizer, eos, defaults, grammars


def generation_config(mode: str, path: str, tokenizer, overrides: dict | None = None) -> tuple[set[int], dict]:
    """EOS ids and default sampling parameters. overrides (vLLM's override_generation_config): merged over the
    file's values with mode "auto" or a path, the only ones with "vllm"."""
    eos: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    eos, defaults = _generation_config_file(mode, path, eos)
    if overrides:
        defaults = {
            **defaults,
            **({"max_tokens": overrides["max_new_tokens"]} if "max_new_tokens" in overrides else {}),
            **{k: v for k, v in overrides.items() if k != "max_new_tokens"},
        }
        logger.info("Default sampling parameters with override_generation_config: %s", defaults)
    return eos, defaults


def _generation_config_file(mode: str, path: str, eos: set[int]) -> tuple[set[int], dict]:
    defaults: dict = {}
    if mode == "vllm":
        return eos, defaults
    gen_path = os.path.join(path if mode == "auto" else mode, "generation_config.json")
    if not os.path.exists(gen_path):
        if mode != "auto":
            raise ValueError(f"generation_config={mode!r}: no generation_config.json there.")
        return eos, defaults
    with open(gen_path) as f:
        gen = json.load(f)
    ids = gen.get("eos_token_id")
    eos |= set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    # As vLLM (ModelConfig.get_diff_sampling_param): the file's values whatever its do_sample says.
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if gen.get(key) is not None:
            defaults[key] = gen[key]
    if gen.get("max_new_tokens"):
        defaults["max_tokens"] = gen["max_new_tokens"]
    if defaults:
        logger.info("Default sampling parameters from generation_config.json: %s", defaults)
    return eos, defaults
