"""Every `vllm serve` flag of vLLM 0.8-0.11, and what jaxllm does with it: one declarative table.

    VLLM_OPTIONS: tuple[VllmOption, ...]       flag, kind, message, arity, scope, vLLM versions, accepted values
    engine_kwargs_for_llm(kwargs) -> kwargs    LLM(**kwargs): vLLM's keyword arguments, checked against the table

Kinds: HONOURED (jaxllm implements it: the server's parser defines the flag, EngineArgs the keyword); SAME (jaxllm
always behaves as the flag asks: accepted silently); IGNORED (accepted with one warning that says what jaxllm does
instead); REFUSED (an error naming what is not supported, before anything loads). A row's `accepted` values (vLLM's
default and its equivalents, e.g. --data-parallel-size 1) are taken silently whatever the kind. An option given at
no value other than those, or a boolean flag given as false, changes nothing and says nothing.

The flag names are the union of vLLM's EngineArgs.add_cli_args, AsyncEngineArgs, FrontendArgs / make_arg_parser
(vllm/engine/arg_utils.py, vllm/entrypoints/openai/cli_args.py, vllm/entrypoints/cli/serve.py) in the released
0.8.0, 0.8.5, 0.9.0, 0.9.2, 0.10.0, 0.10.2, 0.11.0 and 0.11.2 wheels, read statically (236 flags; `versions`
gives the first and last of those that have the flag). scope "engine": an EngineArgs field, so also an LLM()
keyword; "server": `vllm serve` only. server/vllm_flags.py builds the argparse side and server/VLLM_FLAGS.md, the
table a user reads, from this and the parser.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("jaxllm")

HONOURED, SAME, IGNORED, REFUSED = "honoured", "same", "ignored", "refused"

# What jaxllm does instead (IGNORED), or why the option needs nothing (SAME), or what is missing (REFUSED).
NO_DOCS = "jaxllm serves no /docs, /redoc or /openapi.json routes"
IN_PROCESS = "the engine runs in the server's process"
V2_BLOCKS = "jaxllm's block manager is the V1 one (prefix caching by chained block hashes)"
TOOLS_SHOWN = "tools reach the chat template unless --exclude-tools-when-tool-choice-none"
REQUEST_TEMPLATES = "a request's chat_template is used as given"
OVERLAP = "the host schedules and prepares the next step while the current one runs on the device"
NO_CASCADE = "jaxllm has no cascade attention"
NO_HYBRID = "jaxllm has one KV cache manager for all its (attention-only) models"
ONE_ENGINE = "the periodic stats line is always one for all data-parallel replicas (/metrics has each replica's)"
OLD_METRICS = "/metrics always shows the older metric names too (vllm:gpu_cache_usage_perc, ...)"
DEVICE = "jax picks the platform (set JAX_PLATFORMS=cpu or cuda to choose)"
EXECUTOR = (
    "jaxllm runs one process per host, without Ray (several hosts: --coordinator-address / --num-processes "
    "/ --process-id)"
)
MODEL_IMPL = "jaxllm always runs its own JAX implementation of the model"
HF_CONFIG_ONLY = "only Hugging Face config.json is supported (no Mistral params.json)"
RECOMPUTE = "preempted requests are always recomputed (jaxllm has no CPU swap space)"
DP_HERE = (
    "data-parallel replicas run as processes on this host's devices (--data-parallel-size), each its own engine, "
    "with no coordinator between them"
)
DP_ONE_HOST = (
    "data parallelism across hosts or behind an external load balancer is not supported: "
    "--data-parallel-size runs every replica on this host behind this server"
)
ONE_API_SERVER = "one API server process serves all requests (aiohttp, on one event loop)"
NO_DCP = "decode context parallelism is not supported"
NO_CPU_OFFLOAD = "offloading weights to CPU memory is not supported"
NO_KV_OFFLOAD = "the KV cache stays in device memory (no CPU offloading)"
NO_SWAP = "jaxllm never swaps: a preempted request is recomputed, so no CPU swap space is allocated"
MULTI_STEP = (
    "the next step is always prepared on the host while the current one runs on the device, so "
    "multi-step scheduling has no effect"
)
TOKENIZER_POOL = "prompts are tokenized in the server's process (no tokenizer pool)"
LLGUIDANCE = (
    "structured outputs always use llguidance (JSON schemas strict, as vLLM's default backend, xgrammar, compiles them)"
)
RAW_LOGPROBS = "logprobs are always those of the raw model output (vLLM's default raw_logprobs)"
BUCKETS = (
    "every shape bucket (powers of two up to --max-num-seqs / --max-num-batched-tokens) is compiled at "
    "start-up instead of capturing CUDA graphs"
)
XLA = "XLA compiles each step whole; vLLM's torch.compile and CUDA-graph options do not apply"
CHUNKED_PREFILL = "chunked prefill fills each step's token budget with the waiting prompts in order"
SCHEDULER = "the scheduler admits waiting requests at every step"
OUTPUT_OVERLAP = "outputs are always processed while the next step runs"
STREAM_EVERY_TOKEN = "streamed responses send each new piece of text as it is generated"
KV_SCALES = "fp8 KV pages use scales of 1.0 (vLLM's default without calibration)"
PREFIX_HASH = "prefix-cache blocks are keyed by Python's built-in hash of the chained token ids"
KV_SHARING = "jaxllm has no cross-layer KV sharing"
PLUGIN = "vLLM plugins and custom Python classes are not supported"
LOGITS_PROCESSORS = "custom logits processors (Python classes) are not supported"
LORA_BIAS = "LoRA bias terms are not supported: an adapter with bias is refused when it loads"
LONG_LORA = "long-context LoRA adapters are not supported"
QLORA = "QLoRA (bitsandbytes) adapters are not supported: serve a LoRA adapter of a 16-bit or quantized base"
PROMPT_ADAPTER = "prompt adapters are not supported"
SPEC_OPTION = "jaxllm's speculative decoding (--speculative-config) has no such option"
SPEC_ACCEPTANCE = "proposals are always verified by rejection sampling (vLLM's default acceptance method)"
KV_TRANSFER = "disaggregated prefill (KV / encoder-cache transfer between instances) is not supported"
KV_EVENTS = "no KV cache events are published"
MOE = (
    "jaxllm's expert parallelism (--enable-expert-parallel) shards whole experts over the tp devices with one "
    "all-reduce per MoE layer; expert load balancing, dual-batch overlap and all-to-all backends are not "
    "implemented, so this option has no effect"
)
TEXT_ONLY = "jaxllm serves text-only models, so multimodal options have no effect"
PROMPT_EMBEDS = "prompt embeddings are not supported: requests carrying them are refused"
MAMBA = "jaxllm supports no Mamba / hybrid model, so Mamba cache options have no effect"
NEURON = "jaxllm does not run on AWS Neuron"
LOADER = "weights load with jaxllm's own loader (safetensors / .bin, sharded onto the devices)"
SLIDING_WINDOW = "turning a model's sliding window off is not supported"
HF_CONFIG_PATH = "a config from another folder is not supported: put its config.json in the model folder"
TRACING = "OpenTelemetry tracing is not supported"
NCCL = "XLA chooses the collectives (NCCL on GPUs); no Ray workers"
NO_EXTRA_ROUTES = "jaxllm has no /tokenizer_info or /load routes"
USAGE = "usage reports prompt, completion and total tokens (stream usage only with stream_options.include_usage)"
REQUEST_ID_HEADERS = "responses carry no X-Request-Id header"
LOGGING = "logging is configured by --log-level or VLLM_LOGGING_LEVEL, and --uvicorn-log-level for the HTTP server (errors are logged with their traceback)"
UDS = "serving on a Unix domain socket is not supported (use --host / --port)"
CLIENT_CERTS = "client certificate verification is not supported"
SSL_REFRESH = "the TLS certificate is read once at start-up"
H11 = "HTTP is served by aiohttp with its own header limits"
TOOL_SERVER = "built-in tool servers (the Responses API's) are not supported"
TOKENS_ONLY = "the tokens-only API is not supported"
CONTENT_FORMAT = "message content reaches the chat template as a string (text parts joined)"


@dataclass(frozen=True)
class VllmOption:
    flag: str  # "--swap-space"
    kind: str  # HONOURED | SAME | IGNORED | REFUSED
    message: str  # see the kinds above ("" for HONOURED: the parser's help says what it does)
    arity: str  # "bool" | "value" | "values": the argparse shape of a flag jaxllm does not implement
    scope: str  # "engine" (EngineArgs field, LLM() keyword, serve flag) | "server" (serve flag only)
    versions: str  # vLLM releases (of 0.8.0 ... 0.11.2) that have the flag
    accepted: tuple[str, ...] = ()  # values taken silently (vLLM's default and equivalents)
    aliases: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def takes(self, value) -> bool:
        """Whether value needs no warning or error: not given, false, or one of the accepted values."""
        if value is None or value is False:
            return True
        if self.kind in (HONOURED, SAME):
            return True
        values = value if isinstance(value, (list, tuple)) else [value]
        return all(str(v) in self.accepted for v in values) and bool(self.accepted)

    def describe(self, value=None, keyword: bool = False) -> str:
        """The warning (IGNORED) or error (REFUSED) for the option given as value, as a serve flag or an LLM()
        keyword."""
        if keyword:
            what = f"LLM({self.dest}={value!r})"
        elif value is None or value is True:
            what = self.flag
        else:
            what = f"{self.flag} {' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}"
        if self.kind == REFUSED:
            return f"{what}: {self.message}."
        return f"{what} has no effect: {self.message}."


def _row(flag, kind, message, arity, scope, versions, accepted=(), aliases=()):
    return VllmOption(flag, kind, message, arity, scope, versions, tuple(accepted), tuple(aliases))


VLLM_OPTIONS: tuple[VllmOption, ...] = (
    _row("--additional-config", IGNORED, XLA, "value", "engine", "0.8.0-0.11.2"),
    _row("--aggregate-engine-logging", SAME, ONE_ENGINE, "bool", "engine", "0.11.2"),
    _row("--all2all-backend", IGNORED, MOE, "value", "engine", "0.11.2"),
    _row("--allow-credentials", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--allowed-headers", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--allowed-local-media-path", IGNORED, TEXT_ONLY, "value", "engine", "0.8.0-0.11.2"),
    _row("--allowed-media-domains", IGNORED, TEXT_ONLY, "values", "engine", "0.11.0-0.11.2"),
    _row("--allowed-methods", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--allowed-origins", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--api-key", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row(
        "--api-server-count",
        IGNORED,
        ONE_API_SERVER,
        "value",
        "server",
        "0.9.2-0.11.2",
        accepted=("1",),
        aliases=("-asc",),
    ),
    _row("--async-scheduling", SAME, OVERLAP, "bool", "engine", "0.10.0-0.11.2"),
    _row("--block-size", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--calculate-kv-scales", IGNORED, KV_SCALES, "bool", "engine", "0.8.0-0.11.2"),
    _row("--chat-template", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row(
        "--chat-template-content-format",
        IGNORED,
        CONTENT_FORMAT,
        "value",
        "server",
        "0.8.0-0.11.2",
        accepted=("auto", "string"),
    ),
    _row("--code-revision", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--collect-detailed-traces", IGNORED, TRACING, "values", "engine", "0.8.0-0.11.2"),
    _row("--compilation-config", IGNORED, XLA, "value", "engine", "0.8.0-0.11.2", aliases=("-O",)),
    _row("--config", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--config-format", REFUSED, HF_CONFIG_ONLY, "value", "engine", "0.8.0-0.11.2", accepted=("auto", "hf")),
    _row("--convert", HONOURED, "", "value", "engine", "0.10.2-0.11.2"),
    _row("--cpu-offload-gb", REFUSED, NO_CPU_OFFLOAD, "value", "engine", "0.8.0-0.11.2", accepted=("0", "0.0")),
    _row("--cuda-graph-sizes", IGNORED, BUCKETS, "values", "engine", "0.9.0-0.11.2"),
    _row("--cudagraph-capture-sizes", IGNORED, BUCKETS, "values", "engine", "0.11.2"),
    _row("--data-parallel-address", IGNORED, DP_HERE, "value", "engine", "0.9.0-0.11.2", aliases=("-dpa",)),
    _row(
        "--data-parallel-backend",
        IGNORED,
        DP_HERE,
        "value",
        "engine",
        "0.9.2-0.11.2",
        accepted=("mp",),
        aliases=("-dpb",),
    ),
    _row("--data-parallel-external-lb", REFUSED, DP_ONE_HOST, "bool", "engine", "0.11.2", aliases=("-dpe",)),
    _row("--data-parallel-hybrid-lb", REFUSED, DP_ONE_HOST, "bool", "engine", "0.10.0-0.11.2", aliases=("-dph",)),
    _row("--data-parallel-rank", REFUSED, DP_ONE_HOST, "value", "engine", "0.9.2-0.11.2", aliases=("-dpn",)),
    _row("--data-parallel-rpc-port", IGNORED, DP_HERE, "value", "engine", "0.9.0-0.11.2", aliases=("-dpp",)),
    _row("--data-parallel-size", HONOURED, "", "value", "engine", "0.8.5-0.11.2", aliases=("-dp",)),
    _row("--data-parallel-size-local", HONOURED, "", "value", "engine", "0.9.0-0.11.2", aliases=("-dpl",)),
    _row(
        "--data-parallel-start-rank",
        REFUSED,
        DP_ONE_HOST,
        "value",
        "engine",
        "0.9.0-0.11.2",
        accepted=("0",),
        aliases=("-dpr",),
    ),
    _row("--dbo-decode-token-threshold", IGNORED, MOE, "value", "engine", "0.11.0-0.11.2"),
    _row("--dbo-prefill-token-threshold", IGNORED, MOE, "value", "engine", "0.11.0-0.11.2"),
    _row("--dcp-kv-cache-interleave-size", IGNORED, NO_DCP, "value", "engine", "0.11.2", accepted=("1",)),
    _row(
        "--decode-context-parallel-size",
        REFUSED,
        NO_DCP,
        "value",
        "engine",
        "0.10.2-0.11.2",
        accepted=("1",),
        aliases=("-dcp",),
    ),
    _row("--default-mm-loras", IGNORED, TEXT_ONLY, "value", "engine", "0.10.0-0.11.2"),
    _row("--device", IGNORED, DEVICE, "value", "engine", "0.8.0-0.9.2", accepted=("auto", "cuda", "gpu")),
    _row("--disable-async-output-proc", IGNORED, OUTPUT_OVERLAP, "bool", "engine", "0.8.0-0.10.2"),
    _row("--disable-cascade-attn", SAME, NO_CASCADE, "bool", "engine", "0.8.5-0.11.2"),
    _row("--disable-chunked-mm-input", IGNORED, TEXT_ONLY, "bool", "engine", "0.8.5-0.11.2"),
    _row("--disable-custom-all-reduce", IGNORED, NCCL, "bool", "engine", "0.8.0-0.11.2"),
    _row("--disable-fastapi-docs", SAME, NO_DOCS, "bool", "server", "0.8.0-0.11.2"),
    _row("--disable-frontend-multiprocessing", SAME, IN_PROCESS, "bool", "server", "0.8.0-0.11.2"),
    _row("--disable-hybrid-kv-cache-manager", SAME, NO_HYBRID, "bool", "engine", "0.9.2-0.11.2"),
    _row("--disable-log-requests", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--disable-log-stats", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--disable-logprobs-during-spec-decoding", IGNORED, SPEC_OPTION, "bool", "engine", "0.8.0"),
    _row("--disable-mm-preprocessor-cache", IGNORED, TEXT_ONLY, "bool", "engine", "0.8.0-0.11.2"),
    _row("--disable-nccl-for-dp-synchronization", IGNORED, DP_HERE, "bool", "engine", "0.11.2"),
    _row("--disable-sliding-window", REFUSED, SLIDING_WINDOW, "bool", "engine", "0.8.0-0.11.2"),
    _row("--disable-uvicorn-access-log", HONOURED, "", "value", "server", "0.8.5-0.11.2"),
    _row(
        "--distributed-executor-backend", IGNORED, EXECUTOR, "value", "engine", "0.8.0-0.11.2", accepted=("mp", "uni")
    ),
    _row("--download-dir", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--dtype", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--ec-transfer-config", REFUSED, KV_TRANSFER, "value", "engine", "0.11.2"),
    _row("--enable-auto-tool-choice", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--enable-chunked-prefill", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--enable-dbo", IGNORED, MOE, "bool", "engine", "0.11.0-0.11.2"),
    _row("--enable-eplb", IGNORED, MOE, "bool", "engine", "0.9.2-0.11.2"),
    _row("--enable-expert-parallel", HONOURED, "", "bool", "engine", "0.8.0-0.11.2"),
    _row("--enable-force-include-usage", IGNORED, USAGE, "bool", "server", "0.9.2-0.11.2"),
    _row("--enable-log-outputs", IGNORED, LOGGING, "bool", "server", "0.10.2-0.11.2"),
    _row("--enable-log-requests", HONOURED, "", "value", "server", "0.10.2-0.11.2"),
    _row("--enable-lora", HONOURED, "", "bool", "engine", "0.8.0-0.11.2"),
    _row("--enable-lora-bias", IGNORED, LORA_BIAS, "bool", "engine", "0.8.0-0.11.0"),
    _row("--enable-mm-embeds", IGNORED, TEXT_ONLY, "bool", "engine", "0.11.2"),
    _row("--enable-multimodal-encoder-data-parallel", IGNORED, TEXT_ONLY, "bool", "engine", "0.9.2-0.11.2"),
    _row("--enable-prefix-caching", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--enable-prompt-adapter", REFUSED, PROMPT_ADAPTER, "bool", "engine", "0.8.0-0.10.0"),
    _row("--enable-prompt-embeds", IGNORED, PROMPT_EMBEDS, "bool", "engine", "0.9.0-0.11.2"),
    _row("--enable-prompt-tokens-details", HONOURED, "", "bool", "server", "0.8.0-0.11.2"),
    _row("--enable-reasoning", HONOURED, "", "bool", "engine", "0.8.0-0.9.2"),
    _row("--enable-request-id-headers", IGNORED, REQUEST_ID_HEADERS, "bool", "server", "0.8.0-0.11.2"),
    _row("--enable-server-load-tracking", IGNORED, NO_EXTRA_ROUTES, "bool", "server", "0.8.0-0.11.2"),
    _row("--enable-sleep-mode", HONOURED, "", "bool", "engine", "0.8.0-0.11.2"),
    _row("--enable-ssl-refresh", IGNORED, SSL_REFRESH, "bool", "server", "0.8.0-0.11.2"),
    _row("--enable-tokenizer-info-endpoint", IGNORED, NO_EXTRA_ROUTES, "bool", "server", "0.10.0-0.11.2"),
    _row("--enforce-eager", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--eplb-config", IGNORED, MOE, "value", "engine", "0.10.2-0.11.2"),
    _row("--eplb-log-balancedness", IGNORED, MOE, "bool", "engine", "0.9.2-0.11.2"),
    _row("--eplb-step-interval", IGNORED, MOE, "value", "engine", "0.9.2-0.11.2"),
    _row("--eplb-window-size", IGNORED, MOE, "value", "engine", "0.9.2-0.11.2"),
    _row("--exclude-tools-when-tool-choice-none", HONOURED, "", "value", "server", "0.10.2-0.11.2"),
    _row("--expand-tools-even-if-tool-choice-none", SAME, TOOLS_SHOWN, "bool", "server", "0.9.2"),
    _row("--expert-placement-strategy", IGNORED, MOE, "value", "engine", "0.11.0-0.11.2"),
    _row("--fully-sharded-loras", HONOURED, "", "bool", "engine", "0.8.0-0.11.2"),
    _row("--generation-config", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--gpu-memory-utilization", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row(
        "--guided-decoding-backend",
        IGNORED,
        LLGUIDANCE,
        "value",
        "engine",
        "0.8.0-0.10.2",
        accepted=("auto", "guidance", "llguidance"),
    ),
    _row("--guided-decoding-disable-additional-properties", IGNORED, LLGUIDANCE, "bool", "engine", "0.9.0-0.10.2"),
    _row("--guided-decoding-disable-any-whitespace", IGNORED, LLGUIDANCE, "bool", "engine", "0.9.0-0.10.2"),
    _row("--guided-decoding-disable-fallback", IGNORED, LLGUIDANCE, "bool", "engine", "0.9.0-0.10.2"),
    _row("--h11-max-header-count", IGNORED, H11, "value", "server", "0.10.2-0.11.2"),
    _row("--h11-max-incomplete-event-size", IGNORED, H11, "value", "server", "0.10.2-0.11.2"),
    _row("--headless", HONOURED, "", "bool", "server", "0.9.0-0.11.2"),
    _row("--hf-config-path", REFUSED, HF_CONFIG_PATH, "value", "engine", "0.8.0-0.11.2"),
    _row("--hf-overrides", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--hf-token", HONOURED, "", "value", "engine", "0.8.5-0.11.2"),
    _row("--host", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--ignore-patterns", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--interleave-mm-strings", IGNORED, TEXT_ONLY, "bool", "engine", "0.10.0-0.11.2"),
    _row("--io-processor-plugin", REFUSED, PLUGIN, "value", "engine", "0.10.2-0.11.2", accepted=("", "auto")),
    _row("--kv-cache-dtype", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--kv-cache-memory-bytes", HONOURED, "", "value", "engine", "0.10.2-0.11.2"),
    _row("--kv-events-config", IGNORED, KV_EVENTS, "value", "engine", "0.9.0-0.11.2"),
    _row("--kv-offloading-backend", IGNORED, NO_KV_OFFLOAD, "value", "engine", "0.11.2"),
    _row("--kv-offloading-size", IGNORED, NO_KV_OFFLOAD, "value", "engine", "0.11.2"),
    _row("--kv-sharing-fast-prefill", IGNORED, KV_SHARING, "bool", "engine", "0.10.2-0.11.2"),
    _row("--kv-transfer-config", REFUSED, KV_TRANSFER, "value", "engine", "0.8.0-0.11.2"),
    _row("--limit-mm-per-prompt", IGNORED, TEXT_ONLY, "value", "engine", "0.8.0-0.11.2"),
    _row("--load-format", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--log-config-file", IGNORED, LOGGING, "value", "server", "0.9.2-0.11.2"),
    _row("--log-error-stack", IGNORED, LOGGING, "bool", "server", "0.10.2-0.11.2"),
    _row("--logits-processor-pattern", REFUSED, LOGITS_PROCESSORS, "value", "engine", "0.8.0-0.11.2"),
    _row("--logits-processors", REFUSED, LOGITS_PROCESSORS, "values", "engine", "0.10.2-0.11.2"),
    _row("--logprobs-mode", IGNORED, RAW_LOGPROBS, "value", "engine", "0.10.0-0.11.2", accepted=("raw_logprobs",)),
    _row("--long-lora-scaling-factors", IGNORED, LONG_LORA, "value", "engine", "0.8.0-0.9.2"),
    _row(
        "--long-prefill-token-threshold", IGNORED, CHUNKED_PREFILL, "value", "engine", "0.8.0-0.11.2", accepted=("0",)
    ),
    _row("--lora-dtype", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--lora-extra-vocab-size", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--lora-modules", HONOURED, "", "values", "server", "0.8.0-0.11.2"),
    _row("--mamba-block-size", IGNORED, MAMBA, "value", "engine", "0.11.2"),
    _row("--mamba-cache-dtype", IGNORED, MAMBA, "value", "engine", "0.10.2-0.11.2"),
    _row("--mamba-ssm-cache-dtype", IGNORED, MAMBA, "value", "engine", "0.10.2-0.11.2"),
    _row("--master-addr", HONOURED, "", "value", "engine", "0.11.2"),
    _row("--master-port", HONOURED, "", "value", "engine", "0.11.2"),
    _row("--max-cpu-loras", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--max-cudagraph-capture-size", IGNORED, BUCKETS, "value", "engine", "0.11.2"),
    _row("--max-log-len", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--max-logprobs", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--max-long-partial-prefills", IGNORED, CHUNKED_PREFILL, "value", "engine", "0.8.0-0.11.2", accepted=("1",)),
    _row("--max-lora-rank", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--max-loras", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--max-model-len", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--max-num-batched-tokens", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--max-num-partial-prefills", IGNORED, CHUNKED_PREFILL, "value", "engine", "0.8.0-0.11.2", accepted=("1",)),
    _row("--max-num-seqs", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--max-parallel-loading-workers", IGNORED, LOADER, "value", "engine", "0.8.0-0.11.2"),
    _row("--max-prompt-adapter-token", IGNORED, PROMPT_ADAPTER, "value", "engine", "0.8.0-0.9.2"),
    _row("--max-prompt-adapters", IGNORED, PROMPT_ADAPTER, "value", "engine", "0.8.0-0.9.2"),
    _row("--max-seq-len-to-capture", IGNORED, BUCKETS, "value", "engine", "0.8.0-0.10.2"),
    _row("--media-io-kwargs", IGNORED, TEXT_ONLY, "value", "engine", "0.9.2-0.11.2"),
    _row("--middleware", REFUSED, PLUGIN, "values", "server", "0.8.0-0.11.2"),
    _row("--mm-encoder-attn-backend", IGNORED, TEXT_ONLY, "value", "engine", "0.11.2"),
    _row("--mm-encoder-tp-mode", IGNORED, TEXT_ONLY, "value", "engine", "0.10.2-0.11.2"),
    _row("--mm-processor-cache-gb", IGNORED, TEXT_ONLY, "value", "engine", "0.10.2-0.11.2"),
    _row("--mm-processor-cache-type", IGNORED, TEXT_ONLY, "value", "engine", "0.11.0-0.11.2"),
    _row("--mm-processor-kwargs", IGNORED, TEXT_ONLY, "value", "engine", "0.8.0-0.11.2"),
    _row("--mm-shm-cache-max-object-size-mb", IGNORED, TEXT_ONLY, "value", "engine", "0.11.0-0.11.2"),
    _row("--model", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--model-impl", IGNORED, MODEL_IMPL, "value", "engine", "0.8.0-0.11.2", accepted=("auto", "vllm")),
    _row("--model-loader-extra-config", IGNORED, LOADER, "value", "engine", "0.8.0-0.11.2"),
    _row("--multi-step-stream-outputs", IGNORED, MULTI_STEP, "bool", "engine", "0.8.0-0.10.0"),
    _row("--ngram-prompt-lookup-max", HONOURED, "", "value", "engine", "0.8.0"),
    _row("--ngram-prompt-lookup-min", HONOURED, "", "value", "engine", "0.8.0"),
    _row("--nnodes", HONOURED, "", "value", "engine", "0.11.2", aliases=("-n",)),
    _row("--node-rank", HONOURED, "", "value", "engine", "0.11.2", aliases=("-r",)),
    _row("--num-gpu-blocks-override", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--num-lookahead-slots", IGNORED, SCHEDULER, "value", "engine", "0.8.0-0.11.2", accepted=("0",)),
    _row("--num-redundant-experts", IGNORED, MOE, "value", "engine", "0.9.2-0.11.2"),
    _row("--num-scheduler-steps", IGNORED, MULTI_STEP, "value", "engine", "0.8.0-0.10.0", accepted=("1",)),
    _row("--num-speculative-tokens", HONOURED, "", "value", "engine", "0.8.0"),
    _row("--otlp-traces-endpoint", IGNORED, TRACING, "value", "engine", "0.8.0-0.11.2"),
    _row("--override-attention-dtype", IGNORED, XLA, "value", "engine", "0.9.2-0.11.2"),
    _row("--override-generation-config", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--override-neuron-config", IGNORED, NEURON, "value", "engine", "0.8.0-0.10.0"),
    _row("--override-pooler-config", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--pipeline-parallel-size", HONOURED, "", "value", "engine", "0.8.0-0.11.2", aliases=("-pp",)),
    _row("--pooler-config", HONOURED, "", "value", "engine", "0.11.0-0.11.2"),
    _row("--port", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--preemption-mode", IGNORED, RECOMPUTE, "value", "engine", "0.8.0-0.10.2", accepted=("recompute",)),
    _row("--prefix-caching-hash-algo", IGNORED, PREFIX_HASH, "value", "engine", "0.8.5-0.11.2", accepted=("builtin",)),
    _row("--prompt-adapters", REFUSED, PROMPT_ADAPTER, "values", "server", "0.8.0-0.9.2"),
    _row("--pt-load-map-location", IGNORED, LOADER, "value", "engine", "0.9.0-0.11.2"),
    _row("--qlora-adapter-name-or-path", REFUSED, QLORA, "value", "engine", "0.8.0-0.9.2"),
    _row("--quantization", HONOURED, "", "value", "engine", "0.8.0-0.11.2", aliases=("-q",)),
    _row("--ray-workers-use-nsight", IGNORED, NCCL, "bool", "engine", "0.8.0-0.11.2"),
    _row("--reasoning-parser", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--reasoning-parser-plugin", REFUSED, PLUGIN, "value", "engine", "0.11.2", accepted=("", "auto")),
    _row("--response-role", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--return-tokens-as-token-ids", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--revision", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--root-path", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--rope-scaling", HONOURED, "", "value", "engine", "0.8.0-0.11.0"),
    _row("--rope-theta", HONOURED, "", "value", "engine", "0.8.0-0.11.0"),
    _row("--runner", HONOURED, "", "value", "engine", "0.10.2-0.11.2"),
    _row("--safetensors-load-strategy", IGNORED, LOADER, "value", "engine", "0.10.2-0.11.2"),
    _row(
        "--scheduler-cls",
        REFUSED,
        PLUGIN,
        "value",
        "engine",
        "0.8.0-0.11.2",
        accepted=("auto", "vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler"),
    ),
    _row("--scheduler-delay-factor", IGNORED, SCHEDULER, "value", "engine", "0.8.0-0.10.2", accepted=("0", "0.0")),
    _row("--scheduling-policy", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--seed", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--served-model-name", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--show-hidden-metrics-for-version", SAME, OLD_METRICS, "value", "engine", "0.8.0-0.11.2"),
    _row("--skip-mm-profiling", IGNORED, TEXT_ONLY, "bool", "engine", "0.10.2-0.11.2"),
    _row("--skip-tokenizer-init", HONOURED, "", "bool", "engine", "0.8.0-0.11.2"),
    _row(
        "--spec-decoding-acceptance-method",
        IGNORED,
        SPEC_ACCEPTANCE,
        "value",
        "engine",
        "0.8.0",
        accepted=("rejection_sampler",),
    ),
    _row("--speculative-config", HONOURED, "", "value", "engine", "0.8.5-0.11.2"),
    _row("--speculative-disable-by-batch-size", HONOURED, "", "value", "engine", "0.8.0"),
    _row("--speculative-disable-mqa-scorer", IGNORED, SPEC_OPTION, "bool", "engine", "0.8.0"),
    _row(
        "--speculative-draft-tensor-parallel-size",
        HONOURED,
        "",
        "value",
        "engine",
        "0.8.0",
        aliases=("-spec-draft-tp",),
    ),
    _row("--speculative-max-model-len", IGNORED, SPEC_OPTION, "value", "engine", "0.8.0"),
    _row("--speculative-model", HONOURED, "", "value", "engine", "0.8.0"),
    _row("--speculative-model-quantization", IGNORED, SPEC_OPTION, "value", "engine", "0.8.0"),
    _row("--ssl-ca-certs", REFUSED, CLIENT_CERTS, "value", "server", "0.8.0-0.11.2"),
    _row("--ssl-cert-reqs", REFUSED, CLIENT_CERTS, "value", "server", "0.8.0-0.11.2", accepted=("0",)),
    _row("--ssl-certfile", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--ssl-keyfile", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--stream-interval", IGNORED, STREAM_EVERY_TOKEN, "value", "engine", "0.11.2", accepted=("1",)),
    _row("--structured-outputs-config", IGNORED, LLGUIDANCE, "value", "engine", "0.11.0-0.11.2"),
    _row("--swap-space", IGNORED, NO_SWAP, "value", "engine", "0.8.0-0.11.2"),
    _row("--task", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--tensor-parallel-size", HONOURED, "", "value", "engine", "0.8.0-0.11.2", aliases=("-tp",)),
    _row("--tokenizer", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--tokenizer-mode", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--tokenizer-pool-extra-config", IGNORED, TOKENIZER_POOL, "value", "engine", "0.8.0-0.9.2"),
    _row("--tokenizer-pool-size", IGNORED, TOKENIZER_POOL, "value", "engine", "0.8.0-0.9.2", accepted=("0",)),
    _row("--tokenizer-pool-type", IGNORED, TOKENIZER_POOL, "value", "engine", "0.8.0-0.9.2"),
    _row("--tokenizer-revision", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--tokens-only", REFUSED, TOKENS_ONLY, "bool", "server", "0.11.2"),
    _row("--tool-call-parser", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--tool-parser-plugin", REFUSED, PLUGIN, "value", "server", "0.8.0-0.11.2", accepted=("", "auto")),
    _row("--tool-server", REFUSED, TOOL_SERVER, "value", "server", "0.10.2-0.11.2"),
    _row("--trust-remote-code", HONOURED, "", "value", "engine", "0.8.0-0.11.2"),
    _row("--trust-request-chat-template", SAME, REQUEST_TEMPLATES, "bool", "server", "0.11.0-0.11.2"),
    _row("--typical-acceptance-sampler-posterior-alpha", IGNORED, SPEC_OPTION, "value", "engine", "0.8.0"),
    _row("--typical-acceptance-sampler-posterior-threshold", IGNORED, SPEC_OPTION, "value", "engine", "0.8.0"),
    _row("--uds", REFUSED, UDS, "value", "server", "0.10.2-0.11.2"),
    _row("--use-tqdm-on-load", IGNORED, LOADER, "bool", "engine", "0.8.0-0.11.2"),
    _row("--use-v2-block-manager", SAME, V2_BLOCKS, "bool", "engine", "0.8.0-0.9.2"),
    _row("--uvicorn-log-level", HONOURED, "", "value", "server", "0.8.0-0.11.2"),
    _row("--video-pruning-rate", IGNORED, TEXT_ONLY, "value", "engine", "0.11.0-0.11.2"),
    _row("--worker-cls", REFUSED, PLUGIN, "value", "engine", "0.8.0-0.11.2", accepted=("", "auto")),
    _row("--worker-extension-cls", REFUSED, PLUGIN, "value", "engine", "0.8.0-0.11.2", accepted=("", "auto")),
)

BY_FLAG: dict[str, VllmOption] = {o.flag: o for o in VLLM_OPTIONS}
# LLM() keywords: vLLM's EngineArgs fields are its flags' names with underscores.
BY_KEYWORD: dict[str, VllmOption] = {o.dest: o for o in VLLM_OPTIONS if o.scope == "engine"}
# Honoured serve flags with nothing to do offline: LLM() takes them silently.
_OFFLINE_NO_OP = {"disable_log_stats": "LLM() logs no periodic stats; False turns on LLM.get_metrics()"}
_warned: set[str] = set()


def engine_kwargs_for_llm(kwargs: dict, fields: set[str]) -> dict:
    """LLM(**kwargs) -> the EngineArgs keywords (fields). vLLM's other engine options are taken silently (SAME, an
    accepted value, a false flag), with one warning (IGNORED) or refused with a ValueError naming them (REFUSED);
    a keyword vLLM's EngineArgs does not have either is vLLM's TypeError."""
    out = {}
    for name, value in kwargs.items():
        option = BY_KEYWORD.get(name)
        if name in fields:
            out[name] = value
        elif option is None:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument '{name}'")
        elif option.kind == HONOURED:
            if name not in _OFFLINE_NO_OP and value not in (None, False):
                _warn_once(
                    name,
                    f"LLM({name}=...) has no effect: it is a `python -m jaxllm.serve {option.flag}` option in jaxllm.",
                )
        elif not option.takes(value):
            if option.kind == REFUSED:
                raise ValueError(option.describe(value, keyword=True))
            _warn_once(name, option.describe(value, keyword=True))
    return out


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)
