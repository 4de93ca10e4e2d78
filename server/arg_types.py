"""The argparse value types of `jaxllm serve`'s flags (server/args.py): vLLM's human-readable integers ("32k",
"32K"), --max-model-len's "auto", a JSON --speculative-config checked before anything loads, counts, seconds,
reasoning parser names. Each raises argparse.ArgumentTypeError, so a bad value is a usage error naming the flag.

Separate from args.py, which declares the flags: these are the checks, shared by its flag groups
(limit_args.py) and by tests.
"""

from __future__ import annotations

import argparse
import json
import re

from jaxllm.reasoning import REASONING_PARSERS, UNSUPPORTED

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """'32k' -> 32000, '32K' -> 32768, '1.5m' -> 1500000, '4096' -> 4096 (vLLM's convention)."""
    value = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m:
        number, suffix = m.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        try:
            return int(number) * _BINARY[suffix]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"decimals are not allowed with binary suffixes like {suffix}; did you mean {number}{suffix.lower()}?"
            ) from None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 32k or 32K, got {value!r}") from None


def max_model_len(value: str) -> int | None:
    if value.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(value)


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
