"""ModelRunner: SchedulerOutput -> StepInputs (padded numpy) -> one compiled step on the device.

The runner prepares, launches and collects steps; it never compiles. Per step:
  - prepare (host only, StepPreparer in prepare.py): the bucket (T tokens, B sequences; the block table always
    has max_model_len / S columns), the padded attention inputs (inputs.py), the sampling arrays (packing.py)
    and the StepVariant that names the program to run;
  - launch: asks StepPrograms (programs.py, which owns every compiled program, its compiles and the executable
    cache; its sampler-only programs in sampler_programs.py) for v's executable and calls it on the packed host inputs (packing.py); the KV cache is donated to
    every step. A step with non-default sampler flags whose whole program is not ready yet runs "split": the
    bucket's start-up program, then a sampler-only program;
  - collect: reads the sampled tokens back.
Over several processes (multihost.py) launch sends each step to the others, which run it through run_step too.
A step returns immediately (JAX dispatches asynchronously); the engine collects its results later, so the host
prepares step N+1 while the device runs step N. Tokens a step samples stay on the device too: the next step
reads them from `prev_tokens` for sequences whose input is still pending.

The runner also owns the device memory the steps use: the KV cache (allocated after the start-up compiles, which
autotune in the memory it will take), the weights (bound once loaded: set_params) and prev_tokens. With LoRA, the
adapter slots (jaxllm/lora/slots.py, built by setup.py): prepare picks each sequence's slot (host bookkeeping),
launch writes the adapters that prepare put in new slots, then dispatches the step, which reads the slots after.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.distributed import env_int
from jaxllm.engine.input_batch import InputBatch
from jaxllm.engine.packing import plain
from jaxllm.engine.prepare import PAD_PAGE, StepPreparer
from jaxllm.engine.programs import StepPrograms
from jaxllm.engine.sampler import SamplerFlags
from jaxllm.engine.scheduler import SchedulerOutput
from jaxllm.engine.step_io import (
    PreparedStep,
    StepHandle,
    StepResult,
    StepVariant,
    draft_args,
    dummy_host_inputs,
    step_args,
    unpack_outputs,
)
from jaxllm.models.attention import AttentionConfig
from jaxllm.models.decoder import final_normed
from jaxllm.sharding import kv_cache_specs, make_kv_caches, mesh_pp
from kernels_pallas import on_hopper, requested_decode_backend
from kernels_pallas.reference import FP8_MAX

logger = logging.getLogger(__name__)

KV_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_storage_dtype(dtype):
    """The KV cache's element type in memory. On CPU, bfloat16 / float16 pages are stored as float32: XLA's
    CPU backend widens a 16-bit scatter's whole operand to float32 and back, so every KV write copied every
    layer's cache (the demo model: ~1 s per token at the default KV size; a float32 scatter is in place).
    The values stay those of the model's dtype (each written value is one of them, and the CPU attention
    reads pages as float32 anyway), so outputs do not change; the cache holds half the tokens per byte.
    fp8 pages widened the same way (a tiny model with a 256 MB cache: 1,708 ms per token against 1.3 ms for
    float32 pages, bench/probes/cpu_fp8_kv.py), so on CPU they hold their bit patterns as uint8, whose scatter
    is in place: the same bytes and values (attention's kv_dtype says which fp8 format they are)."""
    if jax.default_backend() != "cpu":
        return dtype
    if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jnp.dtype(jnp.float32)
    if dtype in FP8_MAX:
        return jnp.dtype(jnp.uint8)
    return dtype


# The smallest decode bucket (padded sequences). A batch-1 decode step of the Llama-3-8B shape on an H100
# (bench/probes/step_probe.py --rows, XProf): 1 row 5.63 ms (XLA turns the M = 1 qkv GEMM into a 23 us reduction
# instead of an 18.7 us GEMM), 2 rows 5.44 ms, 8 rows 5.61 ms (the attention grid and the small fusions run
# over 4x the rows; bench/results/step_probe_h100_30bea4e_rows*.json).
SMALLEST_SEQ_BUCKET = 2
# ... except for int weight-only (and INT8 W8A8) models on the Pallas backend: their projections' kernel runs one row
# on the CUDA cores (kernels_pallas/_qmatmul.py's FMA variant) faster than two rows on the MMA variant, and a 2-row
# bucket pads x to 8 rows and slices the result (two XLA kernels a projection). H100, Llama-3-8B GPTQ int4 g128,
# batch-1 ITL in one call, alternating: 4.32 / 4.32 ms with a 2-row bucket, 3.56 / 3.47 with a 1-row bucket; the
# four GEMMs a layer 79.4 us at 1 row against 109.6 at 2 (bench/results/latency_gptq_h100_9c30971_bucket*.json;
# latency_gptq_h100_5d42e8a_*.json: 3.32 / 3.33 against 4.31 ms). fp8 models measured slower at 1 row (3.67-3.76
# against 3.54-3.57 ms) and bf16 equal (latency_{fp8,bf16}_h100_93df5e7_bucket*.json): they keep 2.
SMALLEST_SEQ_BUCKET_INT = 1


def smallest_seq_bucket(cfg: ModelConfig, backend: str) -> int:
    """The smallest decode bucket for this model: SMALLEST_SEQ_BUCKET_INT for int-weight models on the "pallas"
    backend (their kernel path), else SMALLEST_SEQ_BUCKET."""
    q = cfg.quantization
    if backend == "pallas" and q is not None and q.weight_type == "int":
        return SMALLEST_SEQ_BUCKET_INT
    return SMALLEST_SEQ_BUCKET


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


def step_buckets(
    max_num_seqs: int, max_num_batched_tokens: int, smallest: int | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sequence buckets, token buckets) of the compiled steps: powers of two from `smallest` sequences (default
    SMALLEST_SEQ_BUCKET; smallest_seq_bucket picks it per model) and 16 tokens up to the limits. The one place the
    lists are made (bench/padding_waste.py replays workloads on other lists; bench/bucket_ab.py times them)."""
    smallest = SMALLEST_SEQ_BUCKET if smallest is None else smallest
    return (
        pow2_buckets(min(smallest, max_num_seqs), max_num_seqs),
        pow2_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens),
    )


# Decode-only steps whose longest live context reaches this many tokens run their bucket's long-context program
# (StepVariant.long_context: the Mosaic GPU decode kernel instead of the fused Triton launch of RoPE, KV write and
# attention). H200, 8B bf16, each backend for every decode-only step (bench/HISTORY.md "Stop 63"): Mosaic was
# faster from 2k tokens of context (ITL 2k batch 16 / 64 8.46 / 29.98 ms against 8.60 / 31.20, 8k batch 16 7.95
# against 8.66, 32k batch 1 5.17 against 5.28) and slower at 128-256 (batch 1 / 64 4.18 / 5.99 against 4.06 /
# 5.81). With this switch on and off ("Stop 64"): batch 1 loses 0.4-0.6 % at 1-2k, is even at 8k and gains 2 % at
# 32k; 16-64 sequences gain 1-2 % from 1k, where the longest context alone cannot tell them apart from batch 1.
# $JAXLLM_LONG_DECODE_CONTEXT sets another length (0: off).
LONG_DECODE_CONTEXT = 2048


def long_decode_from(attn: AttentionConfig, max_model_len: int, kv_dtype) -> int:
    """The longest-context length from which a decode-only step runs its bucket's long-context program, or 0:
    where that program differs (the Pallas backend on a Hopper GPU, 16-bit KV pages, $JAXLLM_DECODE_BACKEND unset
    or "auto": a forced backend runs every step) and sequences can reach it. The caller rules out several
    processes, pipeline stages and drafters, whose programs are chosen elsewhere."""
    length = env_int("JAXLLM_LONG_DECODE_CONTEXT")
    length = LONG_DECODE_CONTEXT if length is None else length
    if length <= 0 or length > max_model_len or requested_decode_backend() != "auto":
        return 0
    if attn.backend != "pallas" or attn.interpret or not on_hopper():
        return 0
    return length if jnp.dtype(kv_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else 0


def _plain_sampling(host_args: tuple) -> tuple:
    """A step's host inputs with default sampling arrays (packing.plain): those of its bucket's start-up program."""
    token_ids, src_rows, meta, logits_indices, smd, prompt_targets, token_slots = host_args
    return token_ids, src_rows, meta, logits_indices, plain(smd), prompt_targets, token_slots


def _short_context(p: PreparedStep) -> PreparedStep:
    """p as its bucket's start-up program runs it (StepVariant.long_context and the metadata's flag off)."""
    token_ids, src_rows, meta, *rest = p.host_args
    meta = dataclasses.replace(meta, long_context=False)
    variant = dataclasses.replace(p.variant, long_context=False)
    return dataclasses.replace(p, variant=variant, host_args=(token_ids, src_rows, meta, *rest), packed=None)


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        params,
        mesh,
        *,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: str = "auto",
        attn_config: AttentionConfig | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
        max_logprobs: int = 20,
        executable_cache_dir: str | None = None,
        multihost=None,
        num_spec_tokens: int = 0,
        spec_max_seqs: int = 0,
        drafter=None,
        draft_params=None,
        lora=None,
    ):
        """multihost: an engine over several processes (multihost.py), else None. num_spec_tokens: speculative
        decoding's K (0: off); spec_max_seqs: the largest batch that speculates (its verify steps are compiled at
        start-up for the batch buckets up to it); drafter / draft_params: a draft model or EAGLE head
        (spec_decode/drafter.py) and its weights, with a KV cache of its own here; lora:
        jaxllm.lora.slots.LoRASlots (enable_lora; not with speculative decoding), or None."""
        attn_config = attn_config or AttentionConfig()
        if lora is not None:  # on one device the slots take in the base projections' weights (LoRASlots.absorb)
            params = lora.absorb(params)
        if attn_config.mesh is None:  # tp > 1: attention runs in shard_map over this mesh
            attn_config = dataclasses.replace(attn_config, mesh=mesh)
        self.cfg, self.params, self.mesh, self.attn = cfg, params, mesh, attn_config
        self.lora = lora  # jaxllm.lora.slots.LoRASlots (enable_lora), or None
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_logprobs = max_logprobs
        self.max_pages = -(-max_model_len // block_size)
        self.seq_buckets, self.token_buckets = step_buckets(
            max_num_seqs, max_num_batched_tokens, smallest_seq_bucket(cfg, attn_config.backend)
        )
        if attn_config.smallest_decode_rows != self.seq_buckets[0]:
            self.attn = attn_config = dataclasses.replace(attn_config, smallest_decode_rows=self.seq_buckets[0])
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {list(KV_DTYPES)}.")
        self.kv_values_dtype = jnp.dtype(KV_DTYPES[kv_cache_dtype] or cfg.dtype)  # what the pages' values are
        self.kv_dtype = kv_storage_dtype(self.kv_values_dtype)  # what holds them in memory
        if self.kv_dtype == jnp.uint8:
            self.attn = attn_config = dataclasses.replace(attn_config, kv_dtype=str(self.kv_values_dtype))
        # Weights still loading (abstract_weights): the KV cache is allocated once they are bound (warm_up).
        self.kv_caches = self._allocate_kv() if self.has_weights else self._kv_specs()
        self.multihost = multihost
        self.drafter, self.draft_params = drafter, draft_params
        self.draft_kv = self._draft_kv(allocate=self.has_weights)
        self._final_norm = None  # final_hidden's jitted norm
        self._last_rows = None
        self._host_weights: tuple | None = None  # sleep(): the weights' host copies and shardings until wake_up()
        self._kv_asleep = False
        shape = (self.seq_buckets[-1],)
        self.prev_tokens = jnp.zeros(shape, jnp.int32) if multihost is None else multihost.sampled_zeros(shape)
        self.batch = InputBatch(2 * max_num_seqs, self.max_pages, PAD_PAGE)
        self.pipeline = None
        if mesh_pp(mesh) > 1:  # stages on their own devices, one jit each (compiled by warm_up)
            from jaxllm.engine.pipeline import PipelineExecutor

            if not self.has_weights:
                raise ValueError("Pipeline stages are warmed up by running them: they need the loaded weights.")

            self.pipeline = PipelineExecutor(
                cfg,
                params,
                mesh,
                self.attn,
                block_size=block_size,
                max_pages=self.max_pages,
                token_buckets=self.token_buckets,
                seq_buckets=self.seq_buckets,
                pad_page=PAD_PAGE,
                move=multihost.move if multihost is not None else jax.device_put,
            )
        self.programs = StepPrograms(
            cfg,
            self.attn,
            mesh.devices.flat,
            seq_buckets=self.seq_buckets,
            token_buckets=self.token_buckets,
            kv_specs=self._kv_specs(),
            dummy_host=functools.partial(
                dummy_host_inputs,
                max_pages=self.max_pages,
                batch=self.batch,
                vocab_size=cfg.vocab_size,
                lora=lora is not None,
            ),
            max_penalty_width=2 * self.max_pages * block_size,
            pipeline=self.pipeline is not None,
            executable_cache_dir=executable_cache_dir,
            num_spec=num_spec_tokens,
            spec_max_seqs=spec_max_seqs,
            drafter=drafter,
            draft_state=(draft_params, self._draft_kv(allocate=False)),
            block_size=block_size,
            lora_specs=None if lora is None else lora.abstract(),
        )
        self.host = StepPreparer(
            self.batch,
            self.programs,
            seq_buckets=self.seq_buckets,
            token_buckets=self.token_buckets,
            block_size=block_size,
            max_pages=self.max_pages,
            max_logprobs=max_logprobs,
            vocab_size=cfg.vocab_size,
            lora=lora,
            drafter=drafter is not None,
        )
        # Which sampler program a step runs must not depend on one process's compile state (multihost.py).
        self.programs.exact_samplers = multihost is not None
        # Nor which decode program: long-context steps run their own with one process only (and none of the
        # programs pipeline stages or drafters choose themselves).
        if multihost is None and self.pipeline is None and drafter is None:
            self.host.long_decode_from = long_decode_from(self.attn, max_model_len, self.kv_dtype)
        # The sampler-only programs' weights: the final norm and output weights. (params None: a host-only
        # runner, for prepare() alone, as bench/host_overhead.py builds)
        self._head = _head_of(params or {})
        # Steps with at least this many structured-output masks run split when the engine has host work to do
        # before sampling (launch's before_sample): the grammar update then overlaps the model on the device.
        # Split costs one more output-head pass (an 8B model's: ~0.2 ms to read it on an H200), less than the
        # device idles while the host updates the grammars and dispatches a whole step after the previous
        # step's tokens arrive. H200, 8B, one constrained request: 229 tok/s split, 154 whole (unconstrained
        # 246); 500 requests, 5 / 50 / all 500 constrained: 40.25 / 39.36 / 36.68 req/s split, 39.38 / 37.90 /
        # 32.05 whole (bench/results/structured_h200_*). A huge value turns it off (A/B in bench/structured.py).
        self.overlap_min_masked = 1

    # ---- memory ----
    def _allocate_kv(self):
        # kv heads over tp (repeated when tp > K), each layer on its pipeline stage's devices.
        return make_kv_caches(self.cfg, self.mesh, self.num_blocks, self.block_size, self.kv_dtype)

    def _kv_specs(self):
        return kv_cache_specs(self.cfg, self.mesh, self.num_blocks, self.block_size, self.kv_dtype)

    def _draft_kv(self, allocate: bool):
        """The drafter's KV cache (its layers, the target's page count) or its specs; None without a drafter."""
        if self.drafter is None:
            return None
        dcfg = self.drafter.cfg
        make = make_kv_caches if allocate else kv_cache_specs
        return make(dcfg, self.mesh, self.num_blocks, self.block_size, kv_storage_dtype(jnp.dtype(dcfg.dtype)))

    def _kv_allocated(self) -> bool:
        return isinstance(self.kv_caches[0][0], jax.Array)

    @property
    def has_weights(self) -> bool:
        """False while params are abstract_weights (the steps can be compiled, not run; see set_params)."""
        return not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.params))

    def set_params(self, params) -> None:
        """Binds weights to the runner: their tree, shapes, dtypes and shardings must be those the step
        programs were compiled for (the abstract_weights the runner was built with)."""
        if self.lora is not None:
            params = self.lora.absorb(params)
        old, new = jax.tree.leaves(self.params), jax.tree.leaves(params)
        same = jax.tree.structure(params) == jax.tree.structure(self.params) and all(
            a.shape == b.shape and a.dtype == b.dtype and b.sharding.is_equivalent_to(a.sharding, len(a.shape))
            for a, b in zip(old, new)
        )
        if not same:
            raise ValueError(
                "The loaded weights' tree, shapes, dtypes or shardings differ from those the step "
                "programs were compiled for."
            )
        self.params = params
        self._head = _head_of(params)

    # ---- sleep mode (vLLM's LLM.sleep / wake_up) ----
    @property
    def sleeping(self) -> dict[str, bool]:
        """What sleep() released and wake_up() has not put back: {"weights": ..., "kv_cache": ...}."""
        return {"weights": self._host_weights is not None, "kv_cache": self._kv_asleep}

    def sleep(self) -> None:
        """Frees the device memory of the weights (kept in host memory) and of the KV cache (its contents dropped):
        vLLM's sleep level 1. One process, no pipeline stages (their weights live in the stages' executors)."""
        if self.pipeline is not None or self.multihost is not None:
            raise ValueError("Sleep mode needs an engine in one process without pipeline stages.")
        if self._host_weights is None:
            trees = {"params": self.params, "draft_params": self.draft_params}
            if self.lora is not None:
                trees["lora"] = self.lora.arrays
            self._host_weights = (jax.tree.map(np.asarray, trees), jax.tree.map(lambda a: a.sharding, trees))
            _delete(trees)
            self._head = {}
        if not self._kv_asleep:
            _delete((self.kv_caches, self.draft_kv))
            self.kv_caches, self.draft_kv = self._kv_specs(), self._draft_kv(allocate=False)
            self._kv_asleep = True

    def wake_up(self, weights: bool = True, kv_cache: bool = True) -> None:
        """Puts back what sleep() freed: the weights from host memory, on their shardings, and an empty KV cache."""
        if weights and self._host_weights is not None:
            trees = jax.tree.map(jax.device_put, *self._host_weights)
            self.params, self.draft_params = trees["params"], trees["draft_params"]
            if self.lora is not None:
                self.lora.arrays = trees["lora"]
            self._head = _head_of(self.params)
            self._host_weights = None
        if kv_cache and self._kv_asleep:
            self.kv_caches, self.draft_kv = self._allocate_kv(), self._draft_kv(allocate=True)
            self._kv_asleep = False

    @staticmethod
    def kv_bytes_per_block(
        cfg: ModelConfig, block_size: int, kv_cache_dtype: str = "auto", tp: int = 1, pp: int = 1
    ) -> int:
        """KV bytes one block costs on one device: its stage's layers and its share of the stored kv heads
        (kv heads are repeated when tp > K)."""
        from jaxllm.sharding import kv_heads_for, stage_layers

        dtype = kv_storage_dtype(jnp.dtype(KV_DTYPES.get(kv_cache_dtype) or cfg.dtype))
        layers = max(len(r) for r in stage_layers(cfg.num_layers, pp))
        heads = kv_heads_for(cfg.num_kv_heads, tp) // tp
        return 2 * layers * heads * block_size * cfg.head_dim * dtype.itemsize

    # ---- start-up ----
    def warm_up(self, enforce_eager: bool = False, workers: int | None = None, weights=None) -> None:
        """Compiles every shape bucket now (StepPrograms.compile_variants), so serving never stalls on the
        compiler (enforce_eager: skip).

        weights: a Future of the params, for a runner built on abstract_weights: the steps are traced and
        compiled while they load, then bound (set_params) and the KV cache allocated. If loading fails,
        compiling stops early and the loader's error is raised."""
        programs = self.programs
        try:
            if not enforce_eager and self.pipeline is not None:
                self.kv_caches, self.prev_tokens = programs.warm_up_pipeline(
                    self.pipeline, self.kv_caches, self.prev_tokens, self.pipeline.head_params
                )
            elif not enforce_eager:
                # XLA's GEMM autotuner measures on its own copies of each GEMM's operands, in device memory, and
                # the compiles run in parallel: compile against the KV cache's shapes while its memory is free
                # (an H100 start-up with the cache allocated had a compile fail for memory and redone alone:
                # 37 -> 51 s), then allocate it. (Only before the first step: later the cache holds sequences.)
                if not programs.warmed_up and self._kv_allocated() and programs.uncompiled():
                    for a in jax.tree.leaves((self.kv_caches, self.draft_kv)):
                        a.delete()
                    self.kv_caches, self.draft_kv = self._kv_specs(), self._draft_kv(allocate=False)
                programs.compile_variants(self.params, self.prev_tokens, workers, weights)
        finally:
            if weights is not None:
                self.set_params(weights.result())
            if not self._kv_allocated() and self.has_weights:
                self.kv_caches, self.draft_kv = self._allocate_kv(), self._draft_kv(allocate=True)
        programs.finish_warm_up(enforce_eager)

    def _step_args(self, host_args, packed: tuple | None = None) -> tuple:
        """The step program's arguments for these host inputs (packed: pack_host_args, or packed where made)."""
        lora = None if self.lora is None else self.lora.arrays
        return step_args(host_args, self.params, self.kv_caches, self.prev_tokens, lora, packed)

    # ---- one step ----
    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """The host half of a step (StepPreparer.prepare, prepare.py): padded numpy inputs and the bucket."""
        return self.host.prepare(sched)

    def _launch_unverified(self, p: PreparedStep, before_sample) -> StepHandle:
        """A verify step whose program is not ready (non-default sampler flags compiling in the background)
        runs as plain decodes of each sequence's last token: the scheduler then rolls every proposal back."""
        plain_seqs = [
            dataclasses.replace(s, num_tokens=1, token_ids=s.token_ids[:1], spec_token_ids=[])
            for s in p.sched.scheduled
        ]
        stripped = dataclasses.replace(
            p.sched, scheduled=plain_seqs, freed=[], trimmed={}, num_batched_tokens=len(plain_seqs), verify=False
        )
        handle = self.launch(self.prepare(stripped), before_sample)
        handle.sched = p.sched
        return handle

    def execute(self, sched: SchedulerOutput) -> StepHandle:
        return self.launch(self.prepare(sched))

    def refresh_masks(self, p: PreparedStep) -> None:
        """Rewrites p's structured-output masks from its sequences' current ones (the engine advanced their
        grammars after p was prepared)."""
        masks = [seq.token_bitmask for _, seq in p.masked]  # rows 0, 1, ... in order (sampling_arrays)
        if masks:
            np.stack(masks, out=p.host_args[4].token_bitmask[: len(masks)])

    def launch(self, p: PreparedStep, before_sample: Callable[[], None] | None = None) -> StepHandle:
        """The device half of a step: dispatches p (asynchronously). before_sample (the engine's grammar update,
        which waits for the previous step's tokens and rewrites p's masks) runs before p's sampling inputs are
        read; when p has overlap_min_masked masks or more, p runs split and it runs after the model part is
        dispatched, so that host work overlaps the device's. Over several processes the step is sent to the
        others first (with its masks final: no overlap), and every process runs it (run_step)."""
        v, programs = p.variant, self.programs
        if self.lora is not None:  # dispatched after the steps in flight, which the device finishes first
            self.lora.write(p.lora_loads)
        meanwhile = v.long_context and not programs.long_program_ready(
            v, _plain_sampling(p.host_args), self.params, self.kv_caches, self.prev_tokens
        )
        if meanwhile:
            p = _short_context(p)  # the bucket's start-up program while the long one compiles
            v = p.variant
        if v.num_spec and not programs.runs_whole(v, p.host_args, self.params, self.kv_caches, self.prev_tokens):
            return self._launch_unverified(p, before_sample)
        overlap = (
            self.multihost is None
            and len(p.masked) >= self.overlap_min_masked
            and not v.prompt_logprobs
            and not v.num_spec
        )
        prev_in = self.prev_tokens
        if self.pipeline is not None:
            mode = "pipeline"
        elif not overlap and programs.runs_whole(
            v, p.host_args, self.params, self.kv_caches, self.prev_tokens, start=not meanwhile
        ):
            mode = "whole"
        else:
            mode = "split"
        if self.multihost is not None:
            (before_sample or (lambda: None))()  # the masks are final before the step goes out
            before_sample = None
            self.multihost.send_step(v, mode, p.host_args)
        outputs, prompt, feats = self.run_step(v, mode, p.host_args, before_sample, p.packed)
        if self.multihost is None:  # the copy starts when the step ends, not when collect asks for it
            outputs[-1].copy_to_host_async()
        drafts = None
        if self.drafter is not None:
            drafts = self._launch_draft(p, prev_in, feats[0] if feats else None, outputs)
        self.host.prev_rows = dict(p.sample_rows)
        return StepHandle(
            p.sched, p.sample_rows, (outputs, prompt, drafts), p.prompt_rows, p.num_logprobs, self._last_rows
        )

    def run_step(
        self,
        v: StepVariant,
        mode: str,
        host_args,
        before_sample: Callable[[], None] | None = None,
        packed: tuple | None = None,
    ):
        """The device work of a step: "pipeline" (the stages, then the sampling head), "whole" (v's step program)
        or "split" (the bucket's start-up program, then a sampler-only program for v's flags). Returns the device
        outputs (sampled tokens and their logprobs, prompt logprobs or None, the drafter's features or ()).
        packed: host_args packed where prepare made them (PreparedStep.packed), for "whole". multihost.follow runs
        it on the other processes."""
        token_ids, src_rows, meta, logits_indices, smd, prompt_targets, token_slots = host_args
        before_sample = before_sample or (lambda: None)
        programs, head, feats = self.programs, self._head, ()
        self._last_rows = None  # the sampled rows' hidden states [B, D] ("whole" and "split"): an embedding's source
        if self.lora is not None:
            head = dict(head, lora_lm_head=self.lora.arrays["lm_head"])  # the sampler-only program's adapters
        if mode == "pipeline":
            self.kv_caches, hidden = self.pipeline.forward(self.kv_caches, token_ids, src_rows, meta, self.prev_tokens)
            before_sample()
            self.prev_tokens, outputs, prompt = programs.pipeline_head(
                self.pipeline.head_params,
                hidden,
                self.prev_tokens,
                logits_indices,
                smd,
                prompt_targets,
                cfg=self.cfg,
                flags=v.flags,
                prompt_k=v.prompt_logprobs,
                mesh=self.pipeline.meshes[-1],
            )
        elif mode == "whole":
            before_sample()
            args = self._step_args(host_args, packed)
            exe = programs.executable(v, args)
            self.kv_caches, self.prev_tokens, outputs, prompt, self._last_rows, *feats = exe(*args)
        else:
            # Split: the bucket's start-up program (default flags; its own sampling is discarded) runs the model
            # and returns the sampled rows' hidden states, and a sampler-only program samples them with v's
            # flags. For non-default flags whose step program is still compiling in the background, and for
            # overlap.
            base = StepVariant(v.num_tokens, v.num_seqs, v.decode_only, SamplerFlags(), 0, long_context=v.long_context)
            args = self._step_args(_plain_sampling(host_args))
            self.kv_caches, _, _, _, rows, *feats = programs.executable(base, args)(*args)
            self._last_rows = rows
            before_sample()
            exe, sargs = programs.sampler_call(v, head, rows, self.prev_tokens, smd)
            self.prev_tokens, outputs = exe(*sargs)
            prompt = None
        if v.flags.penalties and not v.num_spec:
            programs.sampler_ahead(v, head, self.prev_tokens, smd)
        if self.multihost is not None:
            outputs, prompt = self.multihost.step_outputs((outputs, prompt), (self.kv_caches, self.prev_tokens))
        return outputs, prompt, feats

    def _launch_draft(self, p: PreparedStep, prev_in, feats, outputs):
        """The drafter's program after p's step (spec_decode/drafter.py): keeps its KV in step with the target's
        and, after a verify step, proposes the next K tokens of each sequence (device array [B, K], else None)."""
        v = p.variant
        dv = StepVariant(v.num_tokens, v.num_seqs, v.decode_only, SamplerFlags(), 0, num_spec=v.num_spec, draft=True)
        token_ids, src_rows, meta, logits_slot, smd, prompt_targets, _ = p.host_args
        host = (token_ids, src_rows, meta, logits_slot, plain(smd), prompt_targets)
        emitted = (outputs[0], outputs[5]) if v.num_spec else None
        args = draft_args(
            host,
            self.params,
            (self.draft_params, self.draft_kv),
            prev_in,
            self.prev_tokens,
            feats,
            emitted,
            p.draft_extras,
        )
        self.draft_kv, drafts = self.programs.executable(dv, args)(*args)
        return drafts

    def final_hidden(self, handle: StepHandle, seq_ids: list[str]) -> np.ndarray:
        """The final-normed hidden states [n, D] (float32) of seq_ids' sampled rows in handle's step: what an
        embedding model pools (their prompts' last tokens, in the step that finished each prefill)."""
        if handle.hidden is None:
            raise RuntimeError("This step kept no hidden states (pipeline stages do not).")
        if self._final_norm is None:
            cfg = self.cfg
            self._final_norm = jax.jit(lambda rows, p, idx: final_normed(p, rows[idx], cfg).astype(jnp.float32))
        idx = np.asarray([handle.rows[s] for s in seq_ids], np.int32)
        return np.asarray(self._final_norm(handle.hidden, {"final_norm": self.params["final_norm"]}, idx))

    def collect(self, handle: StepHandle) -> StepResult:
        """The step's results on the host. One process: the packed copy of its sampled outputs (one device-to-host
        copy, started at launch) split by the others' shapes; several: process 0 fetches them (multihost.fetch)."""
        outputs, prompt, drafts = handle.outputs
        if self.multihost is None:
            arrays = unpack_outputs(np.asarray(outputs[-1]), outputs[:-1])
            if prompt is not None or drafts is not None:
                prompt, drafts = jax.device_get((prompt, drafts))
        else:
            arrays, prompt, drafts = self.multihost.fetch((outputs[:-1], prompt, drafts))
        return StepResult(*arrays[:5], prompt, *arrays[5:], draft_tokens=drafts)


def _head_of(params) -> dict:
    """The params the sampler-only program reads: the final norm and the lm_head (or the tied embedding)."""
    return {k: params[k] for k in ("final_norm", "lm_head", "embed") if k in params}


def _delete(tree) -> None:
    """Frees the device buffers of tree's arrays (each once: trees may share one)."""
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.Array) and not a.is_deleted():
            a.delete()
