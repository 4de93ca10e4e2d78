"""The serve parser's side of jaxllm/engine/vllm_options.py: every `vllm serve` flag of vLLM 0.8-0.11 parses.

add_vllm_flags(parser)             vLLM's model-source flags jaxllm honours (revision, download dir, ...),
                                   then one argument per table row jaxllm does not implement, and --no-X
                                   for vLLM's boolean flags
expand_config_file(argv) -> argv   --config FILE.yaml: its options before the command line's (which win)
resolve_vllm_flags(parser, args)   after parsing: one warning per IGNORED flag given, parser.error for a
                                   REFUSED one, vLLM's multi-node flags onto jaxllm's multi-host ones
flags_markdown(parser) -> str      server/VLLM_FLAGS.md (`python -m server.vllm_flags > server/VLLM_FLAGS.md`)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jaxllm.engine.vllm_options import BY_FLAG, HONOURED, REFUSED, SAME, VLLM_OPTIONS

logger = logging.getLogger("jaxllm.server")

# Honoured engine flags defined here (not in server/args.py's engine group); engine_kwargs passes them on.
MODEL_SOURCE_ARG_NAMES = (
    "revision",
    "code_revision",
    "tokenizer_revision",
    "download_dir",
    "hf_token",
    "tokenizer_mode",
    "ignore_patterns",
    "hf_overrides",
    "override_generation_config",
    "rope_scaling",
    "rope_theta",
)
_UNIMPLEMENTED_GROUP = "vLLM flags jaxllm does not implement"


def json_object(value: str) -> dict:
    """A JSON object flag (--hf-overrides '{"rope_theta": 1e6}')."""
    try:
        obj = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r} ({e})") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return obj


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model source (vLLM's flags)")
    m.add_argument("--revision", default=None, help="Branch, tag or commit of a Hub model id.")
    m.add_argument("--code-revision", default=None, help="Revision of a Hub model's code (comes with the snapshot).")
    m.add_argument("--tokenizer-revision", default=None, help="Revision of a Hub tokenizer id (default: --revision).")
    m.add_argument(
        "--download-dir",
        default=None,
        help="Where model ids are downloaded (huggingface_hub's cache_dir; default: the HF cache).",
    )
    m.add_argument(
        "--hf-token",
        nargs="?",
        const=True,
        default=None,
        help="Token for private or gated Hub models; alone: the one `huggingface-cli login` saved.",
    )
    m.add_argument(
        "--tokenizer-mode",
        default="auto",
        choices=["auto", "slow", "mistral", "custom"],
        help="auto: the fast tokenizer where there is one; slow: the Python class (use_fast=False). "
        "mistral and custom are refused.",
    )
    m.add_argument(
        "--ignore-patterns",
        nargs="+",
        default=None,
        help='Files of a model id not to download (default: "original/**/*").',
    )
    m.add_argument("--hf-overrides", type=json_object, default=None, help="JSON object set over config.json.")
    m.add_argument(
        "--override-generation-config",
        type=json_object,
        default=None,
        help="JSON object over generation_config.json's sampling defaults, e.g. '{\"temperature\": 0.5}' "
        "(the only defaults with --generation-config vllm).",
    )
    m.add_argument(
        "--rope-scaling",
        type=json_object,
        default=None,
        help="JSON object: config.json's rope_scaling (vLLM's older form of --hf-overrides).",
    )
    m.add_argument(
        "--rope-theta", type=float, default=None, help="config.json's rope_theta (vLLM's older form of --hf-overrides)."
    )
    m.add_argument(
        "--config", default=None, help="A YAML file of flags (keys are flag names without --); the command line's win."
    )
    m.add_argument("--nnodes", "-n", type=int, default=None, help="vLLM's name for --num-processes.")
    m.add_argument("--node-rank", "-r", type=int, default=None, help="vLLM's name for --process-id.")
    m.add_argument("--master-addr", default=None, help="With --master-port: vLLM's name for --coordinator-address.")
    m.add_argument("--master-port", type=int, default=None, help="See --master-addr.")

    g = parser.add_argument_group(
        _UNIMPLEMENTED_GROUP,
        "Accepted so that vLLM command lines run: each one given "
        "is either without effect (one warning says what jaxllm does instead) or "
        "refused before anything loads. server/VLLM_FLAGS.md lists them all.",
    )
    parser.vllm_unimplemented = []  # the rows added here: resolve_vllm_flags reads them back
    for option in VLLM_OPTIONS:
        names = [n for n in (option.flag, *option.aliases) if n not in parser._option_string_actions]
        if option.kind == HONOURED or option.flag not in names:
            continue  # the parser has it (a test checks that no unimplemented row is defined there)
        parser.vllm_unimplemented.append(option)
        shape = {"bool": dict(action=argparse.BooleanOptionalAction), "values": dict(nargs="+")}.get(option.arity, {})
        tag = "refused" if option.kind == REFUSED else "accepted" if option.kind == SAME else "no effect"
        g.add_argument(*names, dest=option.dest, default=None, help=f"[{tag}] {option.message}.", **shape)
    _add_negations(parser)


def _add_negations(parser: argparse.ArgumentParser) -> None:
    """vLLM's boolean flags take --no-X too (BooleanOptionalAction, since 0.9): so do the parser's store_true
    ones that are vLLM flags."""
    for action in list(parser._actions):
        if not isinstance(action, argparse._StoreTrueAction):
            continue
        for flag in [f for f in action.option_strings if f in BY_FLAG]:
            negation = "--no-" + flag[2:]
            if negation not in parser._option_string_actions:
                parser.add_argument(negation, dest=action.dest, action="store_false", help=argparse.SUPPRESS)


def expand_config_file(argv: list[str]) -> list[str]:
    """vLLM's --config FILE: the YAML file's options go before the command line's, so those win. Keys are flag
    names (with - or _); true adds a boolean flag, false its --no- form, lists give several values."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
        elif arg.startswith("--config="):
            path, rest = arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
        else:
            continue
        import yaml

        try:
            with open(path) as f:
                options = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise SystemExit(f"--config {path}: cannot read it as YAML: {e}") from None
        if not isinstance(options, dict):
            raise SystemExit(f"--config {path}: expected a mapping of flag names to values")
        model_first = [a for a in rest[:1] if not a.startswith("-")]
        config_args: list[str] = []
        for key, value in options.items():
            flag = "--" + str(key).replace("_", "-")
            if flag == "--model":
                config_args += [] if model_first else [str(value)]  # the command line's MODEL wins
            elif value is True:
                config_args.append(flag)
            elif value is False:
                config_args.append("--no-" + flag[2:])
            elif isinstance(value, list):
                config_args += [flag, *map(str, value)]
            elif isinstance(value, dict):
                config_args += [flag, json.dumps(value)]
            else:
                config_args += [flag, str(value)]
        return model_first + config_args + rest[len(model_first) :]
    return argv


