"""ModelRunner: SchedulerOutput -> StepInputs (padded numpy) -> one compiled step on the device.

Shapes are bucketed (T tokens, B sequences; the block table always has max_model_len / S columns) and each
(bucket, sampler flags) variant is compiled once, ahead of time for the default flags, or loaded untraced
from the executable cache (exec_cache.py) on a warm start. The KV cache is donated to every step. A step
returns immediately (JAX dispatches asynchronously); the engine collects its results later, so the host
prepares step N+1 while the device runs step N. Tokens a step samples stay on the device too: the next step
reads them from `prev_tokens` for sequences whose input is still pending.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from operator import attrgetter

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.engine.exec_cache import ExecutableCache
from jaxllm.engine.input_batch import (ALLOWED_IDS, FILTERING, HAS_PARAMS, LOGPROBS, PADDING_ROW, PENALTIES,
                                      PROMPT_LOGPROBS, STRUCTURED, InputBatch)
from jaxllm.engine.inputs import bucket, step_inputs
from jaxllm.engine.sampler import SamplerFlags, SamplingMetadata, pad_rows, sample
from jaxllm.engine.scheduler import SchedulerOutput
from jaxllm.lora.ops import LoRAInputs
from jaxllm.models.attention import AttentionConfig, AttentionMetadata
from jaxllm.models.decoder import compute_logits, forward
from jaxllm.sharding import kv_cache_specs, make_kv_caches, mesh_pp

logger = logging.getLogger(__name__)

KV_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
PAD_PAGE = 0  # block 0 is reserved by the block manager: safe for padding to point at
# Field readers for map() over a step's sequences in prepare(): a C-level loop, several times cheaper than a
# Python one at 256 sequences. ScheduledSeq fields, then Sequence fields.
_seq, _start, _num_tokens, _sample, _token_ids = map(attrgetter, ("seq", "start", "num_tokens", "sample", "token_ids"))
_seq_id, _bias_row, _output_token_ids, _num_pending, _token_bitmask = map(
    attrgetter, ("seq_id", "bias_row", "output_token_ids", "num_pending", "token_bitmask"))


def kv_storage_dtype(dtype):
    """The KV cache's element type in memory. On CPU, bfloat16 / float16 pages are stored as float32: XLA's
    CPU backend widens a 16-bit scatter's whole operand to float32 and back, so every KV write copied every
    layer's cache (the demo model: ~1 s per token at the default KV size; a float32 scatter is in place).
    The values stay those of the model's dtype (each written value is one of them, and the CPU attention
    reads pages as float32 anyway), so outputs do not change; the cache holds half the tokens per byte."""
    if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return dtype


# The smallest decode bucket (padded sequences). A batch-1 decode step of the Llama-3-8B shape on an H100
# (bench/step_probe.py --rows, XProf): 1 row 5.63 ms (XLA turns the M = 1 qkv GEMM into a 23 us reduction
# instead of an 18.7 us GEMM), 2 rows 5.44 ms, 8 rows 5.61 ms (the attention grid and the small fusions run
# over 4x the rows; bench/results/step_probe_h100_30bea4e_rows*.json).
SMALLEST_SEQ_BUCKET = 2


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


def step_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sequence buckets, token buckets) of the compiled steps: powers of two from SMALLEST_SEQ_BUCKET sequences
    and 16 tokens up to the limits. The one place the lists are made (bench/padding_waste.py replays workloads
    on other lists; bench/bucket_ab.py times them)."""
    return (pow2_buckets(min(SMALLEST_SEQ_BUCKET, max_num_seqs), max_num_seqs),
            pow2_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens))


@dataclass(frozen=True)
class StepVariant:
    num_tokens: int  # T bucket
    num_seqs: int  # B bucket
    decode_only: bool
    flags: SamplerFlags
    prompt_logprobs: int  # top-k for prompt logprobs, 0 = off
    sampler_widths: tuple = (1, 1, 1, 1, 1, 1)  # padded widths of the ragged sampling rows, then the number of
    # structured-output masks (SamplingMetadata.token_bitmask)

    @property
    def shape_name(self) -> str:
        """B x T, with a trailing d for decode-only steps (logs, benchmark rows)."""
        return f"{self.num_seqs}x{self.num_tokens}{'d' if self.decode_only else ''}"


@dataclass
class StepHandle:
    """A dispatched step: device results plus what is needed to read them."""

    sched: SchedulerOutput
    rows: dict[str, int]  # seq_id -> row of the sampled outputs (sample=True chunks only)
    outputs: tuple  # device arrays
    prompt_rows: dict[str, tuple[int, int, int]]  # seq_id -> (first token index, count, first prompt position)
    num_logprobs: int


@dataclass
class PreparedStep:
    """One step's host-side inputs (numpy) and its variant, before dispatch."""

    variant: StepVariant
    host_args: tuple  # (token_ids [T], src_rows [T], meta, logits_indices [B], smd, prompt_targets [T])
    sample_rows: dict[str, int]
    prompt_rows: dict[str, tuple[int, int, int]]
    num_logprobs: int
    masked: list = dataclasses.field(default_factory=list)  # (row of smd.token_bitmask, the sequence whose mask it is)
    sched: SchedulerOutput | None = None


@dataclass
class StepResult:
    tokens: np.ndarray  # [B]
    logprobs: np.ndarray  # [B]
    ranks: np.ndarray  # [B]
    top_ids: np.ndarray  # [B, k]
    top_logprobs: np.ndarray  # [B, k]
    prompt: tuple | None  # (target logprobs [T], ranks [T], top ids [T, k], top logprobs [T, k])


def _step_fn(params, kv_caches, token_ids, src_rows, prev_tokens, meta, logits_indices, smd, prompt_targets,
             lora: LoRAInputs | None = None, *, cfg: ModelConfig, attn: AttentionConfig, flags: SamplerFlags,
             prompt_k: int):
    # Inputs that are still on the device: the previous step's sampled token of that sequence.
    token_ids = jnp.where(src_rows >= 0, prev_tokens[jnp.maximum(src_rows, 0)], token_ids)
    kv_caches, hidden = forward(params, kv_caches, token_ids, meta, cfg, attn, lora=lora)
    rows = hidden[logits_indices]
    # The sampled rows' hidden states are returned too ([B, D]: small; returning the [B, V] float32 logits
    # instead cost 3.6% of the throughput workload's time on an H100): a step whose sampler flags are not the
    # default can run this program and a sampler-only program on them (ModelRunner.execute).
    lora_head = None if lora is None else lora.weights["lm_head"]
    logits = compute_logits(params, rows, cfg, lora_head, smd.lora_slots)
    return (kv_caches, *_sample_fn(params, hidden, prev_tokens, logits, smd, prompt_targets, cfg=cfg,
                                   flags=flags, prompt_k=prompt_k, lora=lora), rows)


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["treedef", "leaves"])
@dataclass(frozen=True)
class PackedLayout:
    """Where each host input of a step sits in its two transfer buffers (a pytree with no leaves: static).
    leaves: per leaf of treedef, (dtype name, shape, "i" (int32 buffer) or "f" (float32 buffer), offset)."""

    treedef: object
    leaves: tuple


