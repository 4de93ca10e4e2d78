"""ModelRunner: SchedulerOutput -> StepInputs (padded numpy) -> one compiled step on the device.

Shapes are bucketed (T tokens, B sequences; the block table always has max_model_len / S columns) and each
(bucket, sampler flags) variant is compiled once, ahead of time for the default flags. The KV cache is
donated to every step. A step returns immediately (JAX dispatches asynchronously); the engine collects its
results later, so the host prepares step N+1 while the device runs step N. Tokens a step samples stay on
the device too: the next step reads them from `prev_tokens` for sequences whose input is still pending.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.engine.input_batch import PADDING_ROW, InputBatch
from jaxllm.engine.inputs import SeqChunk, build_step_inputs, bucket
from jaxllm.engine.sampler import SamplerFlags, SamplingMetadata, pad_rows, sample
from jaxllm.engine.scheduler import SchedulerOutput
from jaxllm.models.attention import AttentionConfig, AttentionMetadata
from jaxllm.models.decoder import compute_logits, forward
from jaxllm.sharding import make_kv_caches, mesh_pp

logger = logging.getLogger(__name__)

KV_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
PAD_PAGE = 0  # block 0 is reserved by the block manager: safe for padding to point at


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


@dataclass(frozen=True)
class StepVariant:
    num_tokens: int  # T bucket
    num_seqs: int  # B bucket
    decode_only: bool
    flags: SamplerFlags
    prompt_logprobs: int  # top-k for prompt logprobs, 0 = off
    sampler_widths: tuple = (1, 1, 1, 1, 1)  # padded widths of the ragged sampling rows


@dataclass
class StepHandle:
    """A dispatched step: device results plus what is needed to read them."""

    sched: SchedulerOutput
    rows: dict[str, int]  # seq_id -> row of the sampled outputs (sample=True chunks only)
    outputs: tuple  # device arrays
    prompt_rows: dict[str, tuple[int, int]]  # seq_id -> (first token index, count) when prompt logprobs
    num_logprobs: int


@dataclass
class PreparedStep:
    """One step's host-side inputs (numpy) and its variant, before dispatch."""

    variant: StepVariant
    host_args: tuple  # (token_ids [T], src_rows [T], meta, logits_indices [B], smd, prompt_targets [T])
    sample_rows: dict[str, int]
    prompt_rows: dict[str, tuple[int, int]]
    num_logprobs: int


@dataclass
class StepResult:
    tokens: np.ndarray  # [B]
    logprobs: np.ndarray  # [B]
    ranks: np.ndarray  # [B]
    top_ids: np.ndarray  # [B, k]
    top_logprobs: np.ndarray  # [B, k]
    prompt: tuple | None  # (target logprobs [T], ranks [T], top ids [T, k], top logprobs [T, k])


def _step_fn(params, kv_caches, token_ids, src_rows, prev_tokens, meta, logits_indices, smd, prompt_targets,
             *, cfg: ModelConfig, attn: AttentionConfig, flags: SamplerFlags, prompt_k: int):
    # Inputs that are still on the device: the previous step's sampled token of that sequence.
    token_ids = jnp.where(src_rows >= 0, prev_tokens[jnp.maximum(src_rows, 0)], token_ids)
    kv_caches, hidden = forward(params, kv_caches, token_ids, meta, cfg, attn)
    return (kv_caches, *_sample_fn(params, hidden, prev_tokens, logits_indices, smd, prompt_targets, cfg=cfg,
                                   flags=flags, prompt_k=prompt_k))


def _sample_fn(params, hidden, prev_tokens, logits_indices, smd, prompt_targets, *, cfg: ModelConfig,
               flags: SamplerFlags, prompt_k: int):
    """Logits, sampling and prompt logprobs from the last layer's hidden states (also the pipeline's tail)."""
    logits = compute_logits(params, hidden[logits_indices], cfg)
    tokens, lp, ranks, top_ids, top_lp = sample(logits, smd, flags)
    next_prev = jnp.zeros_like(prev_tokens).at[: tokens.shape[0]].set(tokens)
    prompt = None
    if prompt_k:
        all_lp = jax.nn.log_softmax(compute_logits(params, hidden, cfg), axis=-1)
        tgt = jnp.maximum(prompt_targets, 0)
        t_lp = jnp.take_along_axis(all_lp, tgt[:, None], axis=-1)[:, 0]
        t_rank = (all_lp > t_lp[:, None]).sum(-1).astype(jnp.int32) + 1
        p_lp, p_ids = jax.lax.top_k(all_lp, prompt_k)
        prompt = (t_lp, t_rank, p_ids.astype(jnp.int32), p_lp)
    return next_prev, (tokens, lp, ranks, top_ids, top_lp), prompt


