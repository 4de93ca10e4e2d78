"""From EngineArgs to a ready engine: config, weights, KV-cache sizing, runner (tokenizer side: tokenizer_setup.py;
the device memory asked for before JAX starts: device_memory.py)."""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

from jaxllm.config import ModelConfig, read_hf_config
from jaxllm.engine.args import EngineArgs
from jaxllm.engine.configs import CacheConfig, SchedulerConfig
from jaxllm.engine.device_memory import allocator_fraction, gpu_device, request_device_memory
from jaxllm.engine.model_files import resolve_model_dir
from jaxllm.engine.tokenizer_setup import tokenizer_parts

logger = logging.getLogger("jaxllm")

_CPU_KV_BYTES = 1 << 30  # default KV budget per device where the device reports no memory (CPU)


@dataclass
class EngineParts:
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    runner: object
    tokenizer: object
    eos_token_ids: set[int]
    generation_defaults: dict
    mesh: object
    grammars: object  # structured.Grammars
    speculation: object = None  # spec_decode.setup.Speculation when speculative decoding is on
    lora: object = None  # jaxllm.lora.slots.LoRASlots with enable_lora
    pooler: object = None  # jaxllm.pooling_params.PoolerConfig of an embedding (pooling) model, else None


def _is_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def default_limits(args: EngineArgs, gpu: bool, device: tuple[int, str] | None = None) -> tuple[int, int]:
    """vLLM's defaults: on a GPU of 70 GiB or more that is not an A100, 1024 sequences and 16384 tokens a step
    (8192 for the server), on other GPUs 256 and 8192 (2048); small ones on CPU, where every shape bucket costs
    compile time. device: (total bytes, name) of the first GPU (device_memory.gpu_device; None: unknown, taken as big)."""
    if gpu:
        total, name = device or (1 << 62, "")
        big = total >= 70 * 2**30 and "a100" not in name.lower()
        seqs = args.max_num_seqs or (1024 if big else 256)
        tokens = args.max_num_batched_tokens or (
            (8192 if args.server_mode else 16384) if big else (2048 if args.server_mode else 8192)
        )
    else:
        seqs = args.max_num_seqs or 8
        tokens = args.max_num_batched_tokens or 256
    # a default token budget grows to the sequences; an explicit one below them is refused (SchedulerConfig), as vLLM
    return seqs, tokens if args.max_num_batched_tokens else max(tokens, seqs)


def build_engine_parts(args: EngineArgs, devices=None) -> EngineParts:
    """devices: the engine's (a data-parallel replica's group); default: the first tp * pp of jax.devices()."""
    args.validate()
    request_device_memory(args.gpu_memory_utilization, args.pipeline_parallel_size, args.tensor_parallel_size)
    from jaxllm.distributed import initialize, watchdog

    # Several processes: LLM() in each (vLLM's external_launcher) joins the cluster JAX_COORDINATOR_ADDRESS,
    # JAX_NUM_PROCESSES and JAX_PROCESS_ID describe, unless the caller already did (jaxllm.distributed).
    initialize()
    import jax

    if jax.process_count() == 1:
        return _build_engine_parts(args, devices)
    watchdog().arm()  # start-up runs collectives: a process lost meanwhile must not leave the others waiting
    try:
        return _build_engine_parts(args, devices)
    finally:
        watchdog().disarm()


def _build_engine_parts(args: EngineArgs, devices) -> EngineParts:
    import jax

    if args.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    path = resolve_model_dir(args)  # a model id downloads here
    hf = read_hf_config(path)
    hf = args.overridden_config(hf)  # vLLM's hf_overrides (and --rope-scaling / --rope-theta) over config.json
    # The tokenizer (and the transformers import) loads on a thread while jax starts its backend and the
    # engine's shapes are worked out; it must load before the weights and the compiles (_build_parts waits for
    # it there), so that a bad tokenizer fails in seconds, as in vLLM, not after minutes of loading.
    pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-tokenizer")
    tokenizer_future = pool.submit(tokenizer_parts, args, path, hf)
    pool.shutdown(wait=False)  # its thread ends after this one task
    try:
        return _build_parts(args, path, hf, tokenizer_future, devices)
    except BaseException:
        # A failed LLM() that returns while the thread still imports transformers leaves the module half
        # imported for a retry in the same process (AttributeError on PreTrainedTokenizerFast).
        wait([tokenizer_future])
        raise


