"""Host-side engine configs: the KV cache's paging (CacheConfig) and the scheduler's limits (SchedulerConfig).

Both are frozen and keyword-only; validation errors are ValueErrors that name the field, with vLLM's wording
where vLLM has one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block (page)
    num_blocks: int  # pages in the KV cache, including the reserved null block 0 (see block_manager)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        _check_int("num_blocks", self.num_blocks, 2)  # block 0 is reserved, so at least one usable block

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_usable_tokens(self) -> int:
        return self.num_usable_blocks * self.block_size


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences in a step
    max_num_batched_tokens: int = 2048  # token budget of a step
    max_model_len: int  # prompt + output tokens of one sequence
    enable_chunked_prefill: bool = True
    max_loras: int | None = None  # LoRA: distinct adapters among the running sequences (None: LoRA off)

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_loras is not None:
            _check_int("max_loras", self.max_loras, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}). This effectively limits the maximum sequence length to "
                "max_num_batched_tokens and makes jaxllm reject longer sequences. Please increase "
                "max_num_batched_tokens or decrease max_model_len, or enable chunked prefill."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or equal to "
                f"max_num_seqs ({self.max_num_seqs})."
            )


def cache_config_info(cache: CacheConfig, args) -> dict[str, str]:
    """vLLM's vllm:cache_config_info labels (its CacheConfig's fields as strings) for this engine's KV cache;
    args: the EngineArgs. jaxllm has no swap, CPU offload, sliding-window override or mamba cache: those report
    what an engine without them has (0 / None / False / auto)."""
    values = dict(
        block_size=cache.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=0,
        cache_dtype=args.kv_cache_dtype,
        is_attention_free=False,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        sliding_window=None,
        enable_prefix_caching=cache.enable_prefix_caching,
        prefix_caching_hash_algo="builtin",
        cpu_offload_gb=0,
        calculate_kv_scales=False,
        cpu_kvcache_space_bytes=None,
        mamba_page_size_padded=None,
        mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype="auto",
        num_gpu_blocks=cache.num_blocks,
        num_cpu_blocks=0,
        kv_sharing_fast_prefill=False,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
    )
    return {k: str(v) for k, v in values.items()}


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Keys of vLLM's speculative_config that jaxllm reads; others vLLM accepts are refused by name (a typo or an
# option we do not implement must not be silently ignored).
_SPEC_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "draft_tensor_parallel_size",
    "disable_by_batch_size",
)


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """vLLM's speculative_config (the server's --speculative-config JSON, LLM(speculative_config=...)).

    method: ngram (prompt lookup, no model), draft_model (a small model sharing the tokenizer, with its own paged
    KV), eagle / eagle3 (an EAGLE head over the target's hidden states). Without method it is read from model:
    "ngram" there means ngram; a model's own config decides between draft_model and eagle/eagle3 (setup does
    that, see jaxllm.spec_decode.heads.detect_method), so method may be None until then.
    disable_by_batch_size: a step with at least this many running sequences does not speculate (None: the engine
    picks it from its cost model, see jaxllm.spec_decode.policy)."""

    method: str | None = None
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    draft_tensor_parallel_size: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config method={self.method!r} is not supported; jaxllm supports "
                f"{', '.join(SPEC_METHODS)}."
            )
        n = self.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"Expected num_speculative_tokens to be greater than zero ({n}).")
        if self.method == "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{name}={v} must be > 0")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"prompt_lookup_min={self.prompt_lookup_min} must be <= prompt_lookup_max={self.prompt_lookup_max}"
                )
        elif self.model is None:
            raise ValueError(
                f"speculative_config method={self.method!r} needs a 'model' (the draft model or EAGLE head directory)."
            )
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 2):
            raise ValueError(
                "Expect the batch size threshold of disabling speculative decoding is > 1, but got "
                f"self.disable_by_batch_size={b}"
            )

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict or its JSON text (vLLM's forms) -> SpeculativeConfig or None; errors
        are ValueErrors in vLLM's words."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or its JSON text, got {type(value).__name__}.")
        if "tensor_parallel_size" in value:  # vLLM warns about this mistake too
            raise ValueError("speculative_config: use 'draft_tensor_parallel_size', not 'tensor_parallel_size'.")
        unknown = sorted(set(value) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unsupported keys {unknown}; jaxllm reads {list(_SPEC_KEYS)}.")
        kw = dict(value)
        method, model = kw.get("method"), kw.get("model")
        if method == "[ngram]" or method is None and model in ("ngram", "[ngram]"):
            method = "ngram"
        if method is not None and method not in SPEC_METHODS:  # before the model checks, which assume a method
            raise ValueError(
                f"speculative_config method={method!r} is not supported; jaxllm supports {', '.join(SPEC_METHODS)}."
            )
        if method == "ngram":
            model = None
            lo, hi = kw.get("prompt_lookup_min"), kw.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo = hi = 5  # vLLM's defaults
            kw["prompt_lookup_min"] = hi if lo is None else lo
            kw["prompt_lookup_max"] = lo if hi is None else hi
        elif model is None and kw.get("num_speculative_tokens") is not None:
            raise ValueError("num_speculative_tokens was provided without speculative model.")
        if kw.get("num_speculative_tokens") is None:
            raise ValueError(
                "num_speculative_tokens must be provided with speculative model unless the draft model "
                "config contains an n_predict parameter."
            )
        kw.update(method=method, model=model)
        return cls(**kw)

    def check_parallel(self, tensor_parallel_size: int) -> None:
        """vLLM's rule for draft_tensor_parallel_size: 1 or the target's."""
        d = self.draft_tensor_parallel_size
        if d is not None and d not in (1, tensor_parallel_size):
            raise ValueError(
                f"speculative_draft_tensor_parallel_size={d} cannot be other value than 1 or target "
                "model tensor_parallel_size"
            )

    @property
    def uses_model(self) -> bool:
        return self.method != "ngram"