def _compile_or_none(lowered):
    """Compiles; None when XLA's autotuner runs out of device memory (several compiles at once, KV cache
    already allocated): the caller compiles that variant again on its own."""
    try:
        return lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, mesh, *, num_blocks: int, block_size: int,
                 kv_cache_dtype: str = "auto", attn_config: AttentionConfig = AttentionConfig(),
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, max_model_len: int = 2048,
                 max_logprobs: int = 20):
        if attn_config.mesh is None:  # tp > 1: attention runs in shard_map over this mesh
            attn_config = dataclasses.replace(attn_config, mesh=mesh)
        self.cfg, self.params, self.mesh, self.attn = cfg, params, mesh, attn_config
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_logprobs = max_logprobs
        self.max_pages = -(-max_model_len // block_size)
        self.seq_buckets = pow2_buckets(min(8, max_num_seqs), max_num_seqs)
        self.token_buckets = pow2_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens)
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {list(KV_DTYPES)}.")
        self.kv_dtype = jnp.dtype(KV_DTYPES[kv_cache_dtype] or cfg.dtype)
        self.kv_caches = self._allocate_kv()
        self.prev_tokens = jnp.zeros((self.seq_buckets[-1],), jnp.int32)
        self._prev_rows: dict[str, int] = {}
        self.batch = InputBatch(2 * max_num_seqs, self.max_pages, PAD_PAGE)
        self._jit = jax.jit(_step_fn, static_argnames=("cfg", "attn", "flags", "prompt_k"), donate_argnums=(1,))
        self.pipeline = None
        if mesh_pp(mesh) > 1:  # stages on their own devices, one jit each (compiled on first use)
            from jaxllm.engine.pipeline import PipelineExecutor

            self.pipeline = PipelineExecutor(cfg, params, mesh, self.attn, block_size=block_size,
                                             max_pages=self.max_pages, token_buckets=self.token_buckets,
                                             seq_buckets=self.seq_buckets, pad_page=PAD_PAGE)
            self._sample_jit = jax.jit(_sample_fn, static_argnames=("cfg", "flags", "prompt_k"))
        self._compiled: dict[StepVariant, object] = {}
        self.warmed_up = False
        self.eager = False
        self.num_compiles_after_warmup = 0

    # ---- memory ----
    def _allocate_kv(self):
        # kv heads over tp (repeated when tp > K), each layer on its pipeline stage's devices.
        return make_kv_caches(self.cfg, self.mesh, self.num_blocks, self.block_size, self.kv_dtype)

    @staticmethod
    def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_cache_dtype: str = "auto", tp: int = 1,
                           pp: int = 1) -> int:
        """KV bytes one block costs on one device: its stage's layers and its share of the stored kv heads
        (kv heads are repeated when tp > K)."""
        from jaxllm.sharding import kv_heads_for, stage_layers

        dtype = jnp.dtype(KV_DTYPES.get(kv_cache_dtype) or cfg.dtype)
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

    def _executable(self, v: StepVariant, args):
        exe = self._compiled.get(v)
        if exe is None:
            t0 = time.perf_counter()
            exe = self._jit.lower(*args, cfg=self.cfg, attn=self.attn, flags=v.flags,
                                  prompt_k=v.prompt_logprobs).compile()
            self._compiled[v] = exe
            msg = "Compiled step %s in %.1f s"
            if self.warmed_up and not self.eager:
                default = v.flags == SamplerFlags() and not v.prompt_logprobs
                self.num_compiles_after_warmup += 1
                (logger.error if default else logger.warning)(msg + " after warm-up", v, time.perf_counter() - t0)
            else:
                logger.debug(msg, v, time.perf_counter() - t0)
        return exe

    def warm_up(self, enforce_eager: bool = False, workers: int | None = None) -> None:
        """Compiles every shape bucket now, so serving never stalls on the compiler (enforce_eager: skip).
        Tracing is sequential; XLA compiles in a thread pool (it releases the GIL), which divides the
        cold start by about the number of buckets compiled at once."""
        self.eager = enforce_eager
        if not enforce_eager:
            t0 = time.perf_counter()
            todo = [v for v in self.variants() if v not in self._compiled]
            lowered = [self._jit.lower(*self._dummy_args(v), cfg=self.cfg, attn=self.attn, flags=v.flags,
                                       prompt_k=v.prompt_logprobs) for v in todo]
            workers = max(1, min(workers or 8, len(todo), os.cpu_count() or 1))
            with ThreadPoolExecutor(workers) as pool:
                exes = list(pool.map(_compile_or_none, lowered))
            retried = 0
            for v, low, exe in zip(todo, lowered, exes):
                if exe is None:  # out of device memory for parallel autotuning: compile this one alone
                    exe, retried = low.compile(), retried + 1
                self._compiled[v] = exe
            if retried:
                logger.warning("%d step variants ran out of device memory compiling in parallel; compiled them "
                               "one at a time", retried)
            logger.info("Compiled %d step variants in %.1f s (%d threads)", len(self._compiled),
                        time.perf_counter() - t0, workers)
        self.warmed_up = True

    def _dummy_args(self, v: StepVariant):
        T, B = v.num_tokens, v.num_seqs
        z = lambda *shape, dt=np.int32: np.zeros(shape, dt)  # noqa: E731
        meta = AttentionMetadata(z(T), np.full(T, -1, np.int32), z(B), z(B + 1), z(B, self.max_pages),
                                 v.decode_only)
        smd = self._sampling_arrays([None] * B, v.flags)
        return (self.params, self.kv_caches, z(T), np.full(T, -1, np.int32), self.prev_tokens, meta, z(B), smd,
                np.full(T, -1, np.int32))

    # ---- one step ----
    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """The host half of a step: padded numpy inputs and the bucket, no device work (timed by
        bench/host_overhead.py)."""
        self.batch.release(sched.freed)
        seqs = [s.seq for s in sched.scheduled]
        rows = self.batch.rows(seqs)
        chunks, src, sample_rows, prompt_rows = [], [], {}, {}
        n_tok = 0
        for s in sched.scheduled:
            seq = s.seq
            chunks.append(SeqChunk(s.token_ids if not s.from_device else [0], s.start, seq.block_table))
            src.extend([self._prev_rows[seq.seq_id]] if s.from_device else [-1] * s.num_tokens)
            if s.sample:
                sample_rows[seq.seq_id] = len(chunks) - 1
            sp = seq.sampling_params
            if sp is not None and sp.prompt_logprobs is not None and s.start < seq.num_prompt_tokens:
                prompt_rows[seq.seq_id] = (n_tok, s.num_tokens)
            n_tok += s.num_tokens
        decode_only = all(s.num_tokens == 1 for s in sched.scheduled)
        if decode_only:
            B = T = bucket(len(chunks), self.seq_buckets)
        else:
            # Mixed steps: B follows T (B <= n_tok <= T), so there is one mixed variant per token bucket.
            T = bucket(max(n_tok, len(chunks)), self.token_buckets)
            B = bucket(min(T, self.seq_buckets[-1]), self.seq_buckets)
        inp = build_step_inputs(chunks, self.block_size, T, B, self.max_pages, PAD_PAGE, self.batch.tables[rows])
        src_rows = np.full(T, -1, np.int32)
        src_rows[:n_tok] = src
        flags = self._flags(seqs)
        prompt_k = self.max_logprobs if prompt_rows else 0
        prompt_targets = np.full(T, -1, np.int32)
        for s in sched.scheduled:
            if s.seq.seq_id in prompt_rows:  # token j's target: the prompt token after it, if any
                lo, n = prompt_rows[s.seq.seq_id]
                targets = s.seq.prompt_token_ids[s.start + 1 : s.start + n + 1]
                prompt_targets[lo : lo + len(targets)] = targets
        sampled = [s.seq if s.sample else None for s in sched.scheduled]
        smd = self._sampling_arrays(sampled + [None] * (B - len(chunks)), flags, rows)
        meta = AttentionMetadata(inp.positions, inp.slot_mapping, inp.seq_lens, inp.query_start_loc,
                                 inp.block_tables, decode_only)
        widths = tuple(a.shape[1] for a in (smd.penalty_tokens, smd.penalty_is_output, smd.bias_ids,
                                            smd.bias_values, smd.allowed_ids))
        v = StepVariant(T, B, decode_only, flags, prompt_k, widths)
        host_args = (inp.token_ids, src_rows, meta, inp.logits_indices, smd, prompt_targets)
        return PreparedStep(v, host_args, sample_rows, prompt_rows, flags.num_logprobs)

    def execute(self, sched: SchedulerOutput) -> StepHandle:
        p = self.prepare(sched)
        token_ids, src_rows, meta, logits_indices, smd, prompt_targets = p.host_args
        if self.pipeline is not None:
            self.kv_caches, hidden = self.pipeline.forward(self.kv_caches, token_ids, src_rows, meta, self.prev_tokens)
            self.prev_tokens, outputs, prompt = self._sample_jit(
                self.pipeline.head_params, hidden, self.prev_tokens, logits_indices, smd, prompt_targets,
                cfg=self.cfg, flags=p.variant.flags, prompt_k=p.variant.prompt_logprobs)
        else:
            args = (self.params, self.kv_caches, token_ids, src_rows, self.prev_tokens, meta, logits_indices, smd,
                    prompt_targets)
            exe = self._executable(p.variant, args)
            self.kv_caches, self.prev_tokens, outputs, prompt = exe(*args)
        self._prev_rows = dict(p.sample_rows)
        return StepHandle(sched, p.sample_rows, (outputs, prompt), p.prompt_rows, p.num_logprobs)

    def collect(self, handle: StepHandle) -> StepResult:
        outputs, prompt = jax.device_get(handle.outputs)
        return StepResult(*outputs, prompt)

    # ---- sampling inputs ----
    def _flags(self, seqs) -> SamplerFlags:
        filtering = penalties = bias = False
        k = 0
        for seq in seqs:
            sp = seq.sampling_params
            if sp is None:
                continue
            filtering |= sp.top_p < 1.0 or sp.top_k > 0
            penalties |= sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1
            bias |= bool(getattr(seq, "bias_row", None) or sp.allowed_token_ids)
            if sp.logprobs is not None:
                k = self.max_logprobs
        return SamplerFlags(filtering, penalties, bias, k)

    def _sampling_arrays(self, seqs, flags: SamplerFlags, rows: np.ndarray | None = None) -> SamplingMetadata:
        """seqs: [B], None where nothing is sampled; rows: InputBatch rows of the first len(rows) entries,
        whose per-request settings are gathered from there (None: all padding)."""
        B = len(seqs)
        sps = [None if seq is None else seq.sampling_params for seq in seqs]
        live = [i for i, sp in enumerate(sps) if sp is not None]
        table = np.tile(np.asarray(PADDING_ROW, np.float32), (B, 1))
        seeds = np.zeros(B, np.uint32)
        steps = np.zeros(B, np.int32)
        if live:
            live_rows = rows[live]
            table[live] = self.batch.sampling[live_rows]
            seeds[live] = self.batch.seeds[live_rows]
            steps[live] = [seqs[i].num_output_tokens + seqs[i].num_pending - 1 for i in live]
        temp, top_p, top_k, min_p, pres, freq, rep = table.T
        top_k = top_k.astype(np.int32)
        empty = [[]] * B
        pen_rows, pen_out, bias_ids, bias_vals, allowed = empty, empty, empty, empty, empty
        if flags.penalties:
            pen_rows, pen_out = [[] for _ in range(B)], [[] for _ in range(B)]
            for i in live:
                seq = seqs[i]
                pen_rows[i] = seq.all_token_ids
                pen_out[i] = [False] * seq.num_prompt_tokens + [True] * seq.num_output_tokens
        if flags.bias:  # otherwise every bias row and allowed list is empty (see _flags)
            bias_ids, bias_vals, allowed = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
            for i in live:
                row = getattr(seqs[i], "bias_row", None) or {}
                bias_ids[i], bias_vals[i] = list(row.keys()), list(row.values())
                allowed[i] = list(sps[i].allowed_token_ids or [])

        def rows(r, fill, dtype):
            return np.full((B, 1), fill, dtype) if r is empty else pad_rows(r, 1, fill, dtype)

        return SamplingMetadata(
            temp, top_p, top_k, min_p, pres, freq, rep, seeds, steps,
            rows(pen_rows, -1, np.int32), rows(pen_out, False, bool), rows(bias_ids, -1, np.int32),
            rows(bias_vals, 0.0, np.float32), rows(allowed, -1, np.int32))
