"""The argparse value types of `jaxllm serve`'s flags (server/args.py): vLLM's human-readable integers ("32k",
"32K"), --max-model-len's "auto", a JSON --speculative-config checked before anything loads, counts, seconds,
reasoning parser names. Each raises argparse.ArgumentTypeError, so a bad value is a usage error naming the flag.

Separate from args.py, which declares the flags: these are the checks, shared by its flag groups
(limit_args.py) and by tests.
"""

from __future__ import annotations

import argparse
import json

from jaxllm.engine.cli_args import human_readable_int, max_model_len  # noqa: F401 (this module's types)
from jaxllm.reasoning import REASONING_PARSERS, UNSUPPORTED


def speculative_config(value: str) -> dict:
    """--speculative-config: JSON, checked here so a bad value is a usage error before anything loads."""
    from jaxllm.engine.configs import SpeculativeConfig

    try:
        parsed = json.loads(value)
        SpeculativeConfig.from_value(parsed)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return parsed


def reasoning_parser_name(value: str) -> str:
    if value in UNSUPPORTED:
        raise argparse.ArgumentTypeError(
            f"{value!r} is one of vLLM's reasoning parsers that jaxllm does not "
            f"implement (choose from {', '.join(REASONING_PARSERS)})"
        )
    return value


def count(value: str) -> int:
    n = human_readable_int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a count of at least 1, got {value!r}")
    return n


def seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = -1.0
    if not s >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected seconds (>= 0), got {value!r}")
    return s