def _build_parts(args: EngineArgs, path: str, hf: dict, tokenizer_future, devices=None) -> EngineParts:
    import jax

    from jaxllm.engine.runner import ModelRunner
    from jaxllm.models.attention import AttentionConfig
    from jaxllm.models.loader import abstract_weights, check_checkpoint, load_params
    from jaxllm.models.moe_quant import dequantized_bytes as experts_dequantized_bytes
    from jaxllm.sharding import ParallelConfig

    cfg = ModelConfig.from_hf(hf, dtype=args.dtype, quantization=args.quantization, model_dir=path)
    lora_cfg = args.lora_config()
    pooler = None
    if args.pooling:  # an embedding model: its pooler from its sentence-transformers files, before any weight loads
        from jaxllm.pooling_params import PoolerConfig

        if jax.process_count() > 1:
            raise ValueError("An embedding (pooling) model runs in one process.")
        pooler = PoolerConfig.resolve(path, args.pooler_config or args.override_pooler_config, hf)
    check_checkpoint(path, cfg, args.load_format)  # quantized tensors against their config, from file headers
    if args.enable_expert_parallel:
        if cfg.moe is None:  # as vLLM: the flag only concerns MoE layers
            logger.warning(
                "enable_expert_parallel has no effect: %s has no mixture-of-experts layers.", cfg.architecture
            )
        else:
            cfg = replace(cfg, expert_parallel=True)
    derived, derived_from = cfg.derived_max_model_len()
    max_model_len = args.max_model_len or derived
    if max_model_len > derived:
        msg = (
            f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
            f"({derived}: {derived_from} in model's config.json)."
        )
        caution = (
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution: positions past the derived length are "
            "outside what the model was trained on (RoPE models degrade, ALiBi ones extrapolate)."
        )
        if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower() not in ("1", "true"):
            raise ValueError(
                f"{msg} To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. {caution}"
            )
        logger.warning("%s Make sure the value is correct and within the model context size. %s", msg, caution)
    gpu = _is_gpu()
    max_num_seqs, max_num_batched_tokens = default_limits(args, gpu, gpu_device() if gpu else None)
    if not args.enable_chunked_prefill and not args.max_num_batched_tokens:  # (an explicit one is checked below)
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    SchedulerConfig(  # its checks before anything loads (vLLM's, on the values the user gave)
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
    )
    backend = args.attention_backend
    if backend == "auto":
        backend = "pallas" if gpu else "reference"

    if jax.process_count() > 1:  # one engine over several processes (hosts): jaxllm/engine/multihost.py
        from jaxllm.engine.multihost import MultiHost

        MultiHost.check_args(args)  # what it cannot run yet, before anything loads
    speculation = None
    spec = args.speculative()  # speculative_config, or vLLM 0.8.0's separate options
    if spec is not None:  # the drafter's config is checked before any weights load
        from jaxllm.spec_decode.setup import plan

        speculation = plan(spec, cfg, gpu=gpu, max_num_seqs=max_num_seqs)
    mesh = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size).make_mesh(devices)
    multihost = MultiHost(mesh) if jax.process_count() > 1 else None
    lora = None
    if lora_cfg is not None:  # its device slots before the KV cache is sized (they are in bytes_in_use then)
        from jaxllm.lora.slots import LoRASlots

        lora = LoRASlots(lora_cfg, cfg, mesh)
        lora.warm_up()
    per_block = ModelRunner.kv_bytes_per_block(
        cfg, args.block_size, args.kv_cache_dtype, args.tensor_parallel_size, args.pipeline_parallel_size
    )
    tokenizer, eos, defaults, grammars = tokenizer_future.result()  # before any weight loads or step compiles
    if speculation is not None:  # the drafter's weights (on the device before the KV cache is sized) and pages
        speculation.load(mesh, args.load_format, args.seed)
        per_block += speculation.kv_bytes_per_block(args.block_size, args.tensor_parallel_size)
    # Without pipeline stages (whose warm-up runs them) the steps compile while the weights load on a thread:
    # what they are compiled for (abstract_weights) and the memory left for the KV cache are known before.
    overlap = args.pipeline_parallel_size == 1 and not args.enforce_eager
    t0 = time.perf_counter()

    def load():
        params = load_params(path, cfg, mesh, load_format=args.load_format, seed=args.seed)
        jax.block_until_ready(params)
        logger.info("Loaded %s weights (%s) in %.1f s", path, args.load_format, time.perf_counter() - t0)
        return params

    if overlap:
        params = abstract_weights(cfg, mesh)
        weight_bytes = sum(
            math.prod(p.sharding.shard_shape(p.shape)) * p.dtype.itemsize for p in jax.tree.leaves(params)
        ) + (speculation.weight_bytes if speculation else 0)
    else:
        params, weight_bytes = load(), 0
    # ... or one MoE layer's routed experts, dequantized together for its grouped matmul (models/moe_quant.py)
    dequantized = max(
        _dequantized_bytes(params, cfg),
        experts_dequantized_bytes(cfg, args.tensor_parallel_size, max_num_batched_tokens),
    )
    num_blocks = _num_blocks(
        args,
        per_block,
        max_num_batched_tokens,
        max_num_seqs,
        cfg,
        gpu,
        weight_bytes,
        dequantized,
        device=_first_local(mesh),
    )
    if multihost is not None:  # the KV cache's shape and the compiled buckets must be the same everywhere
        num_blocks = multihost.agree_engine(cfg, args, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len)
    _check_one_sequence_fits(num_blocks, args.block_size, max_model_len)
    weights = None
    if overlap:
        pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-weights")
        weights = pool.submit(load)
        pool.shutdown(wait=False)
    spec_kw = speculation.runner_kwargs() if speculation is not None else {}

    def warmed_up_runner(num_blocks, params, weights):
        runner = ModelRunner(
            cfg,
            params,
            mesh,
            num_blocks=num_blocks,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            attn_config=AttentionConfig(backend=backend),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            max_logprobs=cfg.vocab_size if args.max_logprobs == -1 else max(args.max_logprobs, 1),
            executable_cache_dir=_executable_cache_dir(args),
            multihost=multihost,
            lora=lora,
            **spec_kw,
        )
        runner.warm_up(enforce_eager=args.enforce_eager, weights=weights)
        return runner

    try:
        runner = warmed_up_runner(num_blocks, params, weights)
    except BaseException:
        if weights is not None:
            wait([weights])  # no weights left loading behind a failed start (device memory, a retry)
        raise
    # The KV cache was sized with an estimate of the steps' working memory (_step_reserve); the compiled steps
    # now say what they need (vLLM measures a dummy forward pass instead). Where they need more, the cache
    # gives up the difference and the steps are compiled again for its new shape, rather than the first large
    # step running out of memory (an 8B GPTQ engine's prefill step did: bench/results/quant_h100_23c93ec_log.txt).
    if gpu and not (args.num_gpu_blocks_override or args.kv_cache_memory_bytes or args.enforce_eager):
        reserve = _step_reserve(max_num_batched_tokens, max_num_seqs, cfg, dequantized)
        temp = runner.programs.temp_bytes()
        fewer = _blocks_for_step_temps(num_blocks, per_block, reserve, temp)
        if multihost is not None:  # every process's cache keeps the same shape
            fewer = multihost.agree({"fewer": fewer}, take_min=("fewer",))["fewer"]
        logger.info(
            "The compiled steps' largest temporary buffer: %.2f GiB (%.2f GiB kept beside the KV cache)",
            temp / 2**30,
            (reserve - _STEP_SLACK_BYTES) / 2**30,
        )
        if fewer < num_blocks:
            logger.warning(
                "The compiled steps need %.2f GiB of temporary device memory, more than the %.2f GiB kept beside "
                "the KV cache: the KV cache shrinks from %d to %d blocks and the steps are compiled again for it.",
                temp / 2**30,
                (reserve - _STEP_SLACK_BYTES) / 2**30,
                num_blocks,
                fewer,
            )
            params = runner.params
            for a in jax.tree.leaves((runner.kv_caches, runner.draft_kv)):  # (and the drafter's pages, if any)
                a.delete()
            runner = None  # its executables too: the new cache's shape is every step's argument
            _check_one_sequence_fits(fewer, args.block_size, max_model_len)
            num_blocks = fewer
            runner = warmed_up_runner(num_blocks, params, None)
    cache_cfg = CacheConfig(
        block_size=args.block_size, num_blocks=num_blocks, enable_prefix_caching=args.enable_prefix_caching
    )
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_loras=lora_cfg.max_loras if lora_cfg else None,
    )
    tokens = (num_blocks - 1) * args.block_size
    logger.info("KV cache size: %d tokens", tokens)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_model_len, tokens / max_model_len)
    if not args.enforce_eager:
        logger.info("Weights loaded and all shape buckets compiled in %.1f s", time.perf_counter() - t0)

    return EngineParts(
        cfg,
        sched_cfg,
        cache_cfg,
        runner,
        tokenizer,
        eos,
        defaults,
        mesh,
        grammars,
        speculation=speculation,
        lora=lora,
        pooler=pooler,
    )


