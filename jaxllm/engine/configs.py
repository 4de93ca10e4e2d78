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
        block_size=cache.block_size, gpu_memory_utilization=args.gpu_memory_utilization, swap_space=0,
        cache_dtype=args.kv_cache_dtype, is_attention_free=False, num_gpu_blocks_override=args.num_gpu_blocks_override,
        sliding_window=None, enable_prefix_caching=cache.enable_prefix_caching, prefix_caching_hash_algo="builtin",
        cpu_offload_gb=0, calculate_kv_scales=False, cpu_kvcache_space_bytes=None, mamba_page_size_padded=None,
        mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto", num_gpu_blocks=cache.num_blocks, num_cpu_blocks=0,
        kv_sharing_fast_prefill=False, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    return {k: str(v) for k, v in values.items()}


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