def pack_host_args(host_args) -> tuple[np.ndarray, np.ndarray, PackedLayout]:
    """A step's ~23 host arrays (token ids, attention metadata, the sampling arrays) as one int32 and one
    float32 array: two host-to-device transfers per step instead of one per array, and fewer graph nodes for
    XLA to repoint at new input buffers. int32 leaves go in as they are, uint32 as their bits, bool as 0 / 1."""
    leaves, treedef = jax.tree.flatten(host_args)
    ints, floats, spec, ni, nf = [], [], [], 0, 0
    for x in leaves:
        x = np.asarray(x)
        if x.dtype == np.float32:
            spec.append(("float32", x.shape, "f", nf))
            nf += _append_aligned(floats, x.ravel())
            continue
        if x.dtype == np.uint32:
            flat = x.ravel().view(np.int32)
        elif x.dtype in (np.int32, np.bool_):
            flat = x.ravel().astype(np.int32, copy=False)
        else:
            raise TypeError(f"step input of dtype {x.dtype} cannot be packed (int32, uint32, bool, float32)")
        spec.append((x.dtype.name, x.shape, "i", ni))
        ni += _append_aligned(ints, flat)
    cat = lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt)  # noqa: E731
    return cat(ints, np.int32), cat(floats, np.float32), PackedLayout(treedef, tuple(spec))


# Each packed array starts at a multiple of 256 bytes: a static slice of a step argument can reach a kernel
# as that argument's buffer at the slice's offset, and Mosaic GPU kernels refuse inputs that are not 256-byte
# aligned ("Input buffer 1 is not 256-byte aligned": the decode kernel's block table, at the engine's batch
# shapes; bench/mosaic_align_probe.py).
_PACK_ALIGN = 256 // 4
_PADS = {np.dtype(dt): np.zeros(_PACK_ALIGN, dt) for dt in (np.int32, np.float32)}


def _append_aligned(parts: list, flat: np.ndarray) -> int:
    """Appends flat (int32 or float32) and the zeros that round it up to a whole number of _PACK_ALIGN
    elements; returns how many elements that added."""
    pad = -flat.size % _PACK_ALIGN
    parts.append(flat)
    if pad:
        parts.append(_PADS[flat.dtype][:pad])
    return flat.size + pad


def unpack_host_args(ints, floats, layout: PackedLayout):
    """pack_host_args inverted inside the jitted step (static slices of the two buffers)."""
    out = []
    for dtype, shape, buf, off in layout.leaves:
        n = int(np.prod(shape, dtype=np.int64))
        x = jax.lax.slice(ints if buf == "i" else floats, (off,), (off + n,)).reshape(shape)
        if dtype == "uint32":
            x = jax.lax.bitcast_convert_type(x, jnp.uint32)
        elif dtype == "bool":
            x = x != 0
        out.append(x)
    return jax.tree.unflatten(layout.treedef, out)


def _packed_step_fn(params, kv_caches, ints, floats, prev_tokens, layout: PackedLayout, lora_weights=None, *,
                    cfg: ModelConfig, attn: AttentionConfig, flags: SamplerFlags, prompt_k: int):
    """_step_fn on the host inputs as pack_host_args made them; with LoRA, the slot arrays (jaxllm/lora/slots.py)
    and, as the host inputs' last item, each token's slot."""
    token_ids, src_rows, meta, logits_indices, smd, prompt_targets, token_slots = unpack_host_args(ints, floats,
                                                                                                   layout)
    lora = None if lora_weights is None else LoRAInputs(lora_weights, token_slots)
    return _step_fn(params, kv_caches, token_ids, src_rows, prev_tokens, meta, logits_indices, smd, prompt_targets,
                    lora, cfg=cfg, attn=attn, flags=flags, prompt_k=prompt_k)


def _sample_logits_fn(logits, prev_tokens, smd, *, flags: SamplerFlags):
    """Sampling from the logits of the B sampled rows; prev_tokens only gives the next one's shape."""
    tokens, lp, ranks, top_ids, top_lp = sample(logits, smd, flags)
    next_prev = jnp.zeros_like(prev_tokens).at[: tokens.shape[0]].set(tokens)
    return next_prev, (tokens, lp, ranks, top_ids, top_lp)


def _sample_rows_fn(head, rows, prev_tokens, smd, *, cfg: ModelConfig, flags: SamplerFlags):
    """The sampler-only program: logits of the sampled rows' hidden states (head: the final norm and output
    weights), then sampling."""
    logits = compute_logits(head, rows, cfg, head.get("lora_lm_head"), smd.lora_slots)
    return _sample_logits_fn(logits, prev_tokens, smd, flags=flags)


def _packed_sample_rows_fn(head, rows, prev_tokens, ints, floats, layout: PackedLayout, *, cfg: ModelConfig,
                           flags: SamplerFlags):
    """_sample_rows_fn on sampling arrays packed as pack_host_args packs a step's: two host-to-device transfers
    per call instead of one per array (~20)."""
    return _sample_rows_fn(head, rows, prev_tokens, unpack_host_args(ints, floats, layout), cfg=cfg, flags=flags)


def _sample_fn(params, hidden, prev_tokens, logits, smd, prompt_targets, *, cfg: ModelConfig,
               flags: SamplerFlags, prompt_k: int, lora: LoRAInputs | None = None):
    """Sampling and prompt logprobs from the sampled rows' logits and the last layer's hidden states (also
    the pipeline's tail)."""
    next_prev, outputs = _sample_logits_fn(logits, prev_tokens, smd, flags=flags)
    prompt = None
    if prompt_k:
        lora_head = (None, None) if lora is None else (lora.weights["lm_head"], lora.token_slots)
        all_lp = jax.nn.log_softmax(compute_logits(params, hidden, cfg, *lora_head), axis=-1)
        tgt = jnp.maximum(prompt_targets, 0)
        t_lp = jnp.take_along_axis(all_lp, tgt[:, None], axis=-1)[:, 0]
        t_rank = (all_lp > t_lp[:, None]).sum(-1).astype(jnp.int32) + 1
        p_lp, p_ids = jax.lax.top_k(all_lp, prompt_k)
        prompt = (t_lp, t_rank, p_ids.astype(jnp.int32), p_lp)
    return next_prev, outputs, prompt


def _pipeline_head_fn(params, hidden, prev_tokens, logits_indices, smd, prompt_targets, *, cfg: ModelConfig,
                      flags: SamplerFlags, prompt_k: int):
    """pp > 1: the last stage's hidden states -> logits and sampling (one jit per flags on the last stage)."""
    logits = compute_logits(params, hidden[logits_indices], cfg)
    return _sample_fn(params, hidden, prev_tokens, logits, smd, prompt_targets, cfg=cfg, flags=flags,
                      prompt_k=prompt_k)