def _executable_cache_dir(args: EngineArgs) -> str | None:
    """Compiled steps (jaxllm/engine/exec_cache.py) go in a folder of the compilation cache; off without it."""
    if not args.compilation_cache_dir:
        return None
    return os.path.join(os.path.expanduser(args.compilation_cache_dir), "jaxllm_executables")


_MIN_WORKSPACE_BYTES = 1 << 30
# Kept free beside a compiled step's temporary buffer: its outputs, the packed host inputs, allocator rounding.
_STEP_SLACK_BYTES = 256 << 20


def _check_one_sequence_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    needed = -(-max_model_len // block_size) + 1
    if num_blocks < needed:
        raise ValueError(
            f"The KV cache fits {num_blocks - 1} blocks of {block_size} tokens "
            f"({(num_blocks - 1) * block_size} tokens), fewer than one sequence of max_model_len="
            f"{max_model_len} needs. Increase gpu_memory_utilization (or kv_cache_memory_bytes / "
            f"num_gpu_blocks_override), or decrease max_model_len."
        )


def _dequantized_bytes(params, cfg) -> int:
    """The largest weight a step dequantizes whole (this device's shard, in the model's dtype): int weights on the
    prefill path (kernels_pallas.quant), fp8 weights with 16-bit activations always; 0 without such weights."""
    import jax
    import numpy as np

    from jaxllm.models.quant import QuantizedWeight

    out = 0
    for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight)):
        if not isinstance(w, QuantizedWeight) or (w.scheme.weight_type == "float" and w.scheme.activations):
            continue
        values = math.prod(w.packed.sharding.shard_shape(w.packed.shape))
        values *= 32 // w.scheme.bits if w.scheme.weight_type == "int" and not w.layout.nk else 1
        out = max(out, values * np.dtype(cfg.dtype).itemsize)
    return out


