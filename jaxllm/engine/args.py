"""EngineArgs: every engine option, with vLLM's names and defaults (LLM(**kw) and serve flags map here)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields

from jaxllm.engine.configs import SpeculativeConfig
from jaxllm.paths import default_compilation_cache_dir
from jaxllm.quantization import METHODS

# vLLM 0.8.0's speculative options before --speculative-config (EngineArgs fields here too) and the
# speculative_config keys they set.
LEGACY_SPEC_ARG_NAMES = (
    "speculative_model",
    "num_speculative_tokens",
    "ngram_prompt_lookup_max",
    "ngram_prompt_lookup_min",
    "speculative_draft_tensor_parallel_size",
    "speculative_disable_by_batch_size",
)
_LEGACY_SPEC_KEYS = (
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "draft_tensor_parallel_size",
    "disable_by_batch_size",
)


def legacy_speculative_config(values: dict) -> dict | None:
    """The speculative_config vLLM 0.8.0 built from its separate flags (values: the flags by field name); None
    unless a speculative model or a number of tokens is given, as there."""
    if values.get("speculative_model") is None and values.get("num_speculative_tokens") is None:
        return None
    return {
        key: values[name]
        for name, key in zip(LEGACY_SPEC_ARG_NAMES, _LEGACY_SPEC_KEYS, strict=True)
        if values.get(name) is not None
    }


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # None: the built-in demo model; a folder, or a Hub / ModelScope id (model_files.py)
    tokenizer: str | None = None
    # Passed to transformers for the tokenizer and config classes of the folder (tokenization_*.py); the model
    # itself is always jaxllm's own implementation.
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"  # auto | slow
    skip_tokenizer_init: bool = False  # vLLM's: no tokenizer; prompts are token ids, outputs carry no text
    revision: str | None = None  # of a Hub model id (branch, tag or commit)
    tokenizer_revision: str | None = None  # None: revision
    code_revision: str | None = None  # of a Hub model's remote code (vLLM's; the code comes with the snapshot)
    download_dir: str | None = None  # huggingface_hub's cache_dir for model ids (None: the HF cache)
    hf_token: str | bool | None = None  # for private / gated Hub models (None: HF_TOKEN or the saved login)
    ignore_patterns: tuple[str, ...] | list[str] | str | None = None  # files not to download ("original/**/*")
    hf_overrides: dict | None = None  # merged over config.json
    rope_scaling: dict | None = None  # vLLM's older spelling of hf_overrides={"rope_scaling": ...}
    rope_theta: float | None = None  # ... and of hf_overrides={"rope_theta": ...}
    override_generation_config: dict | None = None  # merged over generation_config.json's sampling defaults
    dtype: str = "auto"
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    generation_config: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas on disjoint device groups of this host (jaxllm/engine/dp.py)
    enable_expert_parallel: bool = False  # MoE: whole experts per tp device (jaxllm/models/moe.py)
    enforce_eager: bool = False
    enable_sleep_mode: bool = False  # LLM.sleep() / wake_up() (vLLM's; level 1: weights to host, KV cache freed)
    # Pooling (vLLM's): runner "pooling", convert "embed" or task "embed" run the model as an embedding model
    # (jaxllm/pooling_params.py: its last token's final-normed hidden state); pooler_config (or vLLM's older
    # override_pooler_config): {"pooling_type": "LAST", "normalize": bool} over the model's sentence-transformers
    # files
    runner: str = "auto"  # auto | generate | pooling
    convert: str = "auto"  # auto | none | embed
    task: str = "auto"  # auto | generate | embed (vLLM <= 0.10's spelling of runner / convert)
    pooler_config: dict | str | None = None
    override_pooler_config: dict | str | None = None
    max_logprobs: int = 20
    scheduling_policy: str = "fcfs"  # "priority": requests' priority (lower first) orders the queue
    speculative_config: dict | str | None = None  # vLLM's dict (or its JSON text): see configs.SpeculativeConfig
    # vLLM 0.8.0's older form of speculative_config (speculative_model="[ngram]" is n-gram lookup); ignored when
    # speculative_config is given, as there
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    speculative_draft_tensor_parallel_size: int | None = None
    speculative_disable_by_batch_size: int | None = None
    # jaxllm/reasoning.py: structured-output grammars apply once the reasoning has ended (the server also splits
    # chat responses with it); enable_reasoning is vLLM 0.8-0.9's switch, deprecated there, without effect
    reasoning_parser: str | None = None
    enable_reasoning: bool = False
    # LoRA adapters (jaxllm/lora/config.py: LoRAConfig, made from these once)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    lora_extra_vocab_size: int = 256
    # jaxllm-specific: explicit KV size (tests, CPU), attention backend, compile cache.
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    attention_backend: str = "auto"  # auto | reference | pallas
    compilation_cache_dir: str | None = field(default_factory=default_compilation_cache_dir)  # None: off
    served_model_name: str | None = None
    server_mode: bool = False  # vLLM's defaults differ between offline and server

    @property
    def pooling(self) -> bool:
        """Whether the model runs as a pooling (embedding) model rather than a generative one."""
        return self.runner == "pooling" or self.convert == "embed" or self.task in ("embed", "embedding")

    def _check_pooling(self) -> None:
        for name, allowed in (
            ("runner", ("auto", "generate", "pooling")),
            ("convert", ("auto", "none", "embed")),
            ("task", ("auto", "generate", "embed", "embedding")),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"{name}={value!r} is not supported: jaxllm runs generative models and, as pooling models, "
                    f"embedding models (runner='pooling' or convert / task 'embed'); {name} takes {list(allowed)}."
                )
        if not self.pooling:
            return
        if self.runner == "generate" or self.task == "generate":
            raise ValueError("runner / task 'generate' and a pooling runner, convert or task were both given.")
        for name, bad in (
            ("pipeline_parallel_size", self.pipeline_parallel_size > 1),
            ("data_parallel_size", self.data_parallel_size > 1),
            ("speculative_config", bool(self.speculative_config or self.speculative_model)),
        ):
            if bad:
                raise ValueError(f"An embedding (pooling) model runs without {name}.")

    def lora_config(self):
        """The LoRAConfig these arguments give (None without enable_lora); a bad value raises ValueError."""
        from jaxllm.lora.config import LoRAConfig

        return LoRAConfig.from_engine_args(self)

    @staticmethod
    def add_cli_args(parser):
        """vLLM's: every field as a --field-name flag of parser (and vLLM's other engine flags); returns parser
        (jaxllm/engine/cli_args.py)."""
        from jaxllm.engine.cli_args import add_cli_args

        return add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args) -> EngineArgs:
        """vLLM's: EngineArgs from a namespace add_cli_args' flags filled."""
        from jaxllm.engine.cli_args import from_cli_args

        return from_cli_args(args)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        """LLM(**kwargs): these fields, and every other keyword vLLM's EngineArgs has, taken, warned about or
        refused as jaxllm/engine/vllm_options.py's table says; anything else is vLLM's TypeError."""
        from jaxllm.engine.vllm_options import engine_kwargs_for_llm

        return cls(**engine_kwargs_for_llm(kwargs, {f.name for f in fields(cls)}))

    def config_overrides(self) -> dict:
        """What is set over config.json: hf_overrides, with rope_scaling / rope_theta (vLLM's older flags) merged
        in as vLLM does."""
        overrides = dict(self.hf_overrides or {})
        if self.rope_scaling:
            overrides["rope_scaling"] = self.rope_scaling
        if self.rope_theta is not None:
            overrides["rope_theta"] = self.rope_theta
        return overrides

    def overridden_config(self, hf: dict) -> dict:
        """config.json's dict with config_overrides() set over it. A rope_theta override also reaches a
        transformers 5 config's rope_parameters, whose own rope_theta would otherwise win (jaxllm/rope.py)."""
        overrides = self.config_overrides()
        for key, value in overrides.items():  # a quoted number ({"num_hidden_layers": "x"}) failed deep in start-up
            old = hf.get(key)
            if isinstance(old, (bool, int, float)) and isinstance(value, str):
                raise ValueError(
                    f"hf_overrides[{key!r}] must be of type {type(old).__name__}, as in config.json; got the string {value!r}."
                )
        out = {**hf, **overrides}
        rope = out.get("rope_parameters")
        if "rope_theta" in overrides and isinstance(rope, dict) and "rope_theta" in rope:
            out["rope_parameters"] = {**rope, "rope_theta": overrides["rope_theta"]}
        return out

    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config as the frozen SpeculativeConfig (ValueError in vLLM's words when it is invalid)."""
        if self.speculative_config is None:
            return SpeculativeConfig.from_value(legacy_speculative_config(vars(self)))
        return SpeculativeConfig.from_value(self.speculative_config)

    def validate(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if self.quantization is not None and self.quantization not in METHODS:
            raise ValueError(f"Unknown quantization method: {self.quantization}. Must be one of {list(METHODS)}.")
        if self.tokenizer_mode not in ("auto", "slow"):
            raise ValueError(
                f"tokenizer_mode={self.tokenizer_mode!r} is not supported; use 'auto' or 'slow' "
                "(jaxllm has no 'mistral' or 'custom' tokenizer modes)."
            )
        for name in ("hf_overrides", "override_generation_config", "rope_scaling"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict (JSON object), got {getattr(self, name)!r}.")
        if self.attention_backend not in ("auto", "reference", "pallas"):
            raise ValueError(f"attention_backend={self.attention_backend!r} is not one of auto, reference, pallas.")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        self._check_pooling()
        if self.enable_sleep_mode and (self.pipeline_parallel_size > 1 or self.data_parallel_size > 1):
            raise ValueError(
                "enable_sleep_mode needs an engine without pipeline stages or data-parallel replicas "
                f"(got pipeline_parallel_size={self.pipeline_parallel_size}, "
                f"data_parallel_size={self.data_parallel_size})."
            )
        from jaxllm.distributed import env_int
        from jaxllm.reasoning import check_name
        from kernels_pallas import requested_decode_backend

        check_name(self.reasoning_parser)
        # the decode-attention switches, read again where they act: a bad value fails here, before anything loads
        requested_decode_backend()
        env_int("JAXLLM_LONG_DECODE_CONTEXT")
        spec = self.speculative()
        if spec is not None:
            spec.check_parallel(self.tensor_parallel_size)
            if self.pipeline_parallel_size > 1:
                raise ValueError(
                    "Speculative decoding is not supported with pipeline parallelism yet (pipeline_parallel_size > 1)."
                )
        if self.lora_config() is not None:
            if self.pipeline_parallel_size > 1:
                raise ValueError(
                    "enable_lora is not supported with pipeline_parallel_size > 1 yet; use "
                    "tensor_parallel_size to split the model."
                )
            if spec is not None:
                raise ValueError("enable_lora is not supported with speculative decoding (speculative_config) yet.")
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_gpu_blocks_override",
            "kv_cache_memory_bytes",
        ):  # None: derived; anything else a positive int
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