def _spec(a) -> jax.ShapeDtypeStruct:
    """A device array's shape, dtype and sharding (to lower a program without holding the array)."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


# SamplingMetadata's ragged per-row fields, padded with (fill, dtype); a StepVariant's sampler_widths are their
# widths in this order, all 1 (one column of fill) unless the step's flags need them.
_ROW_FIELDS = (("penalty_tokens", -1, np.int32), ("penalty_is_output", False, bool), ("bias_ids", -1, np.int32),
               ("bias_values", 0.0, np.float32), ("allowed_ids", -1, np.int32))


def _plain(smd: SamplingMetadata) -> SamplingMetadata:
    """smd with the default flags' one-column ragged rows (the start-up programs' shapes); the start-up
    program's own sampling is discarded when the flags are not the default."""
    B = smd.temperature.shape[0]
    return dataclasses.replace(smd, **{name: np.full((B, 1), fill, dtype) for name, fill, dtype in _ROW_FIELDS},
                               token_bitmask=np.full((1, 1), -1, np.int32), bitmask_slot=np.full(B, -1, np.int32))


# decode-only steps of at least this many sequences (bucket) are compiled with XLA's Triton GEMMs off (cuBLAS)
CUBLAS_MIN_DECODE_SEQS = 32


def compile_options(v: StepVariant) -> dict:
    """XLA options of v's step program on a GPU (none elsewhere).

    Steps with prompt tokens (prefill, mixed) are compiled without command buffers (CUDA graphs): a prefill that
    arrives at an idle device otherwise waits for the graph's update (when the step's buffers moved since it last
    ran) and launch before its first kernel, and its kernels are long enough to hide one launch each. Decode-only
    steps keep them: one launch per kernel cost batch 1 5.44 -> 5.64 ms per token (h100_command_buffers_ab_5e05ff0
    .json). H100, one call: batch-1 TTFT 13.6 / 13.9 -> 11.3 / 11.0 ms, ITL and throughput unchanged
    (h100_prefill_without_command_buffers_ab_2dade1a_vs_cd09718.json in bench/results).

    They also use cuBLAS instead of XLA's Triton GEMMs, which compile in half the time and run as fast or
    faster. One H100 process compiling each step alone, then timing the two alternately (T x B, ms per step;
    compile_probe_h100_b691aa4_ab_steps.json): 16x16 6.33 -> 6.51, 128x128 8.27 -> 7.68, 512x512 16.32 ->
    15.86, 512x2048 47.7 -> 46.8, 512x8192 174.9 -> 154.1; compiles 8.3-9.9 -> 4.6-6.3 s. In a cold start's
    8 parallel compiles the longest took 32-36 -> 14-17 s and LLM() 73.8 -> 60.5 s (compile_probe_h100_ce2244f
    .json: the 8B shape, 19 steps; tracing them, ~25-35 s with compiles alongside, is now what ready waits on).

    Decode-only steps of CUBLAS_MIN_DECODE_SEQS or more sequences use cuBLAS instead of XLA's Triton GEMMs: the
    autotuner keeps Triton GEMM fusions there (with the residual add and norm scale fused around them), which
    bench/step_probe.py measured slower per step on the H100 at ctx 192 (step_probe_h100_e104111_rows*.json):
    32 rows 6.35 -> 6.26 ms, 64 rows 7.03 -> 6.50-6.54, 128 rows 8.15 -> 7.54, 256 rows 10.48 -> 10.13, 512 rows
    (500 live, ctx 600) 26.45 -> 26.08; at 8 and 16 rows Triton wins (5.67 vs 5.93, 5.89 vs 5.97)."""
    if jax.default_backend() != "gpu":
        return {}
    if not v.decode_only:
        return {"xla_gpu_enable_command_buffer": "", "xla_gpu_enable_triton_gemm": False}
    if v.num_seqs >= CUBLAS_MIN_DECODE_SEQS:
        return {"xla_gpu_enable_triton_gemm": False}
    return {}


def _failed(future) -> bool:
    return future is not None and future.done() and future.exception() is not None


def _drop_queued(pool_ref) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