def _step_reserve(max_tokens: int, max_seqs: int, cfg, dequantized_bytes: int = 0, temp_bytes: int = 0) -> int:
    """Device memory the KV cache leaves free for the steps' working memory: the largest of an estimate of the
    activations, the GEMM autotuner's operand copies, a floor, and (once compiled) the steps' own temporary
    buffer plus _STEP_SLACK_BYTES."""
    import jax

    # Activation peak of the largest step: hidden states, MLP intermediates and the logits/sort buffers, and the
    # largest weight a quantized model's prefill dequantizes (one at a time: kernels_pallas.quant.tie_to_input).
    act = max_tokens * (6 * cfg.hidden_size + 3 * cfg.intermediate_size) * 4 + max_seqs * cfg.vocab_size * 4 * 4
    act += dequantized_bytes
    # XLA's GEMM autotuner works on its own copies of a GEMM's operands (the largest: the [V, D] embedding /
    # lm_head). Warm-up compiles with the KV cache's memory free (ModelRunner.warm_up), but a variant
    # compiled later (a request's sampler flags) autotunes next to the allocated cache. The activation
    # buffers are not live then, so the same headroom serves both. Without it an 8B model with
    # max_num_batched_tokens 128 left too little and compiling failed with RESOURCE_EXHAUSTED on an H100.
    act = max(act, 2 * cfg.vocab_size * cfg.hidden_size * jax.numpy.dtype(cfg.dtype).itemsize)
    # And a floor for what does not scale with the model (cuBLAS / XLA workspaces, Pallas scratch, the
    # sampler's buffers): a tiny model on an H100 was given all but ~60 MB and its first step ran out of memory.
    act = max(act, _MIN_WORKSPACE_BYTES)
    return max(act, temp_bytes + _STEP_SLACK_BYTES) if temp_bytes else act


