"""StepPrograms: every compiled program of a runner, and its life cycle. ModelRunner (runner.py) asks it for
executables and calls them; it never compiles itself.

Where a step is ...
  - defined: step_fns.py, pure functions (the model, then sampling) traced here with static arguments (model
    config, attention config, sampler flags, prompt logprobs k). A StepVariant names one program: the shape
    bucket (T tokens, B sequences, decode-only or not), the sampler flags and the sampling rows' widths.
  - compiled: here, at three moments.
      1. Start-up (ModelRunner.warm_up -> compile_variants): every shape bucket with the default sampler flags,
         traced one after another and compiled in a thread pool, against the KV cache's specs and dummy host
         inputs given at construction. pp > 1: warm_up_pipeline runs the stages and sampling head once instead.
      2. After warm-up, a step with other sampler flags (top-p, penalties, logprobs, grammars, ...): its whole
         step program compiles in the background (runs_whole) while its steps run "split": the bucket's
         start-up program, then a sampler-only program on the sampled rows' hidden states (sampler_call, in
         sampler_programs.py, whose SamplerPrograms this class inherits). A sampler-only program is small and
         compiles on first use, or in the background when a program for more structured-output masks can serve
         meanwhile; sampler_ahead compiles the next penalty width early.
      3. A step whose program is missing anyway (eager mode, prompt logprobs): compiled when asked
         (executable), logged as an error after warm-up for the default flags.
  - cached: in memory in `compiled` (step programs by StepVariant) and `samplers` (sampler-only programs by
    (B, flags, row widths), filled by sampler_programs.py); on disk in the executable cache (exec_cache.py,
    ExecutableCache), which every compile here consults first and writes after, so a warm start loads programs
    without tracing them.
  - run: runner.py (ModelRunner.launch) on the packed host inputs (packing.py). Only the pipeline warm-up runs
    programs here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.engine.exec_cache import ExecutableCache
from jaxllm.engine.inputs import bucket
from jaxllm.engine.sampler import SamplerFlags
from jaxllm.engine.sampler_programs import SamplerPrograms, array_spec
from jaxllm.engine.step_fns import (
    packed_sample_rows_fn,
    packed_spec_step_fn,
    packed_step_fn,
    pipeline_head_fn,
)
from jaxllm.engine.step_io import StepVariant, draft_args, step_args  # noqa: F401 (re-exported)
from jaxllm.engine.xla_options import CUBLAS_MIN_DECODE_SEQS, compile_options  # noqa: F401
from jaxllm.models.attention import AttentionConfig

logger = logging.getLogger(__name__)


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


class StepPrograms(SamplerPrograms):
    """The compiled programs of one runner (see the module docstring).

    kv_specs: the KV cache's per-layer (k, v) specs (shapes, dtypes, shardings) the step programs are compiled
    for; dummy_host: StepVariant -> host inputs of its shapes that write no KV slot (token_ids, src_rows, meta,
    logits_indices, smd, prompt_targets, token_slots); lora_specs: the LoRA slot arrays' specs (None without
    LoRA). All come from the runner, which owns the memory and the inputs."""

    def __init__(
        self,
        cfg: ModelConfig,
        attn: AttentionConfig,
        devices,
        *,
        seq_buckets: tuple[int, ...],
        token_buckets: tuple[int, ...],
        kv_specs,
        dummy_host: Callable[[StepVariant], tuple],
        max_penalty_width: int,
        pipeline: bool = False,
        executable_cache_dir: str | None = None,
        num_spec: int = 0,
        spec_max_seqs: int = 0,
        drafter=None,
        draft_state=None,
        block_size: int = 16,
        lora_specs=None,
    ):
        """drafter: a spec_decode.drafter.Drafter (a draft model or EAGLE head) or None; draft_state: its (params,
        KV cache specs) the draft programs are compiled for."""
        self.cfg, self.attn = cfg, attn
        self.drafter, self.draft_state, self.block_size = drafter, draft_state, block_size
        # Speculative decoding: K (0: off) and the largest batch bucket whose verify step is compiled at start-up
        self.num_spec, self.spec_max_seqs = num_spec, spec_max_seqs
        self.seq_buckets, self.token_buckets = seq_buckets, token_buckets
        self.kv_specs, self.dummy_host, self.lora_specs = kv_specs, dummy_host, lora_specs
        self.max_penalty_width = max_penalty_width  # penalty rows never get wider (2 x the longest sequence)
        self._jit = jax.jit(
            packed_step_fn, static_argnames=("cfg", "attn", "flags", "prompt_k", "drafter"), donate_argnums=(1,)
        )
        self._spec_jit = jax.jit(
            packed_spec_step_fn, static_argnames=("cfg", "attn", "flags", "num_spec", "drafter"), donate_argnums=(1,)
        )
        self._draft_jit = None
        if drafter is not None:
            from jaxllm.spec_decode.drafter import draft_step_fn

            self._draft_jit = jax.jit(
                draft_step_fn, static_argnames=("drafter", "attn", "block_size"), donate_argnums=(2,)
            )
        # pp > 1: the last stage's logits and sampling (the stages are pipeline.py's jits)
        self.pipeline_head = (
            jax.jit(pipeline_head_fn, static_argnames=("cfg", "flags", "prompt_k", "mesh")) if pipeline else None
        )
        self.compiled: dict[StepVariant, object] = {}
        # Sampler-only programs for steps with non-default sampler flags, by (B, flags, row widths).
        self._sampler_jit = jax.jit(packed_sample_rows_fn, static_argnames=("cfg", "flags", "mesh"))
        self.samplers: dict[tuple, object] = {}
        # Whole step programs for non-default sampler flags, compiling in the background (see runs_whole).
        self._background = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-compile")
        # At exit Python joins the pool's thread only once it has run every queued job (a whole step compile
        # each): drop them first. (concurrent.futures registered its own hook earlier, so it runs after this.)
        threading._register_atexit(functools.partial(_drop_queued, weakref.ref(self._background)))
        self.pending: dict[StepVariant, object] = {}
        self._sampler_jobs: dict[tuple, object] = {}  # sampler programs compiling in the background
        self._rows_spec: dict[int, jax.ShapeDtypeStruct] = {}  # B -> the start-up programs' sampled rows
        self._split_only: set[StepVariant] = set()  # their background compile failed: they keep running split
        self.split_sampler = True  # False: compile a whole step program before the step (tests compare the two)
        # True: a split step always runs its exact sampler program (compiled now if need be), never a wider one
        # meanwhile; set over several processes, which must all run the same program (multihost.py).
        self.exact_samplers = False
        # Compiled steps on disk (exec_cache.py): a warm start loads them instead of tracing every bucket.
        # Not with pipeline stages (jits called per micro-batch, compiled by warm_up) nor across processes.
        self.exec_cache = None
        if executable_cache_dir and not pipeline and jax.process_count() == 1:
            self.exec_cache = ExecutableCache(executable_cache_dir, devices)
        self.warmed_up = False
        self.eager = False
        self.num_compiles_after_warmup = 0

    # ---- step programs ----
    def variants(self) -> list[StepVariant]:
        """The shape buckets compiled at start-up (default sampler flags)."""
        out = [StepVariant(b, b, True, SamplerFlags(), 0) for b in self.seq_buckets]
        for t in self.token_buckets:
            out.append(StepVariant(t, bucket(min(t, self.seq_buckets[-1]), self.seq_buckets), False, SamplerFlags(), 0))
        if self.num_spec and not self.pipeline_head:
            top = bucket(min(self.spec_max_seqs, self.seq_buckets[-1]), self.seq_buckets)
            out += [self.spec_variant(b, SamplerFlags()) for b in self.seq_buckets if b <= top]
        if self.drafter is not None:  # each shape's draft program
            out += [dataclasses.replace(v, draft=True) for v in out]
        return out

    def spec_variant(self, B: int, flags: SamplerFlags, widths: tuple = (1, 1, 1, 1, 1, 1)) -> StepVariant:
        """The speculative (verify) step of B sequences: T fits every sequence's token and K proposals (one
        variant per B; the scheduler's token budget caps what a step holds, so T never exceeds the largest token
        bucket)."""
        T = bucket(min(B * (self.num_spec + 1), self.token_buckets[-1]), self.token_buckets)
        return StepVariant(T, B, False, flags, 0, widths, self.num_spec)

    def dummy_args(self, v: StepVariant, params, prev_tokens) -> tuple:
        """v's step program's arguments as compiled at start-up: dummy host inputs, the KV cache's specs."""
        if not v.draft:
            return step_args(self.dummy_host(v), params, self.kv_specs, prev_tokens, self.lora_specs)
        T, B, K = v.num_tokens, v.num_seqs, v.num_spec
        host = self.dummy_host(dataclasses.replace(v, draft=False))
        rep = jax.sharding.NamedSharding(self.attn.mesh, jax.sharding.PartitionSpec())
        feats = emitted = None
        if self.drafter.uses_features:
            feats = jax.ShapeDtypeStruct((T, self.drafter.feature_dim), self.cfg.dtype, sharding=rep)
        if K:
            emitted = (
                jax.ShapeDtypeStruct((B, K + 1), np.int32, sharding=rep),
                jax.ShapeDtypeStruct((B,), np.int32, sharding=rep),
            )
        extras = (np.full(B, -1, np.int32), np.zeros(B, np.int32))
        return draft_args(host, params, self.draft_state, prev_tokens, prev_tokens, feats, emitted, extras)

    def _lower(self, v: StepVariant, args):
        if v.draft:
            return self._draft_jit.lower(*args, drafter=self.drafter, attn=self.attn, block_size=self.block_size)
        if v.num_spec:
            return self._spec_jit.lower(
                *args, cfg=self.cfg, attn=self.attn, flags=v.flags, num_spec=v.num_spec, drafter=self.drafter
            )
        return self._jit.lower(
            *args, cfg=self.cfg, attn=self.attn, flags=v.flags, prompt_k=v.prompt_logprobs, drafter=self.drafter
        )

    def _cache_key(self, v: StepVariant, args) -> str:
        static = (self.cfg, self.attn, v.flags, v.prompt_logprobs) + ((("spec", v.num_spec),) if v.num_spec else ())
        if self.drafter is not None:  # every program of a runner with a drafter differs (features, or the draft)
            static += (("drafter", self.drafter, v.draft, self.block_size),)
        options = compile_options(v)
        return self.exec_cache.key("step", args, static + ((tuple(sorted(options.items())),) if options else ()))

    def _load(self, v: StepVariant, args):
        """v's executable from the executable cache, or None (no cache, a miss, or an unusable entry)."""
        return None if self.exec_cache is None else self.exec_cache.load(self._cache_key(v, args), args)

    def _compile(self, v: StepVariant, args, lowered, oom_none: bool = False):
        """Compiles (and stores in the executable cache); with oom_none, None when XLA's autotuner ran out
        of device memory (see _compile_or_none)."""
        options = compile_options(v)
        compile_fn = (
            functools.partial(_compile_or_none, lowered, options)
            if oom_none
            else functools.partial(lowered.compile, compiler_options=options)
        )
        if self.exec_cache is None:
            return compile_fn()
        return self.exec_cache.compile_and_store(self._cache_key(v, args), compile_fn)

    def executable(self, v: StepVariant, args):
        """v's step program for arguments like args: compiled, loaded from the executable cache or compiled
        now (after warm-up, outside eager mode, counted and logged)."""
        exe = self.compiled.get(v)
        if exe is None:
            t0 = time.perf_counter()
            exe = self._load(v, args)
            msg = "Loaded step %s in %.1f s"
            if exe is None:
                exe = self._compile(v, args, self._lower(v, args))
                msg = "Compiled step %s in %.1f s"
            self.compiled[v] = exe
            if self.warmed_up and not self.eager:
                default = v.flags == SamplerFlags() and not v.prompt_logprobs
                self.num_compiles_after_warmup += 1
                (logger.error if default else logger.warning)(msg + " after warm-up", v, time.perf_counter() - t0)
            else:
                logger.debug(msg, v, time.perf_counter() - t0)
        return exe

    def temp_bytes(self) -> int:
        """The largest temporary buffer of the compiled step programs (XLA's memory_analysis, per device): the
        working memory a step allocates beside its arguments (weights, KV cache). 0 where none reports it."""
        out = 0
        for exe in list(self.compiled.values()):
            try:
                stats = exe.memory_analysis()
            except (jax.errors.JaxRuntimeError, NotImplementedError):
                continue
            out = max(out, getattr(stats, "temp_size_in_bytes", 0) or 0)
        return out

    # ---- start-up ----
    def uncompiled(self) -> list[StepVariant]:
        return [v for v in self.variants() if v not in self.compiled]

    def finish_warm_up(self, eager: bool) -> None:
        """From now on a missing program is a compile after warm-up (eager: expected, not counted)."""
        self.warmed_up, self.eager = True, eager

    def warm_up_pipeline(self, pipeline, kv_caches, prev_tokens, head_params):
        """pp > 1: the stages are separate jits on their own devices (pipeline.py), called per micro-batch, and
        the sampling head another on the last stage: each is run once per step shape on inputs that write
        no KV slot (twice for the head, whose prev_tokens argument is the initial array the first time and
        its own output after). Returns the new (kv_caches, prev_tokens)."""
        t0 = time.perf_counter()
        variants = self.variants()
        shapes = sorted({(v.num_tokens, v.num_seqs, v.decode_only) for v in variants})
        kv_caches, hiddens = pipeline.warm_up(kv_caches, prev_tokens, shapes)
        for _ in range(2):
            for v in variants:
                _, _, _, logits_indices, smd, prompt_targets, _ = self.dummy_host(v)
                prev_tokens, outputs, _ = self.pipeline_head(
                    head_params,
                    hiddens[v.num_tokens],
                    prev_tokens,
                    logits_indices,
                    smd,
                    prompt_targets,
                    cfg=self.cfg,
                    flags=v.flags,
                    prompt_k=v.prompt_logprobs,
                    mesh=pipeline.meshes[-1],
                )
        jax.block_until_ready((kv_caches, outputs))
        logger.info(
            "Pipeline stages and sampling head compiled for %d step shapes in %.1f s",
            len(shapes),
            time.perf_counter() - t0,
        )
        return kv_caches, prev_tokens

    def compile_variants(
        self, params, prev_tokens, workers: int | None = None, weights=None, variants: list[StepVariant] | None = None
    ) -> None:
        """Loads or compiles every start-up variant not compiled yet. Buckets in the executable cache are
        loaded, untraced. The others are traced one after another (Python) and compiled in a thread pool (XLA
        releases the GIL). When the pool leaves a core free, each bucket is compiled as soon as it is traced,
        so tracing overlaps compiling (2-core VM, 1 compile thread, 10 buckets of a 32-layer model: 81 -> 66 s,
        68 -> 53 s); otherwise tracing would only slow the compiles down (2 threads: 35 -> 43 s), so all are
        traced first. Stops tracing once the weights Future (if any) has failed. variants: these instead of the
        start-up ones (bench/spec_decode.py compiles its grid of verify steps so)."""
        t0 = time.perf_counter()
        todo = self.uncompiled() if variants is None else [v for v in variants if v not in self.compiled]
        args = {v: self.dummy_args(v, params, prev_tokens) for v in todo}
        workers = max(1, min(workers or 8, len(todo) or 1, os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            for v, exe in zip(todo, pool.map(lambda v: self._load(v, args[v]), todo), strict=True):
                if exe is not None:
                    self.compiled[v] = exe
            t1, n_loaded = time.perf_counter(), len([v for v in todo if v in self.compiled])
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
                if v not in self.compiled:
                    low = self._lower(v, args[v])
                    jobs.append((v, low, pool.submit(compile_timed, v, low) if overlap else None))
            t2 = time.perf_counter()
            jobs = [(v, low, job or pool.submit(compile_timed, v, low)) for v, low, job in jobs]
            done = [(v, low, job.result()) for v, low, job in jobs]
        retried = 0
        for v, low, exe in done:
            if exe is None:  # out of device memory for parallel autotuning: compile this one alone
                exe, retried = self._compile(v, args[v], low), retried + 1
            self.compiled[v] = exe
        if retried:
            logger.warning(
                "%d step variants ran out of device memory compiling in parallel; compiled them one at a time", retried
            )
        if self.exec_cache is not None:
            self.exec_cache.prune()
        slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:3]
        logger.info(
            "Step variants ready in %.1f s: %d loaded from %s in %.1f s, %d traced in %.1f s and "
            "compiled (%d threads; longest: %s)",
            time.perf_counter() - t0,
            n_loaded,
            self.exec_cache.dir if self.exec_cache else "-",
            t1 - t0,
            len(jobs),
            t2 - t1,
            workers,
            ", ".join(f"{v.shape_name} {s:.1f} s" for v, s in slowest) or "-",
        )

    # ---- whole step programs for other sampler flags, compiled in the background ----
    def runs_whole(self, v: StepVariant, host_args, params, kv_caches, prev_tokens, start: bool = True) -> bool:
        """Whether v runs as one step program: default flags, prompt logprobs (rare; they need every token's
        logits), eager mode and warm-up do. Other flags do once their program is ready: the first step that
        needs it loads it from the executable cache or, on a miss, starts compiling it in the background (a
        whole 8B step takes seconds to compile, and every running request would wait) and runs split until
        then (the model, then a sampler-only program: one more output-head GEMM per step). host_args and the
        device state are v's step's (only their shapes, dtypes and shardings are read). start=False: a step that
        runs its bucket's short program only while the long-context one compiles (long_program_ready) loads or
        compiles nothing for v: v's whole program may never be needed once the long one is ready."""
        if v in self.compiled or v.flags == SamplerFlags() or v.prompt_logprobs or not self.split_sampler:
            return True
        if self.eager or not self.warmed_up:
            return True
        return start and self._ready_or_compiling(v, host_args, params, kv_caches, prev_tokens)

    def long_program_ready(self, v: StepVariant, host_args, params, kv_caches, prev_tokens) -> bool:
        """Whether the long-context program of v's decode bucket (StepVariant.long_context, default sampler
        flags) can run v's step: compiled, or loaded now from the executable cache. Otherwise its compile starts
        in the background (at the bucket's first long step, not at start-up: most deployments' long steps use
        few buckets, and start-up would compile every bucket twice) and the step runs the bucket's start-up
        program meanwhile, whose decode kernel gives the same attention up to rounding. In eager mode and
        before warm-up it is compiled when asked, as any program. host_args: the step's, with plain sampling
        arrays (the bucket program's; only shapes, dtypes and shardings are read)."""
        base = StepVariant(v.num_tokens, v.num_seqs, True, SamplerFlags(), 0, long_context=True)
        if base in self.compiled or self.eager or not self.warmed_up:
            return True
        return self._ready_or_compiling(base, host_args, params, kv_caches, prev_tokens)

    def _ready_or_compiling(self, v: StepVariant, host_args, params, kv_caches, prev_tokens) -> bool:
        """True when v's program is ready (loaded from the executable cache, or its background compile filed);
        else starts its background compile if none is running (or failed) and returns False."""
        if v in self._split_only:
            return False
        job = self.pending.get(v)
        if job is None:
            # specs, not the arrays: the KV cache is donated to every step. prev_tokens as it is when uncommitted (the
            # start-up zeros): its spec would pin it to one device, which a tp mesh's params refuse
            prev = array_spec(prev_tokens) if getattr(prev_tokens, "committed", True) else prev_tokens
            args = step_args(host_args, params, jax.tree.map(array_spec, kv_caches), prev, self.lora_specs)
            exe = self._load(v, args)
            if exe is not None:
                self.compiled[v] = exe
                return True
            self.pending[v] = self._background.submit(self._compile_in_background, v, args)
        elif job.done():
            del self.pending[v]
            return self._file_background_compile(v, job)
        return False

    def _file_background_compile(self, v: StepVariant, job) -> bool:
        """Files a finished background compile (waits for it); True when v's step program is ready. One that
        failed is logged and v keeps running split, which gives the same tokens: raising here failed the step,
        so every request in it (and, in AsyncLLM, the engine)."""
        try:
            self.compiled[v] = job.result()
            return True
        except Exception:  # noqa: BLE001 - an optimisation failed; the split programs still serve v
            logger.exception(
                "Compiling step %s in the background failed; its steps keep running as they did meanwhile", v
            )
            self._split_only.add(v)
            return False

    def _compile_in_background(self, v: StepVariant, args):
        t0 = time.perf_counter()
        exe = self._compile(v, args, self._lower(v, args))
        self.num_compiles_after_warmup += 1
        logger.info(
            "Compiled step %s in %.1f s in the background (its steps ran split, or a long-context decode step the "
            "bucket's start-up program, until then)",
            v,
            time.perf_counter() - t0,
        )
        return exe

    def wait_for_background_compile(self, v: StepVariant) -> None:
        """Files v's background compile if one is running (waits for it): a worker process told to run v whole."""
        job = self.pending.pop(v, None)
        if job is not None:
            self._file_background_compile(v, job)

    def wait_for_background_compiles(self) -> None:
        """Blocks until the step programs compiling in the background are ready (tests, benchmarks)."""
        for v, job in list(self.pending.items()):
            del self.pending[v]
            self._file_background_compile(v, job)
        for job in list(self._sampler_jobs.values()):
            job.exception()
