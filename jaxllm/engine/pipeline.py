"""Pipeline parallelism at the model-executor level.

The decoder's layers are split into pp contiguous stages (jaxllm/sharding.py: stage_layers). Stage s owns
row s of the ("pp", "tp") mesh: its layers' weights and KV pages live there (the loader already places them,
see params.param_shardings), and it runs one jitted function over that (1, tp) sub-mesh (tensor parallel
inside the stage as usual). Hidden states [T, D] move between rows with jax.device_put.

A step's sequences are split into micro-batches (pp of them by default), each its own padded ragged batch.
Everything is dispatched asynchronously in micro-batch order; a stage only waits for its own input, so
while stage s+1 runs micro-batch m, stage s already runs m+1 (GPipe schedule, bubble (pp-1)/(M+pp-1)):

    stage 0:  m0 m1 m2 m3
    stage 1:     m0 m1 m2 m3

The executor returns the last stage's hidden states in the flat layout of the whole step, so the runner's
logits/sampling code is the same with and without pipelining.

    PipelineExecutor.forward(kv_caches, token_ids, src_rows, meta, prev_tokens) -> (kv_caches, hidden [T, D])
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.config import ModelConfig
from jaxllm.engine.inputs import SeqChunk, bucket, build_step_inputs
from jaxllm.models.attention import AttentionConfig, AttentionMetadata
from jaxllm.models.decoder import forward
from jaxllm.sharding import mesh_pp, stage_layers, stage_mesh


def _stage_fn(params, kv, x, src_rows, prev_tokens, meta, *, cfg: ModelConfig, attn: AttentionConfig, layers: range):
    """One stage over one micro-batch. Stage 0 gets token ids (and swaps in tokens still on the device),
    the others the previous stage's hidden states."""
    lo, hi, L = layers.start, layers.stop, cfg.num_layers
    hidden = None
    if src_rows is not None:
        x = jnp.where(src_rows >= 0, prev_tokens[jnp.maximum(src_rows, 0)], x)
    else:
        hidden, x = x, None
    # forward() indexes layers globally: pad the stage's lists with None (an empty pytree) to L entries.
    full = {"layers": [None] * lo + list(params["layers"]) + [None] * (L - hi), "embed": params.get("embed")}
    kv_full = [None] * lo + list(kv) + [None] * (L - hi)
    kv_full, h = forward(full, kv_full, x, meta, cfg, attn, layers=layers, hidden=hidden)
    return kv_full[lo:hi], h


@jax.jit
def _gather_rows(hiddens, index):
    return jnp.concatenate(hiddens, axis=0)[index]


def unflatten_step(token_ids, src_rows, meta: AttentionMetadata) -> tuple[list[SeqChunk], np.ndarray]:
    """The real sequences of a flat padded step (inverse of build_step_inputs), and src_rows of their
    tokens. Block tables keep their padded width, which build_step_inputs accepts again."""
    qsl = np.asarray(meta.query_start_loc)
    seq_lens, tables = np.asarray(meta.seq_lens), np.asarray(meta.block_tables)
    chunks = []
    for b in range(len(seq_lens)):
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        if hi > lo:
            chunks.append(SeqChunk(token_ids[lo:hi].tolist(), int(seq_lens[b]) - (hi - lo), tables[b].tolist()))
    return chunks, np.asarray(src_rows)[: int(qsl[-1])]


def split_chunks(chunks: list[SeqChunk], n: int) -> list[list[SeqChunk]]:
    """Up to n contiguous groups of sequences with about equal token counts (never an empty group)."""
    n = max(1, min(n, len(chunks)))
    total = sum(len(c.token_ids) for c in chunks)
    groups, cur, acc = [], [], 0
    for i, c in enumerate(chunks):
        cur.append(c)
        acc += len(c.token_ids)
        left_groups = n - len(groups) - 1
        left_chunks = len(chunks) - i - 1
        if left_groups and (acc >= total * (len(groups) + 1) / n or left_chunks == left_groups):
            groups.append(cur)
            cur = []
    groups.append(cur) if cur else None
    return groups