def _blocks_for_step_temps(num_blocks: int, per_block: int, reserve: int, temp_bytes: int) -> int:
    """num_blocks less the blocks whose memory the compiled steps' temporary buffer (temp_bytes) needs beyond the
    reserve the KV cache was sized with."""
    short = temp_bytes + _STEP_SLACK_BYTES - reserve
    return num_blocks if temp_bytes == 0 or short <= 0 else num_blocks - -(-short // per_block)


def _first_local(mesh):
    """This process's first device of mesh (whose free memory sizes the KV cache)."""
    import jax

    return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())


def _num_blocks(
    args, per_block, max_tokens, max_seqs, cfg, gpu, weight_bytes: int = 0, dequantized_bytes: int = 0, device=None
) -> int:
    """KV blocks that fit on device (default jax.devices()[0]); weight_bytes: this device's weights when they are
    not loaded yet; dequantized_bytes: see _dequantized_bytes."""
    if args.num_gpu_blocks_override:
        return args.num_gpu_blocks_override
    if args.kv_cache_memory_bytes:
        return max(args.kv_cache_memory_bytes // per_block, 2)
    import jax

    stats = (device or jax.devices()[0]).memory_stats() if gpu else None
    if not stats:
        return max(_CPU_KV_BYTES // per_block, 2)
    limit = stats.get("bytes_limit", 0)
    in_use = stats.get("bytes_in_use", 0) + weight_bytes  # weights (this device's shard)
    act = _step_reserve(max_tokens, max_seqs, cfg, dequantized_bytes)
    # bytes_limit is the allocator's fraction of the device (request_device_memory); the budget is
    # gpu_memory_utilization of the whole device, and no more than the allocator can hand out.
    budget = int(min(limit, limit / allocator_fraction() * args.gpu_memory_utilization))
    free = budget - in_use - act
    if free <= 0:
        raise ValueError(
            f"No memory left for the KV cache: device limit {limit / 2**30:.1f} GiB, weights "
            f"{in_use / 2**30:.1f} GiB, activations ~{act / 2**30:.1f} GiB. Increase gpu_memory_utilization, "
            f"lower max_num_batched_tokens / max_num_seqs, or use more tensor parallelism."
        )
    return max(free // per_block, 2)  # per_block is per device, like free
