"""vLLM's argument-parser entry points for scripts that build an engine from a command line (its examples do):

    parser = FlexibleArgumentParser()          # jaxllm.utils, as vllm.utils
    EngineArgs.add_cli_args(parser)            # every EngineArgs field as --field-name, and vLLM's other engine flags
    args = parser.parse_args()
    llm = LLM(**vars(args))                    # or EngineArgs.from_cli_args(args), LLMEngine.from_engine_args(...)

The flags come from EngineArgs' own fields (name, type, default), so they cannot drift from what LLM() takes;
vLLM's engine flags jaxllm does not implement come from jaxllm/engine/vllm_options.py's table and are parsed only
when given (LLM() then takes them silently, warns or refuses them as the table says, as it does keywords).
`jaxllm serve` has its own parser (server/args.py), with the server's flags and help texts.

Also here: vLLM's human-readable integers ("32k", "32K"), which both parsers read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from dataclasses import MISSING, fields

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
    """--max-model-len: a human-readable integer, or auto / -1 (the model's own length)."""
    if value.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(value)


def _json(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected JSON, got {value!r}: {e}") from None


# vLLM's short forms and the few fields whose value needs more than their type
_ALIASES = {
    "tensor_parallel_size": "-tp",
    "pipeline_parallel_size": "-pp",
    "data_parallel_size": "-dp",
    "quantization": "-q",
}
_TYPES = {"max_model_len": max_model_len, "max_num_batched_tokens": human_readable_int}
_SERVER_ONLY = ("served_model_name", "server_mode")


def _argument(name: str, hint) -> dict[str, typing.Any]:
    """argparse keywords for an EngineArgs field of type hint."""
    if name in _TYPES:
        return {"type": _TYPES[name]}
    args = set(typing.get_args(hint)) or {hint}
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if dict in args:  # JSON text (speculative_config's str is JSON too)
        return {"type": _json}
    if tuple[str, ...] in args or list[str] in args:
        return {"nargs": "+"}
    if bool in args and str in args:  # hf_token: a token, or true (the saved login)
        return {"type": lambda v: {"true": True, "false": False}.get(v.lower(), v)}
    for t in (int, float, str):
        if t in args:
            return {"type": t}
    return {}


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """EngineArgs' fields as --field-name flags with its defaults (dest: the field), and vLLM's other engine
    flags (parsed only when given). Returns the parser, as vLLM's does."""
    from jaxllm.engine.args import EngineArgs
    from jaxllm.engine.vllm_options import VLLM_OPTIONS

    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine arguments (jaxllm.EngineArgs)")
    taken = set()
    for f in fields(EngineArgs):
        if f.name in _SERVER_ONLY:
            continue
        factory: typing.Any = f.default_factory
        default = f.default if f.default is not MISSING else factory()
        flags = [f"--{f.name.replace('_', '-')}"] + ([_ALIASES[f.name]] if f.name in _ALIASES else [])
        group.add_argument(*flags, dest=f.name, default=default, **_argument(f.name, hints[f.name]))
        taken.add(f.name)
    for option in VLLM_OPTIONS:
        if option.scope != "engine" or option.dest in taken:
            continue
        shape: dict[str, typing.Any] = (
            {"action": "store_true"} if option.arity == "bool" else {"nargs": "+"} if option.arity == "values" else {}
        )
        group.add_argument(
            option.flag, *option.aliases, dest=option.dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **shape
        )
        taken.add(option.dest)
    return parser


def from_cli_args(args: argparse.Namespace):
    """EngineArgs from a namespace add_cli_args' flags filled (other attributes, the script's own, are left)."""
    from jaxllm.engine.args import EngineArgs
    from jaxllm.engine.vllm_options import BY_KEYWORD

    names = {f.name for f in fields(EngineArgs)}
    values = {k: v for k, v in vars(args).items() if k in names or k in BY_KEYWORD}
    return EngineArgs.from_kwargs(**values)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's FlexibleArgumentParser: an ArgumentParser that also takes flags spelled with underscores
    (--max_model_len as --max-model-len)."""

    def parse_known_args(self, args=None, namespace=None):  # parse_args goes through here
        argv = list(sys.argv[1:] if args is None else args)
        out = []
        for a in argv:
            if a.startswith("--") and len(a) > 2:
                flag, eq, value = a.partition("=")
                a = flag.replace("_", "-") + eq + value
            out.append(a)
        return super().parse_known_args(out, namespace)