class PipelineExecutor:
    def __init__(
        self,
        cfg: ModelConfig,
        params,
        mesh,
        attn: AttentionConfig,
        *,
        block_size: int,
        max_pages: int,
        token_buckets: tuple[int, ...],
        seq_buckets: tuple[int, ...],
        pad_page: int = 0,
        num_microbatches: int | None = None,
        move=jax.device_put,
    ):
        self.cfg, self.pp = cfg, mesh_pp(mesh)
        # jax.device_put(x, sharding) between the stages' devices (MultiHost.move when they are other processes')
        self.move = move
        self.block_size, self.max_pages, self.pad_page = block_size, max_pages, pad_page
        self.token_buckets, self.seq_buckets = token_buckets, seq_buckets
        self.num_microbatches = num_microbatches or self.pp
        self.stages = stage_layers(cfg.num_layers, self.pp)
        self.meshes = [stage_mesh(mesh, s) for s in range(self.pp)]
        self.replicated = [NamedSharding(m, PartitionSpec()) for m in self.meshes]
        self.stage_params = []
        for s, r in enumerate(self.stages):
            p = {"layers": [params["layers"][i] for i in r]}
            if s == 0:
                p["embed"] = params["embed"]
            self.stage_params.append(p)
        # What the last stage needs for logits. Tied embeddings: a copy of the (vocab-sharded) table there.
        last = self.pp - 1
        self.head_params = {"final_norm": params["final_norm"]}
        if cfg.tie_word_embeddings:
            emb = params["embed"]
            self.head_params["embed"] = move(emb, NamedSharding(self.meshes[last], emb.sharding.spec))
        else:
            self.head_params["lm_head"] = params["lm_head"]
        self._fns = [
            jax.jit(functools.partial(_stage_fn, cfg=cfg, attn=_with_mesh(attn, m), layers=r), donate_argnums=(1,))
            for m, r in zip(self.meshes, self.stages, strict=True)
        ]

    def forward(self, kv_caches, token_ids: np.ndarray, src_rows: np.ndarray, meta: AttentionMetadata, prev_tokens):
        """All layers over one step's flat padded batch (host arrays, as build_step_inputs makes them), in
        micro-batches. src_rows [T]: row of prev_tokens (a last-stage device array) that feeds each token,
        -1 for host tokens. Returns the per-layer KV caches and hidden [T, D] on the last stage, in the
        step's flat layout (padding rows hold some real row's values)."""
        chunks, src_of = unflatten_step(token_ids, src_rows, meta)
        T = token_ids.shape[0]
        stage_kv = [list(kv_caches[r.start : r.stop]) for r in self.stages]
        prev0 = self.move(prev_tokens, self.replicated[0])
        outs, index = [], np.zeros(T, np.int32)
        offset = tok = 0
        for group in split_chunks(chunks, self.num_microbatches):
            mb, n = self._micro_batch(group)
            src = np.full(mb.token_ids.shape[0], -1, np.int32)
            src[:n] = src_of[tok : tok + n]
            mb_meta = AttentionMetadata(
                mb.positions, mb.slot_mapping, mb.seq_lens, mb.query_start_loc, mb.block_tables, mb.decode_only
            )
            outs.append(self._run_stages(stage_kv, mb.token_ids, src, prev0, mb_meta))
            index[tok : tok + n] = offset + np.arange(n)
            offset += mb.token_ids.shape[0]
            tok += n
        hidden = _gather_rows(outs, self.move(index, self.replicated[-1]))
        return [kv for stage in stage_kv for kv in stage], hidden

    def _run_stages(self, stage_kv, token_ids, src_rows, prev0, meta):
        """One micro-batch through every stage (stage_kv updated in place); its hidden states on the last."""
        x = token_ids
        for s, fn in enumerate(self._fns):
            if s == 0:
                stage_kv[0], x = fn(self.stage_params[0], stage_kv[0], x, src_rows, prev0, meta)
            else:
                x = self.move(x, self.replicated[s])
                stage_kv[s], x = fn(self.stage_params[s], stage_kv[s], x, None, None, meta)
        return x

    def _micro_batch(self, group: list[SeqChunk]):
        """A group's padded inputs, in one of the runner's step shapes (decode: B = T = the sequence bucket;
        otherwise T = the token bucket and B = the sequence bucket of min(T, max sequences)), so warm_up
        can compile every stage for every shape a step can use."""
        n = sum(len(c.token_ids) for c in group)
        decode_only = all(len(c.token_ids) == 1 for c in group)
        if decode_only:
            T = B = bucket(len(group), self.seq_buckets)
        else:
            T = bucket(n, self.token_buckets)
            B = bucket(min(T, self.seq_buckets[-1]), self.seq_buckets)
        return build_step_inputs(group, self.block_size, T, B, self.max_pages, self.pad_page), n

    def warm_up(self, kv_caches, prev_tokens, shapes):
        """Runs every stage once per micro-batch shape (T, B, decode_only) on inputs that write no KV slot and
        attend to nothing, so the stage jits (and the row gather of a step that is one micro-batch) compile
        before serving. Returns the KV caches (donated and given back) and {T: hidden} as forward() makes it
        (for warming the sampling head)."""
        stage_kv = [list(kv_caches[r.start : r.stop]) for r in self.stages]
        prev0 = self.move(prev_tokens, self.replicated[0])
        hiddens = {}
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        for T, B, decode_only in shapes:
            meta = AttentionMetadata(
                z(T),
                np.full(T, -1, np.int32),
                z(B),
                z(B + 1),
                np.full((B, self.max_pages), self.pad_page, np.int32),
                decode_only,
            )
            x = self._run_stages(stage_kv, z(T), np.full(T, -1, np.int32), prev0, meta)
            hiddens[T] = _gather_rows([x], self.move(np.arange(T, dtype=np.int32), self.replicated[-1]))
        return [kv for stage in stage_kv for kv in stage], hiddens


def _with_mesh(attn: AttentionConfig, mesh) -> AttentionConfig:
    import dataclasses

    return dataclasses.replace(attn, mesh=mesh)