def _compile_or_none(lowered, options):
    """Compiles; None when XLA's autotuner runs out of device memory (several compiles at once, KV cache
    already allocated): the caller compiles that variant again on its own."""
    try:
        return lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, mesh, *, num_blocks: int, block_size: int,
                 kv_cache_dtype: str = "auto", attn_config: AttentionConfig = AttentionConfig(),
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, max_model_len: int = 2048,
                 max_logprobs: int = 20, executable_cache_dir: str | None = None, lora=None):
        if attn_config.mesh is None:  # tp > 1: attention runs in shard_map over this mesh
            attn_config = dataclasses.replace(attn_config, mesh=mesh)
        self.cfg, self.params, self.mesh, self.attn = cfg, params, mesh, attn_config
        self.lora = lora  # jaxllm.lora.slots.LoRASlots: its slot arrays are an argument of every step
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_logprobs = max_logprobs
        self.max_pages = -(-max_model_len // block_size)
        self.seq_buckets, self.token_buckets = step_buckets(max_num_seqs, max_num_batched_tokens)
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {list(KV_DTYPES)}.")
        self.kv_dtype = kv_storage_dtype(jnp.dtype(KV_DTYPES[kv_cache_dtype] or cfg.dtype))
        # Weights still loading (abstract_weights): the KV cache is allocated once they are bound (warm_up).
        self.kv_caches = self._allocate_kv() if self.has_weights else self._kv_specs()
        self.prev_tokens = jnp.zeros((self.seq_buckets[-1],), jnp.int32)
        self._prev_rows: dict[str, int] = {}
        self.batch = InputBatch(2 * max_num_seqs, self.max_pages, PAD_PAGE)
        self._jit = jax.jit(_packed_step_fn, static_argnames=("cfg", "attn", "flags", "prompt_k"),
                            donate_argnums=(1,))
        self.pipeline = None
        if mesh_pp(mesh) > 1:  # stages on their own devices, one jit each (compiled by warm_up)
            from jaxllm.engine.pipeline import PipelineExecutor

            if not self.has_weights:
                raise ValueError("Pipeline stages are warmed up by running them: they need the loaded weights.")

            self.pipeline = PipelineExecutor(cfg, params, mesh, self.attn, block_size=block_size,
                                             max_pages=self.max_pages, token_buckets=self.token_buckets,
                                             seq_buckets=self.seq_buckets, pad_page=PAD_PAGE)
            self._sample_jit = jax.jit(_pipeline_head_fn, static_argnames=("cfg", "flags", "prompt_k"))
        self._compiled: dict[StepVariant, object] = {}
        # Sampler-only programs for steps with non-default sampler flags, by (B, flags, row widths).
        self._sampler_jit = jax.jit(_packed_sample_rows_fn, static_argnames=("cfg", "flags"))
        # (params None: a host-only runner, for prepare() alone, as bench/host_overhead.py builds)
        self._head = {k: params[k] for k in ("final_norm", "lm_head", "embed") if k in (params or {})}
        self._samplers: dict[tuple, object] = {}
        # Whole step programs for non-default sampler flags, compiling in the background (see execute).
        self._background = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-compile")
        # At exit Python joins the pool's thread only once it has run every queued job (a whole step compile
        # each): drop them first. (concurrent.futures registered its own hook earlier, so it runs after this.)
        threading._register_atexit(functools.partial(_drop_queued, weakref.ref(self._background)))
        self._pending: dict[StepVariant, object] = {}
        self._sampler_jobs: dict[tuple, object] = {}  # sampler programs compiling ahead of need (_sampler_ahead)
        self._rows_spec: dict[int, jax.ShapeDtypeStruct] = {}  # B -> the start-up programs' sampled rows
        self._split_only: set[StepVariant] = set()  # their background compile failed: they keep running split
        self.split_sampler = True  # False: compile a whole step program before the step (tests compare the two)
        # Steps with at least this many structured-output masks run split when the engine has host work to do
        # before sampling (launch's before_sample): the grammar update then overlaps the model on the device.
        # Split costs one more output-head pass (an 8B model's: ~0.2 ms to read it on an H200), less than the
        # device idles while the host updates the grammars and dispatches a whole step after the previous
        # step's tokens arrive. H200, 8B, one constrained request: 229 tok/s split, 154 whole (unconstrained
        # 246); 500 requests, 5 / 50 / all 500 constrained: 40.25 / 39.36 / 36.68 req/s split, 39.38 / 37.90 /
        # 32.05 whole (bench/results/structured_h200_*). A huge value turns it off (A/B in bench/structured.py).
        self.overlap_min_masked = 1
        # Compiled steps on disk (exec_cache.py): a warm start loads them instead of tracing every bucket.
        # Not with pipeline stages (jits called per micro-batch, compiled by warm_up) nor across processes.
        self.exec_cache = None
        if executable_cache_dir and self.pipeline is None and jax.process_count() == 1:
            self.exec_cache = ExecutableCache(executable_cache_dir, mesh.devices.flat)
        self.warmed_up = False
        self.eager = False
        self.num_compiles_after_warmup = 0

    # ---- memory ----
    def _allocate_kv(self):
        # kv heads over tp (repeated when tp > K), each layer on its pipeline stage's devices.
        return make_kv_caches(self.cfg, self.mesh, self.num_blocks, self.block_size, self.kv_dtype)

    def _kv_specs(self):
        return kv_cache_specs(self.cfg, self.mesh, self.num_blocks, self.block_size, self.kv_dtype)

    def _kv_allocated(self) -> bool:
        return isinstance(self.kv_caches[0][0], jax.Array)

    @property
    def has_weights(self) -> bool:
        """False while params are abstract_weights (the steps can be compiled, not run; see set_params)."""
        return not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.params))

    def set_params(self, params) -> None:
        """Binds weights to the runner: their tree, shapes, dtypes and shardings must be those the step
        programs were compiled for (the abstract_weights the runner was built with)."""
        old, new = jax.tree.leaves(self.params), jax.tree.leaves(params)
        same = jax.tree.structure(params) == jax.tree.structure(self.params) and all(
            a.shape == b.shape and a.dtype == b.dtype and b.sharding.is_equivalent_to(a.sharding, len(a.shape))
            for a, b in zip(old, new))
        if not same:
            raise ValueError("The loaded weights' tree, shapes, dtypes or shardings differ from those the step "
                             "programs were compiled for.")
        self.params = params
        self._head = {k: params[k] for k in ("final_norm", "lm_head", "embed") if k in params}

    @staticmethod
    def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_cache_dtype: str = "auto", tp: int = 1,
                           pp: int = 1) -> int:
        """KV bytes one block costs on one device: its stage's layers and its share of the stored kv heads
        (kv heads are repeated when tp > K)."""
        from jaxllm.sharding import kv_heads_for, stage_layers

        dtype = kv_storage_dtype(jnp.dtype(KV_DTYPES.get(kv_cache_dtype) or cfg.dtype))
        layers = max(len(r) for r in stage_layers(cfg.num_layers, pp))
        heads = kv_heads_for(cfg.num_kv_heads, tp) // tp
        return 2 * layers * heads * block_size * cfg.head_dim * dtype.itemsize

    # ---- compilation ----
    def variants(self) -> list[StepVariant]:
        """The shape buckets compiled at start-up (default sampler flags)."""
        out = [StepVariant(b, b, True, SamplerFlags(), 0) for b in self.seq_buckets]
        for t in self.token_buckets:
            out.append(StepVariant(t, bucket(min(t, self.seq_buckets[-1]), self.seq_buckets), False,
                                   SamplerFlags(), 0))
        return out

    def _lower(self, v: StepVariant, args):
        return self._jit.lower(*args, cfg=self.cfg, attn=self.attn, flags=v.flags, prompt_k=v.prompt_logprobs)

    def _cache_key(self, v: StepVariant, args) -> str:
        static = (self.cfg, self.attn, v.flags, v.prompt_logprobs)
        options = compile_options(v)
        return self.exec_cache.key("step", args, static + ((tuple(sorted(options.items())),) if options else ()))

    def _load(self, v: StepVariant, args):
        """v's executable from the executable cache, or None (no cache, a miss, or an unusable entry)."""
        return None if self.exec_cache is None else self.exec_cache.load(self._cache_key(v, args), args)

    def _compile(self, v: StepVariant, args, lowered, oom_none: bool = False):
        """Compiles (and stores in the executable cache); with oom_none, None when XLA's autotuner ran out
        of device memory (see _compile_or_none)."""
        options = compile_options(v)
        compile_fn = functools.partial(_compile_or_none, lowered, options) if oom_none else functools.partial(
            lowered.compile, compiler_options=options)
        if self.exec_cache is None:
            return compile_fn()
        return self.exec_cache.compile_and_store(self._cache_key(v, args), compile_fn)

    def _executable(self, v: StepVariant, args):
        exe = self._compiled.get(v)
        if exe is None:
            t0 = time.perf_counter()
            exe = self._load(v, args)
            msg = "Loaded step %s in %.1f s"
            if exe is None:
                exe = self._compile(v, args, self._lower(v, args))
                msg = "Compiled step %s in %.1f s"
            self._compiled[v] = exe
            if self.warmed_up and not self.eager:
                default = v.flags == SamplerFlags() and not v.prompt_logprobs
                self.num_compiles_after_warmup += 1
                (logger.error if default else logger.warning)(msg + " after warm-up", v, time.perf_counter() - t0)
            else:
                logger.debug(msg, v, time.perf_counter() - t0)
        return exe

    def warm_up(self, enforce_eager: bool = False, workers: int | None = None, weights=None) -> None:
        """Compiles every shape bucket now, so serving never stalls on the compiler (enforce_eager: skip).
        Buckets in the executable cache are loaded, untraced. The others are traced one after another
        (Python) and compiled in a thread pool (XLA releases the GIL). When the pool leaves a core free, each
        bucket is compiled as soon as it is traced, so tracing overlaps compiling (2-core VM, 1 compile
        thread, 10 buckets of a 32-layer model: 81 -> 66 s, 68 -> 53 s); otherwise tracing would only slow
        the compiles down (2 threads: 35 -> 43 s), so all are traced first.

        weights: a Future of the params, for a runner built on abstract_weights: the steps are traced and
        compiled while they load, then bound (set_params) and the KV cache allocated. If loading fails,
        compiling stops early and the loader's error is raised."""
        self.eager = enforce_eager
        try:
            if not enforce_eager and self.pipeline is not None:
                self._warm_up_pipeline()
            elif not enforce_eager:
                # XLA's GEMM autotuner measures on its own copies of each GEMM's operands, in device memory, and
                # the compiles below run in parallel: compile against the KV cache's shapes while its memory is
                # free (an H100 start-up with the cache allocated had a compile fail for memory and redone alone:
                # 37 -> 51 s), then allocate it. (Only before the first step: later the cache holds sequences.)
                if (not self.warmed_up and self._kv_allocated()
                        and any(v not in self._compiled for v in self.variants())):
                    for a in jax.tree.leaves(self.kv_caches):
                        a.delete()
                    self.kv_caches = self._kv_specs()
                self._compile_variants(workers, weights)
        finally:
            if weights is not None:
                self.set_params(weights.result())
            if not self._kv_allocated() and self.has_weights:
                self.kv_caches = self._allocate_kv()
        self.warmed_up = True

    def _warm_up_pipeline(self) -> None:
        """pp > 1: the stages are separate jits on their own devices (pipeline.py), called per micro-batch, and
        the sampling head another on the last stage: each is run once per step shape on inputs that write
        no KV slot (twice for the head, whose prev_tokens argument is the initial array the first time and
        its own output after)."""
        t0 = time.perf_counter()
        variants = self.variants()
        shapes = sorted({(v.num_tokens, v.num_seqs, v.decode_only) for v in variants})
        self.kv_caches, hiddens = self.pipeline.warm_up(self.kv_caches, self.prev_tokens, shapes)
        for _ in range(2):
            for v in variants:
                _, _, _, logits_indices, smd, prompt_targets, _ = self._dummy_host(v)
                self.prev_tokens, outputs, _ = self._sample_jit(
                    self.pipeline.head_params, hiddens[v.num_tokens], self.prev_tokens, logits_indices, smd,
                    prompt_targets, cfg=self.cfg, flags=v.flags, prompt_k=v.prompt_logprobs)
        jax.block_until_ready((self.kv_caches, outputs))
        logger.info("Pipeline stages and sampling head compiled for %d step shapes in %.1f s", len(shapes),
                    time.perf_counter() - t0)

    def _compile_variants(self, workers, weights=None) -> None:
        """Loads or compiles every variant not compiled yet (see warm_up); stops tracing once the weights
        Future (if any) has failed."""
        t0 = time.perf_counter()
        todo = [v for v in self.variants() if v not in self._compiled]
        args = {v: self._dummy_args(v) for v in todo}
        workers = max(1, min(workers or 8, len(todo) or 1, os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            for v, exe in zip(todo, pool.map(lambda v: self._load(v, args[v]), todo)):
                if exe is not None:
                    self._compiled[v] = exe
            t1, n_loaded = time.perf_counter(), len([v for v in todo if v in self._compiled])
            overlap = (os.cpu_count() or 1) > workers
            seconds: dict[StepVariant, float] = {}

            def compile_timed(v, low):
                t = time.perf_counter()
                try:
                    return self._compile(v, args[v], low, True)
                finally:
                    seconds[v] = time.perf_counter() - t

            jobs = []
            for v in todo:
                if _failed(weights):
                    for _, _, job in jobs:  # the queued ones; warm_up raises the loader's error
                        if job is not None:
                            job.cancel()
                    return
                if v not in self._compiled:
                    low = self._lower(v, args[v])
                    jobs.append((v, low, pool.submit(compile_timed, v, low) if overlap else None))
            t2 = time.perf_counter()
            jobs = [(v, low, job or pool.submit(compile_timed, v, low)) for v, low, job in jobs]
            done = [(v, low, job.result()) for v, low, job in jobs]
        retried = 0
        for v, low, exe in done:
            if exe is None:  # out of device memory for parallel autotuning: compile this one alone
                exe, retried = self._compile(v, args[v], low), retried + 1
            self._compiled[v] = exe
        if retried:
            logger.warning("%d step variants ran out of device memory compiling in parallel; compiled them "
                           "one at a time", retried)
        if self.exec_cache is not None:
            self.exec_cache.prune()
        slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:3]
        logger.info("Step variants ready in %.1f s: %d loaded from %s in %.1f s, %d traced in %.1f s and "
                    "compiled (%d threads; longest: %s)", time.perf_counter() - t0, n_loaded,
                    self.exec_cache.dir if self.exec_cache else "-", t1 - t0, len(jobs), t2 - t1, workers,
                    ", ".join(f"{v.shape_name} {s:.1f} s"
                              for v, s in slowest) or "-")

    def _dummy_host(self, v: StepVariant):
        """Host inputs of v's shapes that write no KV slot: (token_ids, src_rows, meta, logits_indices, smd,
        prompt_targets)."""
        T, B = v.num_tokens, v.num_seqs
        z = lambda *shape, dt=np.int32: np.zeros(shape, dt)  # noqa: E731
        meta = AttentionMetadata(z(T), np.full(T, -1, np.int32), z(B), z(B + 1), z(B, self.max_pages),
                                 v.decode_only)
        smd = self._sampling_arrays(B, v.flags)
        no_lora = None if self.lora is None else np.full(T, -1, np.int32)
        if self.lora is not None:
            smd = dataclasses.replace(smd, lora_slots=np.full(B, -1, np.int32))
        return (z(T), np.full(T, -1, np.int32), meta, z(B), smd, np.full(T, -1, np.int32), no_lora)

    def _dummy_args(self, v: StepVariant):
        return self._step_args(self._dummy_host(v))

    def _step_args(self, host_args) -> tuple:
        """The step program's arguments for these host inputs (packed: pack_host_args)."""
        ints, floats, layout = pack_host_args(host_args)
        lora = () if self.lora is None else (self.lora.arrays,)
        return self.params, self.kv_caches, ints, floats, self.prev_tokens, layout, *lora

    # ---- one step ----
    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """The host half of a step: padded numpy inputs and the bucket, no device work (timed by
        bench/host_overhead.py)."""
        # The host budget is ~1 ms at 256 sequences (issue 7), so per-sequence work is C-level map()s over
        # the scheduled list plus numpy; Python loops only visit the rare chunks that need more (prompt
        # logprobs, penalties, biases).
        batch = self.batch
        batch.release(sched.freed)
        scheduled = sched.scheduled
        n = len(scheduled)
        seqs = list(map(_seq, scheduled))
        rows = batch.rows(seqs)
        q_lens = np.fromiter(map(_num_tokens, scheduled), np.int32, n)
        starts = np.fromiter(map(_start, scheduled), np.int32, n)
        sample = list(map(_sample, scheduled))
        known = list(map(_token_ids, scheduled))  # [] for a decode of a token still on the device
        from_device = np.fromiter(map(len, known), np.int32, n) < q_lens
        n_tok = int(q_lens.sum())
        decode_only = n_tok == n  # every chunk is one token
        if decode_only:
            B = T = bucket(n, self.seq_buckets)
        else:
            # Mixed steps: B follows T (B <= n_tok <= T), so there is one mixed variant per token bucket.
            T = bucket(max(n_tok, n), self.token_buckets)
            B = bucket(min(T, self.seq_buckets[-1]), self.seq_buckets)
        # Flat token ids: the known ones, and a 0 placeholder where the device feeds the previous step's token
        # for this sequence (src_rows: its row in prev_tokens).
        token_ids = np.zeros(n_tok, np.int32)
        src_rows = np.full(T, -1, np.int32)
        first_tok = np.cumsum(q_lens) - q_lens
        dev = np.flatnonzero(from_device)
        if len(dev) < n:
            host_tok = ~np.repeat(from_device, q_lens)
            token_ids[host_tok] = np.fromiter(itertools.chain.from_iterable(known), np.int32, n_tok - len(dev))
        ids = list(map(_seq_id, seqs))
        if len(dev):
            dev_ids = ids if len(dev) == n else [ids[i] for i in dev.tolist()]
            src_rows[first_tok[dev]] = list(map(self._prev_rows.__getitem__, dev_ids))
        inp = step_inputs(token_ids, q_lens, starts, batch.num_pages[rows], batch.tables[rows], self.block_size, T,
                          B, self.max_pages, PAD_PAGE)
        sample_idx = list(itertools.compress(range(n), sample))
        sample_rows = dict(zip(itertools.compress(ids, sample), sample_idx))
        features = batch.features[rows]
        flags = self._flags(seqs, features)
        prompt_rows = {}
        prompt_targets = np.full(T, -1, np.int32)
        for i in np.flatnonzero(features & PROMPT_LOGPROBS).tolist():
            s, lo = scheduled[i], int(first_tok[i])
            if s.start < s.seq.num_prompt_tokens:  # token j's target: the prompt token after it, if any
                prompt_rows[ids[i]] = (lo, s.num_tokens, s.start)
                targets = s.seq.prompt_token_ids[s.start + 1 : s.start + s.num_tokens + 1]
                prompt_targets[lo : lo + len(targets)] = targets
        prompt_k = self.max_logprobs if prompt_rows else 0
        live = np.asarray(sample_idx, np.int64)
        if not features.all():  # some sequences have no sampling params: they take padding rows
            live = live[(features[live] & HAS_PARAMS) != 0]
        smd = self._sampling_arrays(B, flags, seqs, rows, live)
        meta = AttentionMetadata(inp.positions, inp.slot_mapping, inp.seq_lens, inp.query_start_loc,
                                 inp.block_tables, decode_only)
        widths = tuple(getattr(smd, name).shape[1] for name, _, _ in _ROW_FIELDS) + (smd.token_bitmask.shape[0],)
        v = StepVariant(T, B, decode_only, flags, prompt_k, widths)
        token_slots = None
        if self.lora is not None:  # each token's adapter slot (-1: base model, padding); the sampled rows' too
            slot_of = self.lora.activate(s.lora_id for s in seqs)
            seq_slots = np.fromiter((slot_of.get(s.lora_id, -1) for s in seqs), np.int32, n)
            token_slots = np.full(T, -1, np.int32)
            token_slots[:n_tok] = np.repeat(seq_slots, q_lens)
            smd = dataclasses.replace(smd, lora_slots=token_slots[inp.logits_indices])
        host_args = (inp.token_ids, src_rows, meta, inp.logits_indices, smd, prompt_targets, token_slots)
        slot = smd.bitmask_slot
        masked = [(int(slot[i]), seqs[i]) for i in np.flatnonzero(slot >= 0).tolist()] if flags.grammar else []
        return PreparedStep(v, host_args, sample_rows, prompt_rows, flags.num_logprobs, masked, sched)

    def execute(self, sched: SchedulerOutput) -> StepHandle:
        return self.launch(self.prepare(sched))

    def refresh_masks(self, p: PreparedStep) -> None:
        """Rewrites p's structured-output masks from its sequences' current ones (the engine advanced their
        grammars after p was prepared)."""
        masks = [seq.token_bitmask for _, seq in p.masked]  # rows 0, 1, ... in order (_sampling_arrays)
        if masks:
            np.stack(masks, out=p.host_args[4].token_bitmask[: len(masks)])

    def launch(self, p: PreparedStep, before_sample: Callable[[], None] | None = None) -> StepHandle:
        """The device half of a step: dispatches p (asynchronously). before_sample (the engine's grammar update,
        which waits for the previous step's tokens and rewrites p's masks) runs before p's sampling inputs are
        read; when p has overlap_min_masked masks or more, p runs split and it runs after the model part is
        dispatched, so that host work overlaps the device's."""
        token_ids, src_rows, meta, logits_indices, smd, prompt_targets, token_slots = p.host_args
        before_sample = before_sample or (lambda: None)
        if self.lora is not None:  # the sampler-only program's lm_head adapters (the slot arrays of this step)
            self._head["lora_lm_head"] = self.lora.arrays["lm_head"]
        v = p.variant
        overlap = len(p.masked) >= self.overlap_min_masked and not v.prompt_logprobs
        if self.pipeline is not None:
            self.kv_caches, hidden = self.pipeline.forward(self.kv_caches, token_ids, src_rows, meta, self.prev_tokens)
            before_sample()
            self.prev_tokens, outputs, prompt = self._sample_jit(
                self.pipeline.head_params, hidden, self.prev_tokens, logits_indices, smd, prompt_targets,
                cfg=self.cfg, flags=v.flags, prompt_k=v.prompt_logprobs)
        elif not overlap and self._whole_step(v, p.host_args):
            before_sample()
            args = self._step_args(p.host_args)
            exe = self._executable(v, args)
            self.kv_caches, self.prev_tokens, outputs, prompt, _ = exe(*args)
        else:
            # Split: the bucket's start-up program (default flags; its own sampling is discarded) runs the model
            # and returns the sampled rows' hidden states, and a sampler-only program samples them with v's
            # flags. For non-default flags whose step program is still compiling in the background, and for
            # overlap.
            base = StepVariant(v.num_tokens, v.num_seqs, v.decode_only, SamplerFlags(), 0)
            args = self._step_args((token_ids, src_rows, meta, logits_indices, _plain(smd), prompt_targets,
                                    token_slots))
            self.kv_caches, _, _, _, rows = self._executable(base, args)(*args)
            self._rows_spec.setdefault(v.num_seqs, _spec(rows))
            before_sample()
            exe, sargs = self._sampler_call(v, rows, smd)
            self.prev_tokens, outputs = exe(*sargs)
            prompt = None
        if v.flags.penalties:
            self._sampler_ahead(v, smd)
        self._prev_rows = dict(p.sample_rows)
        return StepHandle(p.sched, p.sample_rows, (outputs, prompt), p.prompt_rows, p.num_logprobs)

    def collect(self, handle: StepHandle) -> StepResult:
        outputs, prompt = jax.device_get(handle.outputs)
        return StepResult(*outputs, prompt)

    def _whole_step(self, v: StepVariant, host_args) -> bool:
        """Whether v runs as one step program: default flags, prompt logprobs (rare; they need every token's
        logits), eager mode and warm-up do. Other flags do once their program is ready: the first step that
        needs it loads it from the executable cache or, on a miss, starts compiling it in the background (a
        whole 8B step takes seconds to compile, and every running request would wait) and runs split until
        then (the model, then a sampler-only program: one more output-head GEMM per step)."""
        if v in self._compiled or v.flags == SamplerFlags() or v.prompt_logprobs or not self.split_sampler:
            return True
        if self.eager or not self.warmed_up:
            return True
        if v in self._split_only:
            return False
        job = self._pending.get(v)
        if job is None:
            args = self._spec_args(host_args)
            exe = self._load(v, args)
            if exe is not None:
                self._compiled[v] = exe
                return True
            self._pending[v] = self._background.submit(self._compile_in_background, v, args)
        elif job.done():
            del self._pending[v]
            return self._file_background_compile(v, job)
        return False

    def _file_background_compile(self, v: StepVariant, job) -> bool:
        """Files a finished background compile (waits for it); True when v's step program is ready. One that
        failed is logged and v keeps running split, which gives the same tokens: raising here failed the step,
        so every request in it (and, in AsyncLLM, the engine)."""
        try:
            self._compiled[v] = job.result()
            return True
        except Exception:  # noqa: BLE001 - an optimisation failed; the split programs still serve v
            logger.exception("Compiling step %s in the background failed; its steps keep running split", v)
            self._split_only.add(v)
            return False

    def _spec_args(self, host_args):
        """A step's arguments with the device arrays as shape / dtype / sharding specs (for lowering away from
        the step: the KV cache is donated to every step)."""
        ints, floats, layout = pack_host_args(host_args)
        lora = () if self.lora is None else (self.lora.abstract(),)
        return self.params, jax.tree.map(_spec, self.kv_caches), ints, floats, _spec(self.prev_tokens), layout, *lora

    def _compile_in_background(self, v: StepVariant, args):
        t0 = time.perf_counter()
        exe = self._compile(v, args, self._lower(v, args))
        self.num_compiles_after_warmup += 1
        logger.info("Compiled step %s in %.1f s in the background (its steps ran split until then)", v,
                    time.perf_counter() - t0)
        return exe

    def wait_for_background_compiles(self) -> None:
        """Blocks until the step programs compiling in the background are ready (tests, benchmarks)."""
        for v, job in list(self._pending.items()):
            del self._pending[v]
            self._file_background_compile(v, job)
        for job in list(self._sampler_jobs.values()):
            job.exception()

    def _sampler_call(self, v: StepVariant, rows, smd: SamplingMetadata):
        """(program, arguments) that sample v's rows. Each number of structured-output masks (a power of two up to
        B) is a program of its own, and one missing would be compiled in the engine loop (~1 s for an 8B model's
        vocabulary), stalling every request. So when the exact one is neither compiled nor in the executable
        cache, a program for more masks samples this step (smd's masks padded with all-allowed rows, which no
        row's slot points at) while the exact one compiles in the background; the first such step of a B and
        flags compiles the one for B masks, which serves every count after it."""
        args = (self._head, rows, self.prev_tokens, *pack_host_args(smd))
        key = (v.num_seqs, v.flags, v.sampler_widths)
        n_masks, B = v.sampler_widths[-1], v.num_seqs
        exe = self._samplers.get(key)
        if exe is not None or not v.flags.grammar or n_masks >= B:
            return exe or self._sampler_executable(v, args), args
        exe = self._load_sampler(v, args)
        if exe is not None:
            return exe, args
        wider = sorted(k[2][-1] for k in self._samplers if k[:2] == key[:2] and k[2][:-1] == key[2][:-1]
                       and k[2][-1] > n_masks)
        wide_v = dataclasses.replace(v, sampler_widths=v.sampler_widths[:-1] + (wider[0] if wider else B,))
        bitmask = np.full((wide_v.sampler_widths[-1], smd.token_bitmask.shape[1]), -1, np.int32)
        bitmask[:n_masks] = smd.token_bitmask
        wide_args = (self._head, rows, self.prev_tokens,
                     *pack_host_args(dataclasses.replace(smd, token_bitmask=bitmask)))
        exe = self._sampler_executable(wide_v, wide_args)
        if key not in self._sampler_jobs:  # specs: the step's device arrays may be donated before it runs
            # (the head as specs too: a LoRA slot write may donate its lm_head arrays before this compiles)
            specs = (jax.tree.map(_spec, self._head), _spec(rows), _spec(self.prev_tokens), *args[3:])

            def compile_exact():
                try:
                    self._compile_sampler(v, specs)
                except Exception:  # noqa: BLE001 - only an optimisation: the wider program keeps serving
                    logger.exception("Compiling the sampler for B=%d %s %s failed", B, v.flags, v.sampler_widths)

            self._sampler_jobs[key] = self._background.submit(compile_exact)
        return exe, wide_args

    def _load_sampler(self, v: StepVariant, args):
        """v's sampler program from the executable cache (filed in self._samplers), or None."""
        if self.exec_cache is None:
            return None
        exe = self.exec_cache.load(self.exec_cache.key("sample", args, (self.cfg, v.flags)), args)
        if exe is not None:
            self._samplers[(v.num_seqs, v.flags, v.sampler_widths)] = exe
        return exe

    def _compile_sampler(self, v: StepVariant, args):
        """Compiles v's sampler program (storing it in the executable cache) and files it in self._samplers."""
        t0 = time.perf_counter()
        compile_fn = self._sampler_jit.lower(*args, cfg=self.cfg, flags=v.flags).compile
        if self.exec_cache is None:
            exe = compile_fn()
        else:
            exe = self.exec_cache.compile_and_store(self.exec_cache.key("sample", args, (self.cfg, v.flags)),
                                                    compile_fn)
        self.num_compiles_after_warmup += 1
        self._samplers.setdefault((v.num_seqs, v.flags, v.sampler_widths), exe)
        logger.info("Sampler for B=%d %s %s compiled in %.2f s", v.num_seqs, v.flags, v.sampler_widths,
                    time.perf_counter() - t0)
        return exe

    def _sampler_executable(self, v: StepVariant, args):
        """The sampler-only program for v's B, flags and row widths (compiled, from the executable cache, or
        compiled now: a small program, ~1.3 s on an H100 host for an 8B model's vocabulary)."""
        exe = self._samplers.get((v.num_seqs, v.flags, v.sampler_widths))
        return exe or self._load_sampler(v, args) or self._compile_sampler(v, args)

    def _sampler_ahead(self, v: StepVariant, smd) -> None:
        """Penalty rows hold each sequence's token ids, so their width (a power of two) doubles as sequences
        grow, and each width is a step program and a sampler program of its own. A step with penalties makes
        sure the next width's sampler program is compiled or compiling in the background, so the step that
        crosses it runs split (see _whole_step) without waiting for a compiler (every running request would)."""
        widths = (2 * v.sampler_widths[0], 2 * v.sampler_widths[1]) + tuple(v.sampler_widths[2:])
        key = (v.num_seqs, v.flags, widths)
        rows = self._rows_spec.get(v.num_seqs)  # None until a split step of this B ran (so never when eager)
        if (rows is None or key in self._samplers or key in self._sampler_jobs
                or widths[0] > 2 * self.max_pages * self.block_size):
            return
        prev, head = _spec(self.prev_tokens), jax.tree.map(_spec, self._head)
        wider = lambda a: np.zeros((a.shape[0], 2 * a.shape[1]), a.dtype)  # noqa: E731
        smd = dataclasses.replace(smd, penalty_tokens=wider(smd.penalty_tokens),
                                  penalty_is_output=wider(smd.penalty_is_output))

        def compile_ahead():
            try:
                exe = self._sampler_jit.lower(head, rows, prev, *pack_host_args(smd), cfg=self.cfg,
                                              flags=v.flags).compile()
            except Exception:  # noqa: BLE001 - only an optimisation: the step that needs it compiles it then
                logger.exception("Compiling the sampler for B=%d %s %s ahead failed", v.num_seqs, v.flags, widths)
                return
            self._samplers.setdefault(key, exe)

        self._sampler_jobs[key] = self._background.submit(compile_ahead)

    # ---- sampling inputs ----
    def _flags(self, seqs, features: np.ndarray) -> SamplerFlags:
        """features: InputBatch.features of seqs' rows (what their sampling params need, fixed per request);
        only the engine's per-token logit biases (seq.bias_row) and grammar masks (seq.token_bitmask) change
        from step to step."""
        bits = int(np.bitwise_or.reduce(features)) if len(features) else 0
        has_params = (features & HAS_PARAMS).tolist()
        bias = bool(bits & ALLOWED_IDS) or any(map(_bias_row, itertools.compress(seqs, has_params)))
        grammar = bool(bits & STRUCTURED) and any(
            m is not None for m in map(_token_bitmask, itertools.compress(seqs, has_params)))
        return SamplerFlags(bool(bits & FILTERING), bool(bits & PENALTIES), bias,
                            self.max_logprobs if bits & LOGPROBS else 0, grammar)

    def _sampling_arrays(self, B: int, flags: SamplerFlags, seqs=(), rows: np.ndarray | None = None,
                         live: np.ndarray | None = None) -> SamplingMetadata:
        """B rows: seqs[i] for i in live (an index array: sampled, with sampling params) take the settings of
        their InputBatch row rows[i]; every other row is padding."""
        table = np.tile(np.asarray(PADDING_ROW, np.float32), (B, 1))
        seeds = np.zeros(B, np.uint32)
        steps = np.zeros(B, np.int32)
        n_live = 0 if live is None else len(live)
        if n_live:
            # Usually every sequence is sampled: a slice then spares the fancy indexing.
            at = slice(0, n_live) if n_live == len(seqs) else live
            live_rows = rows[at]
            table[at] = self.batch.sampling[live_rows]
            seeds[at] = self.batch.seeds[live_rows]
            live_seqs = seqs if n_live == len(seqs) else [seqs[i] for i in live.tolist()]
            n_out = np.fromiter(map(len, map(_output_token_ids, live_seqs)), np.int32, n_live)
            steps[at] = n_out + np.fromiter(map(_num_pending, live_seqs), np.int32, n_live) - 1
        temp, top_p, top_k, min_p, pres, freq, rep = table.T
        top_k = top_k.astype(np.int32)
        empty = [[]] * B
        pen_rows, pen_out, bias_ids, bias_vals, allowed = empty, empty, empty, empty, empty
        live = [] if live is None else live.tolist()
        if flags.penalties:
            pen_rows, pen_out = [[] for _ in range(B)], [[] for _ in range(B)]
            for i in live:
                seq = seqs[i]
                pen_rows[i] = seq.all_token_ids
                pen_out[i] = [False] * seq.num_prompt_tokens + [True] * seq.num_output_tokens
        if flags.bias:  # otherwise every bias row and allowed list is empty (see _flags)
            bias_ids, bias_vals, allowed = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
            for i in live:
                row = seqs[i].bias_row or {}
                bias_ids[i], bias_vals[i] = list(row.keys()), list(row.values())
                allowed[i] = list(seqs[i].sampling_params.allowed_token_ids or [])

        slot = np.full(B, -1, np.int32)
        bitmask = np.full((1, 1), -1, np.int32)
        if flags.grammar:  # only the constrained rows' masks go to the device (each is V / 8 bytes)
            rows_c = [i for i in live if seqs[i].token_bitmask is not None]
            bitmask = np.full((1 << max(len(rows_c) - 1, 0).bit_length(), (self.cfg.vocab_size + 31) // 32), -1,
                              np.int32)
            if rows_c:
                np.stack([seqs[i].token_bitmask for i in rows_c], out=bitmask[: len(rows_c)])
            slot[rows_c] = np.arange(len(rows_c))
        ragged = (pen_rows, pen_out, bias_ids, bias_vals, allowed)  # in _ROW_FIELDS' order
        return SamplingMetadata(
            temp, top_p, top_k, min_p, pres, freq, rep, seeds, steps,
            *(np.full((B, 1), fill, dtype) if r is empty else pad_rows(r, 1, fill, dtype)
              for r, (_, fill, dtype) in zip(ragged, _ROW_FIELDS)), bitmask, slot)
