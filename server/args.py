"""Command-line flags of `jaxllm serve` (also `python -m jaxllm.serve`): vLLM's `vllm serve` flags, same names and
defaults.

    parse_args(argv) -> Namespace     server + engine flags, env fallbacks applied
    engine_kwargs(args) -> dict       the LLM(...) keyword arguments for AsyncLLM.from_engine_args
The flags' value types are in arg_types.py, the "limits and timeouts" group in limit_args.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxllm.engine.args import LEGACY_SPEC_ARG_NAMES, legacy_speculative_config
from jaxllm.reasoning import REASONING_PARSERS
from server import arg_types
from server.limit_args import add_limit_args
from server.lora import parse_lora_module, runtime_updating_allowed
from server.tool_parsers import TOOL_PARSERS
from server.vllm_flags import (
    MODEL_SOURCE_ARG_NAMES,
    add_vllm_flags,
    expand_config_file,
    json_object,
    resolve_vllm_flags,
)

API_KEY_ENV_VARS = ("JAXLLM_API_KEY", "VLLM_API_KEY")

# LLM(...) keyword arguments the serve flags map onto (served_model_name stays in the server).
ENGINE_ARG_NAMES = (
    "model",
    "tokenizer",
    "dtype",
    "seed",
    "max_model_len",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "block_size",
    "kv_cache_dtype",
    "load_format",
    "generation_config",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enforce_eager",
    "enable_sleep_mode",
    "runner",
    "convert",
    "task",
    "pooler_config",
    "override_pooler_config",
    "skip_tokenizer_init",
    "max_logprobs",
    "quantization",
    "trust_remote_code",
    "scheduling_policy",
    "enable_expert_parallel",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "lora_dtype",
    "fully_sharded_loras",
    "lora_extra_vocab_size",
    "reasoning_parser",
    "enable_reasoning",
)

# Engine options beyond LLM's documented ones (vLLM has the first two too); passed on only when given.
OPTIONAL_ENGINE_ARG_NAMES = (
    "num_gpu_blocks_override",
    "kv_cache_memory_bytes",
    "attention_backend",
    "compilation_cache_dir",
    "speculative_config",
    *LEGACY_SPEC_ARG_NAMES,
)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxllm serve",
        description="OpenAI-compatible server for jaxllm (vLLM's serving engine on JAX/XLA).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Model directory (HF layout). Without it, the built-in demo model is served.",
    )
    p.add_argument("--model", default=None, help="Same as the positional MODEL.")

    s = p.add_argument_group("server")
    s.add_argument("--host", default=None, help="Host to bind (default: all interfaces).")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model name(s) the API accepts; the first is reported in responses and metrics. Default: the model path.",
    )
    s.add_argument("--chat-template", default=None, help="Chat template: a file path or the template itself.")
    s.add_argument("--response-role", default="assistant", help="Role of generated chat messages.")
    s.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help=f"Require 'Authorization: Bearer <key>' on /v1/* with one of these keys. Falls back to "
        f"${API_KEY_ENV_VARS[0]}, then ${API_KEY_ENV_VARS[1]}.",
    )
    s.add_argument(
        "--root-path",
        default=None,
        help="The path prefix a proxy in front serves this server under (/prefix/v1/...): routes answer under it too.",
    )
    s.add_argument("--allowed-origins", type=json.loads, default=["*"], help="CORS: allowed origins (JSON list).")
    s.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS: allowed methods (JSON list).")
    s.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS: allowed headers (JSON list).")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    s.add_argument(
        "--profile-dir",
        default=None,
        help="Enables POST /start_profile and /stop_profile, writing jax.profiler traces here "
        "(view with TensorBoard or XProf).",
    )
    s.add_argument("--disable-log-stats", action="store_true", help="Do not log the periodic stats line.")
    s.add_argument("--log-stats-interval", type=float, default=10.0, help="Seconds between stats lines.")
    s.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Log each request's prompt and sampling params.",
    )
    s.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="Deprecated; requests are not logged unless --enable-log-requests is given.",
    )
    s.add_argument("--max-log-len", type=int, default=None, help="Max prompt characters in request logs.")
    s.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="Show logprob tokens as 'token_id:N' instead of their text.",
    )
    s.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served.",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let the model call tools on its own (tool_choice "auto", the default when a request has '
        "tools); needs --tool-call-parser.",
    )
    s.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="How the model writes tool calls: hermes (Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.1/3.2), mistral, "
        "pythonic (Llama 3.2 / 4 style [f(a=1)] lists).",
    )
    s.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='Do not show the tools to the chat template when tool_choice is "none".',
    )
    s.add_argument(
        "--max-request-body-bytes",
        type=arg_types.human_readable_int,
        default=64 * 2**20,
        help="Requests with a larger body get 413 (accepts 64M, 1G, ...).",
    )
    s.add_argument("--ssl-keyfile", default=None)
    s.add_argument("--ssl-certfile", default=None)
    s.add_argument(
        "--log-level",
        default=None,
        choices=LOG_LEVELS,
        help="jaxllm's log level (and the HTTP server's unless --uvicorn-log-level is given). Default: "
        "$VLLM_LOGGING_LEVEL, else info.",
    )
    s.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=LOG_LEVELS,
        help="The HTTP server's log level (aiohttp's loggers: access lines, connection errors), as vLLM's sets "
        "uvicorn's. Default: --log-level's.",
    )
    s.add_argument(
        "--disable-access-log",
        "--disable-uvicorn-access-log",
        dest="disable_access_log",
        action="store_true",
        help="Do not log one line per HTTP request.",
    )

    add_limit_args(p)

    e = p.add_argument_group("engine")
    e.add_argument("--tokenizer", default=None, help="Tokenizer directory (default: the model's).")
    e.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Let transformers run the model folder's own tokenizer / config classes (auto_map); the "
        "model itself is always jaxllm's implementation.",
    )
    e.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    e.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="gptq, gptq_marlin, awq, awq_marlin, compressed-tensors or fp8 (default: config.json's "
        "quantization_config; fp8 on a 16-bit checkpoint quantizes its weights while loading).",
    )
    e.add_argument("--seed", type=int, default=0)
    e.add_argument(
        "--max-model-len",
        type=arg_types.max_model_len,
        default=None,
        help="Context length (prompt + output); accepts 32k (32000), 32K (32768). Default: config.",
    )
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    e.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    e.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="Engine replicas, each on its own tensor_parallel_size * pipeline_parallel_size devices of "
        "this host, behind this one server; requests go to the least loaded one.",
    )
    e.add_argument(
        "--data-parallel-size-local",
        "-dpl",
        type=int,
        default=None,
        help="Replicas on this host: all of them (--data-parallel-size), as replicas on other hosts are not supported.",
    )
    e.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="Mixture-of-experts models: split the experts over the tensor-parallel devices (whole "
        "experts per device) instead of each expert's FFN.",
    )
    e.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="Fraction of total device memory for weights, activations and KV cache.",
    )
    e.add_argument("--max-num-seqs", type=int, default=None, help="Max sequences per step (default: by device).")
    e.add_argument(
        "--max-num-batched-tokens",
        type=arg_types.human_readable_int,
        default=None,
        help="Max tokens per step (default: by device).",
    )
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    e.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128])
    e.add_argument(
        "--load-format",
        default="auto",
        help="auto, pt, safetensors, dummy (random weights), gguf (a local .gguf model file).",
    )
    e.add_argument(
        "--generation-config",
        default="auto",
        help="'auto': the model's generation_config.json; 'vllm': ignore it; or a directory.",
    )
    e.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Skip compiling all shape buckets at start-up (compile on first use).",
    )
    e.add_argument(
        "--runner",
        default="auto",
        choices=("auto", "generate", "pooling"),
        help="pooling: serve the model as an embedding model (/v1/embeddings; its last token's hidden state).",
    )
    e.add_argument(
        "--convert",
        default="auto",
        choices=("auto", "none", "embed"),
        help="embed: run a generative model's architecture as an embedding model (as --runner pooling).",
    )
    e.add_argument(
        "--task",
        default="auto",
        choices=("auto", "generate", "embed", "embedding"),
        help="vLLM <= 0.10's: generate, or embed for an embedding model.",
    )
    e.add_argument(
        "--pooler-config",
        type=json_object,
        default=None,
        help='Embedding models: JSON object {"pooling_type": "LAST", "normalize": true} over the model\'s '
        "sentence-transformers pooling files.",
    )
    e.add_argument("--override-pooler-config", type=json_object, default=None, help="vLLM's older --pooler-config.")
    e.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="Load no tokenizer: /v1/completions takes token-id prompts and answers with token ids "
        "(return_token_ids; logprobs as token_id:N), without text; chat, /tokenize and stop strings are refused.",
    )
    e.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="Allow the engine to sleep (weights to host memory, KV cache freed): POST /sleep and /wake_up, "
        "GET /is_sleeping with VLLM_SERVER_DEV_MODE=1.",
    )
    e.add_argument("--max-logprobs", type=int, default=20)
    e.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="fcfs: first come, first served (a request's priority must be 0); priority: lower "
        "priority values run first, then arrival order.",
    )
    e.add_argument(
        "--speculative-config",
        type=arg_types.speculative_config,
        default=None,
        help='Speculative decoding, as JSON (vLLM\'s keys): {"method": "ngram", "num_speculative_tokens": '
        '4, "prompt_lookup_max": 4}, {"model": DRAFT_DIR, "num_speculative_tokens": 4}, '
        '{"method": "eagle3", "model": HEAD_DIR, "num_speculative_tokens": 3}; optional '
        '"disable_by_batch_size".',
    )
    _add_speculative_args(e)
    e.add_argument(
        "--reasoning-parser",
        type=arg_types.reasoning_parser_name,
        default=None,
        choices=list(REASONING_PARSERS),
        help="How the model marks its reasoning: chat responses put it in `reasoning` / "
        "`reasoning_content` instead of `content` (deepseek_r1 for DeepSeek-R1 and its distills, "
        "qwen3 for Qwen3), and a structured-output grammar applies after it. One of "
        f"{', '.join(REASONING_PARSERS)} (jaxllm/reasoning.py says how each reads the output).",
    )
    e.add_argument(
        "--enable-reasoning",
        action="store_true",
        help="vLLM 0.8-0.9's switch, deprecated there: reasoning is on whenever --reasoning-parser is "
        "given, and this flag alone does nothing.",
    )
    lo = p.add_argument_group("LoRA")
    lo.add_argument("--enable-lora", action="store_true", help="Serve LoRA adapters beside the base model.")
    lo.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        help='Adapters to load at start-up: name=path, or \'{"name": ..., "path": ..., '
        '"base_model_name": ...}\'. Requests name an adapter as their model.',
    )
    lo.add_argument("--max-loras", type=int, default=1, help="Adapters one step can run (device slots).")
    lo.add_argument(
        "--max-lora-rank", type=int, default=16, help="Largest adapter rank: 1, 8, 16, 32, 64, 128, 256, 320 or 512."
    )
    lo.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="Adapters kept in host memory (default: --max-loras); others are read from their folder again when used.",
    )
    lo.add_argument(
        "--lora-dtype",
        default="auto",
        choices=["auto", "float16", "bfloat16", "float32"],
        help="The adapters' dtype in the device slots (auto: the model's).",
    )
    lo.add_argument(
        "--fully-sharded-loras",
        action="store_true",
        help="With tensor parallelism, also split the halves of the LoRA matmuls vLLM's default layout replicates.",
    )
    lo.add_argument(
        "--lora-extra-vocab-size",
        type=int,
        default=256,
        help="Deprecated (as in vLLM): adapters that add tokens are refused.",
    )
    e.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="Use exactly this many KV blocks instead of sizing from device memory (tests, CPU).",
    )
    e.add_argument(
        "--kv-cache-memory-bytes",
        type=arg_types.human_readable_int,
        default=None,
        help="KV cache size in bytes (accepts 4G), instead of --gpu-memory-utilization's sizing.",
    )
    e.add_argument("--attention-backend", default=None, choices=["auto", "reference", "pallas"])
    e.add_argument("--compilation-cache-dir", default=None, help="Persistent XLA compilation cache directory.")
    from jaxllm.distributed import add_distributed_args

    add_distributed_args(p)
    p.add_argument(
        "--headless",
        action="store_true",
        help="Run no API server: this process (--process-id > 0, as it is by default) only runs the "
        "engine's steps for process 0, which serves.",
    )
    add_vllm_flags(p)  # vLLM's other flags: honoured, accepted without effect, or refused (server/vllm_flags.py)
    return p


def _add_speculative_args(e) -> None:
    """vLLM 0.8.0's speculative flags, the older form of --speculative-config (which wins when both are given)."""
    e.add_argument(
        "--speculative-model",
        default=None,
        help='Draft model directory, or "[ngram]" for prompt lookup: --speculative-config\'s "model".',
    )
    e.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help='Tokens proposed per step: --speculative-config\'s "num_speculative_tokens".',
    )
    e.add_argument(
        "--ngram-prompt-lookup-max",
        type=int,
        default=None,
        help='With --speculative-model "[ngram]": the longest n-gram looked up ("prompt_lookup_max").',
    )
    e.add_argument(
        "--ngram-prompt-lookup-min",
        type=int,
        default=None,
        help='With --speculative-model "[ngram]": the shortest n-gram looked up ("prompt_lookup_min").',
    )
    e.add_argument(
        "--speculative-draft-tensor-parallel-size",
        "-spec-draft-tp",
        type=int,
        default=None,
        help="The draft model's tensor parallelism, 1 or the target's (\"draft_tensor_parallel_size\").",
    )
    e.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help='No speculation in steps with at least this many sequences ("disable_by_batch_size").',
    )


