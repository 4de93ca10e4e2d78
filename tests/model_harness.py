"""Runs jaxllm's decoder over a padded ragged batch with a shuffled, NaN-filled paged KV cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.inputs import SeqChunk, build_step_inputs
from jaxllm.models.attention import AttentionConfig, AttentionMetadata
from jaxllm.models.decoder import compute_logits, forward


@functools.partial(jax.jit, static_argnames=("cfg", "attn"))
def _step(params, kv_caches, token_ids, meta, cfg, attn):
    kv_caches, hidden = forward(params, kv_caches, token_ids, meta, cfg, attn)
    return kv_caches, compute_logits(params, hidden, cfg)


def ragged_logits(
    params,
    cfg,
    seqs,
    cached,
    block_size=4,
    num_pages=64,
    attn=AttentionConfig(),
    seed=0,
    pad_tokens=5,
    pad_seqs=2,
    prefix_attn=None,
):
    """Logits [len(seq) - cached, V] per sequence: a first step writes each sequence's first cached[i]
    tokens, a second step computes the rest over the cache (prefix-cache hits / chunked prefill). prefix_attn: the
    first step's attention config, where it is not attn's (a test of the second step alone)."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(cfg.dtype)
    K, H = cfg.num_kv_heads, cfg.head_dim
    kv = [(jnp.full((K, num_pages, block_size, H), jnp.nan, dtype),) * 2 for _ in range(cfg.num_layers)]
    pages = list(rng.permutation(np.arange(1, num_pages)))
    tables = []
    for s in seqs:
        n = -(-len(s) // block_size)
        tables.append([int(pages.pop()) for _ in range(n)])
    max_pages = max(len(t) for t in tables)
    out = None
    for step in range(2):
        chunks = []
        for s, c, t in zip(seqs, cached, tables):
            lo, hi = (0, c) if step == 0 else (c, len(s))
            if hi > lo:
                chunks.append(SeqChunk(list(s[lo:hi]), lo, t))
        if not chunks:
            continue
        n_tok = sum(len(c.token_ids) for c in chunks)
        inp = build_step_inputs(chunks, block_size, n_tok + pad_tokens, len(chunks) + pad_seqs, max_pages + 1)
        meta = AttentionMetadata(
            jnp.asarray(inp.positions),
            jnp.asarray(inp.slot_mapping),
            jnp.asarray(inp.seq_lens),
            jnp.asarray(inp.query_start_loc),
            jnp.asarray(inp.block_tables),
            inp.decode_only,
        )
        step_attn = attn if step == 1 or prefix_attn is None else prefix_attn
        kv, logits = _step(params, kv, jnp.asarray(inp.token_ids), meta, cfg, step_attn)
        out = (np.asarray(logits), inp)
    logits, inp = out
    assert np.isfinite(logits[: inp.num_tokens]).all()
    qsl = inp.query_start_loc  # step 2 holds every sequence, in order
    return [logits[qsl[b] : qsl[b + 1]] for b in range(len(seqs))]


def spy_add_rms_norm(monkeypatch) -> list:
    """The shapes of x each add_rms_norm kernel call (traced) is given."""
    from kernels_pallas import _add_rms_norm

    calls: list = []
    real = _add_rms_norm.add_rms_norm_kernel
    monkeypatch.setattr(
        _add_rms_norm, "add_rms_norm_kernel", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k)
    )
    return calls


def one_row_decode_logits(params, cfg, mesh, monkeypatch):
    """A decode-only step of one sequence and no padding row (the int models' batch-1 bucket, after a 4-token prefix
    step on the reference backend), run on the "pallas" backend (interpret mode) and on the reference backend: (the
    shapes of the qkv the fused decode attention kernel was given on the pallas run, its logits, the reference's
    logits). The prefix step stays on the reference backend both times: the Mosaic GPU interpreter's 4-row prefix
    step doubled the nk test's time, and multi-row steps through the kernels have tests of their own."""
    import kernels_pallas as kp

    seqs, cached = [[5, 9, 2, 77, 3]], [4]
    seen = []
    real = kp.fused_decode_attention
    monkeypatch.setattr(kp, "fused_decode_attention", lambda qkv, *a, **k: seen.append(qkv.shape) or real(qkv, *a, **k))
    jax.clear_caches()  # an earlier trace at these shapes would skip the spy

    def logits(backend):
        attn = AttentionConfig(backend=backend, interpret=backend == "pallas", mesh=mesh)
        prefix = AttentionConfig(backend="reference", mesh=mesh)
        out = ragged_logits(
            params, cfg, seqs, cached, block_size=4, attn=attn, pad_tokens=0, pad_seqs=0, prefix_attn=prefix
        )
        return [np.asarray(x, np.float32) for x in out]

    got = logits("pallas")
    return seen, got, logits("reference")