def resolve_vllm_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Warns once per IGNORED flag given and stops at a REFUSED one (parser.error, exit 2), then drops their
    attributes; maps --nnodes / --node-rank / --master-addr:--master-port onto jaxllm's multi-host flags."""
    if getattr(args, "enable_log_outputs", None) and not args.enable_log_requests:  # vLLM's check and message
        parser.error("--enable-log-outputs requires --enable-log-requests")
    for option in getattr(parser, "vllm_unimplemented", ()):
        value = getattr(args, option.dest)
        delattr(args, option.dest)
        if option.takes(value):
            continue
        if option.kind == REFUSED:
            parser.error(option.describe(value))
        logger.warning(option.describe(value))
    if args.tokenizer_mode in ("mistral", "custom"):
        parser.error(f"--tokenizer-mode {args.tokenizer_mode}: only auto and slow tokenizer modes are supported.")
    for ours, theirs in (("num_processes", "nnodes"), ("process_id", "node_rank")):
        if getattr(args, theirs) is not None and getattr(args, ours, None) is None:
            setattr(args, ours, getattr(args, theirs))
    if args.nnodes is not None and args.node_rank is None and getattr(args, "process_id", None) is None:
        args.process_id = 0  # vLLM's --node-rank default
    if args.master_addr and getattr(args, "coordinator_address", None) is None:
        args.coordinator_address = f"{args.master_addr}:{args.master_port or 29500}"  # torch's default port
    for name in ("nnodes", "node_rank", "master_addr", "master_port", "config"):
        delattr(args, name)


def flags_markdown(parser: argparse.ArgumentParser) -> str:
    """server/VLLM_FLAGS.md: each vLLM flag, what jaxllm does with it, the vLLM releases that have it; then the
    flags of jaxllm's own."""
    kinds = {
        "honoured": "honoured",
        "same": "accepted (jaxllm always does this)",
        "ignored": "accepted, no effect (one warning)",
        "refused": "refused",
    }
    lines = [
        "# `vllm serve` flags in `python -m jaxllm.serve`",
        "",
        "Generated from the parser (`python -m server.vllm_flags > server/VLLM_FLAGS.md`; "
        "tests/test_vllm_flags.py checks it is current). The same names, with underscores, are `LLM()` keyword "
        "arguments where vLLM's EngineArgs has them (scope engine). An accepted value is taken silently.",
        "",
        "| flag | jaxllm | what it does in jaxllm | scope | vLLM |",
        "|---|---|---|---|---|",
    ]
    for option in sorted(VLLM_OPTIONS, key=lambda o: o.flag):
        names = ", ".join(f"`{n}`" for n in (option.flag, *option.aliases))
        if option.kind == HONOURED:
            action = parser._option_string_actions[option.flag]
            what = (action.help or "As in vLLM.").replace("%(default)s", str(action.default))
            if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in (action.help or ""):
                what += f" Default: `{action.default}`."
            what = what.replace("|", "\\|")
        else:
            what = option.message + "."
            if option.accepted:
                what += " Accepted: " + ", ".join(f"`{v}`" for v in option.accepted if v) + "."
        lines.append(f"| {names} | {kinds[option.kind]} | {what} | {option.scope} | {option.versions} |")
    own = sorted(
        {
            a.option_strings[0]
            for a in parser._actions
            if a.option_strings
            and a.help != argparse.SUPPRESS
            and not any(f in BY_FLAG for f in a.option_strings)
            and a.option_strings[0] != "-h"
        }
    )
    lines += ["", "jaxllm's own flags (not vLLM's): " + ", ".join(f"`{f}`" for f in own) + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    from server.args import make_parser

    sys.stdout.write(flags_markdown(make_parser()))