LOG_LEVELS = ["debug", "info", "warning", "error", "critical", "trace"]
# vLLM's --help groups (its config classes) -> the group of jaxllm's parser that holds their flags
_VLLM_GROUPS = {
    **{
        name.lower(): "engine"
        for name in (
            "ModelConfig", "LoadConfig", "CacheConfig", "ParallelConfig", "SchedulerConfig", "DecodingConfig",
            "StructuredOutputsConfig", "SpeculativeConfig", "DeviceConfig", "CompilationConfig", "VllmConfig",
        )
    },
    "loraconfig": "LoRA",
    "frontend": "server",
    "observabilityconfig": "server",
}  # fmt: skip


def help_topic(parser: argparse.ArgumentParser, topic: str) -> tuple[str, bool]:
    """vLLM's `--help=<topic>`: "listgroup" (the flag groups), "page" (all), a group's title, one flag
    (max-model-len or --max-model-len), else every flag whose name or help has the keyword. (text, found)."""
    topic = topic.strip()
    groups = [g for g in parser._action_groups if g._group_actions]
    if topic == "listgroup":
        names = "\n".join(f"    {g.title}" for g in groups)
        return f"Flag groups (--help=<group> shows one):\n{names}\n", True
    if topic in ("page", "all", ""):
        return parser.format_help(), True

    def section(title: str | None, actions) -> str:
        formatter = parser._get_formatter()
        formatter.start_section(title)
        formatter.add_arguments(actions)
        formatter.end_section()
        return formatter.format_help()

    title = _VLLM_GROUPS.get(topic.lower(), topic)
    group = next((g for g in groups if (g.title or "").lower() == title.lower()), None)
    if group is not None:
        note = "" if title == topic else f"(vLLM's {topic} flags are in jaxllm's {title!r} group)\n"
        return note + section(group.title, group._group_actions), True
    flag = topic if topic.startswith("-") else f"--{topic}"
    exact = [a for a in parser._actions if flag in a.option_strings]
    if exact:
        return section(None, exact), True
    word = topic.lstrip("-").lower()
    found = [
        a
        for a in parser._actions
        if a.option_strings and (any(word in o.lower() for o in a.option_strings) or word in (a.help or "").lower())
    ]
    if found:
        return section(f"flags matching {topic!r}", found), True
    return f"No flag group or flag matches {topic!r}; --help=listgroup lists the groups.\n", False


