"""Pipeline parallelism on 8 simulated CPU devices: pp=2 and tp=2 x pp=2 logits equal tp=1, with the step's
sequences split into micro-batches that run on the stages' own devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ModelConfig
from jaxllm.engine.inputs import SeqChunk, build_step_inputs
from jaxllm.engine.pipeline import PipelineExecutor, split_chunks
from jaxllm.models.attention import AttentionConfig, AttentionMetadata
from jaxllm.models.decoder import compute_logits
from jaxllm.models.loader import load_params
from jaxllm.sharding import ParallelConfig, make_kv_caches
from tests.model_harness import ragged_logits
from tests.tiny_models import make_hf_model, save_checkpoint

SEQS = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [101, 7], [8] * 11, [3]]
CACHED = [9, 1, 4, 0]
S, PAGES = 4, 64


_CKPTS = {}


def ckpt(arch, tmp_path_factory):
    if arch in _CKPTS:
        return _CKPTS[arch]
    d = save_checkpoint(make_hf_model(arch), arch, str(tmp_path_factory.mktemp(arch)))
    cfg = ModelConfig.from_hf(d, dtype="float32")
    params = load_params(d, cfg, ParallelConfig().make_mesh())
    _CKPTS[arch] = d, cfg, ragged_logits(params, cfg, SEQS, CACHED, block_size=S, num_pages=PAGES)
    return _CKPTS[arch]


def pipeline_logits(model_dir, cfg, tp, pp, microbatches=None):
    mesh = ParallelConfig(tp, pp).make_mesh()
    params = load_params(model_dir, cfg, mesh)
    ex = PipelineExecutor(
        cfg,
        params,
        mesh,
        AttentionConfig(),
        block_size=S,
        max_pages=8,
        token_buckets=(8, 16, 32),
        seq_buckets=(2, 4, 8),
        num_microbatches=microbatches,
    )
    kv = make_kv_caches(cfg, mesh, PAGES, S, fill=np.nan)
    rng = np.random.default_rng(0)
    pages = list(rng.permutation(np.arange(1, PAGES)))
    tables = [[int(pages.pop()) for _ in range(-(-len(s) // S))] for s in SEQS]
    prev = jnp.zeros(8, jnp.int32)
    for step in range(2):
        chunks = []
        for s, c, t in zip(SEQS, CACHED, tables):
            lo, hi = (0, c) if step == 0 else (c, len(s))
            if hi > lo:
                chunks.append(SeqChunk(list(s[lo:hi]), lo, t))
        n = sum(len(c.token_ids) for c in chunks)
        inp = build_step_inputs(chunks, S, n + 3, len(chunks) + 2, 8)
        meta = AttentionMetadata(
            inp.positions, inp.slot_mapping, inp.seq_lens, inp.query_start_loc, inp.block_tables, inp.decode_only
        )
        kv, hidden = ex.forward(kv, inp.token_ids, np.full(n + 3, -1, np.int32), meta, prev)
    assert set(hidden.devices()) == set(mesh.devices[-1])
    logits = np.asarray(jax.jit(compute_logits, static_argnums=2)(ex.head_params, hidden, cfg))
    out, lo = [], 0
    for s, c in zip(SEQS, CACHED):
        out.append(logits[lo : lo + len(s) - c])
        lo += len(s) - c
    return out


# qwen2: tied embeddings (a copy of the table on the last stage) and q/k/v biases.
@pytest.mark.parametrize("arch, tp, pp, mb", [("llama", 1, 2, None), ("llama", 2, 2, 3), ("qwen2", 2, 2, None)])
def test_pipeline_logits_equal_tp1(tmp_path_factory, arch, tp, pp, mb):
    model_dir, cfg, ref = ckpt(arch, tmp_path_factory)
    out = pipeline_logits(model_dir, cfg, tp, pp, mb)
    for o, r in zip(out, ref):
        np.testing.assert_allclose(o, r, rtol=0, atol=2e-5 * np.abs(r).max())


def test_split_chunks():
    mk = lambda n: SeqChunk([0] * n, 0, [])  # noqa: E731
    sizes = lambda groups: [[len(c.token_ids) for c in g] for g in groups]  # noqa: E731
    assert sizes(split_chunks([mk(1)] * 4, 2)) == [[1, 1], [1, 1]]
    assert sizes(split_chunks([mk(10), mk(1), mk(1), mk(1)], 2)) == [[10], [1, 1, 1]]
    assert sizes(split_chunks([mk(1)], 4)) == [[1]]
    assert sizes(split_chunks([mk(1), mk(1), mk(9)], 3)) == [[1], [1], [9]]