def parse_args(argv: list[str] | None = None, *, environ=os.environ) -> argparse.Namespace:
    parser = make_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    topic = next((a.split("=", 1)[1] for a in argv if a.startswith("--help=")), None)
    if topic is not None:
        text, found = help_topic(parser, topic)
        (sys.stdout if found else sys.stderr).write(text)
        parser.exit(0 if found else 2)
    args = parser.parse_args(expand_config_file(argv))
    resolve_vllm_flags(parser, args)
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"MODEL given twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model_tag or args.model
    del args.model_tag
    if not args.api_key:
        key = next((environ[v] for v in API_KEY_ENV_VARS if environ.get(v)), None)
        args.api_key = None if key is None else [key]
    if args.disable_log_requests:
        args.enable_log_requests = False
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.ssl_keyfile is not None and args.ssl_certfile is None:  # a certfile alone may hold the key too
        parser.error("--ssl-keyfile needs --ssl-certfile")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0-65535, got {args.port}")
    level = args.log_level or environ.get("VLLM_LOGGING_LEVEL", "").strip().lower() or "info"
    if level not in LOG_LEVELS:
        parser.error(f"VLLM_LOGGING_LEVEL must be one of {LOG_LEVELS}, got {level!r}")
    args.log_level = level
    args.uvicorn_log_level = args.uvicorn_log_level or level
    if args.headless and not (args.num_processes or 0) > 1:
        parser.error(
            "--headless is for the processes other than 0 of a multi-process engine "
            "(--coordinator-address, --num-processes, --process-id)"
        )
    if args.headless and args.process_id == 0:
        parser.error("--headless: process 0 serves the API; start the other processes with --headless")
    if args.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.data_parallel_size_local not in (None, args.data_parallel_size):
        parser.error(
            f"--data-parallel-size-local {args.data_parallel_size_local}: every data-parallel replica runs "
            f"on this host ({args.data_parallel_size}, --data-parallel-size); replicas on other hosts are "
            "not supported"
        )
    if args.speculative_config is None and legacy_speculative_config(vars(args)) is not None:
        from jaxllm.engine.configs import SpeculativeConfig

        try:  # a usage error before anything loads, as --speculative-config's
            SpeculativeConfig.from_value(legacy_speculative_config(vars(args)))
        except ValueError as e:
            parser.error(f"--speculative-model / --num-speculative-tokens: {e}")
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    args.allow_runtime_lora_updating = runtime_updating_allowed(environ)
    if args.allow_runtime_lora_updating and not args.enable_lora:
        parser.error("VLLM_ALLOW_RUNTIME_LORA_UPDATING needs --enable-lora")
    if args.chat_template:  # as vLLM's validate_parsed_serve_args: before the model loads, not after
        from server.serving_chat import load_chat_template

        try:
            load_chat_template(args.chat_template)
        except (ValueError, OSError) as e:
            parser.error(f"--chat-template: {e}")
    return args


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {name: getattr(args, name) for name in ENGINE_ARG_NAMES + MODEL_SOURCE_ARG_NAMES}
    kwargs.update({n: getattr(args, n) for n in OPTIONAL_ENGINE_ARG_NAMES if getattr(args, n, None) is not None})
    return kwargs
