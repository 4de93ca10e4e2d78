"""Tensor parallelism on 8 simulated CPU devices: logits equal tp=1, XLA partitions the weights the way the
rules table says (one all-reduce per row-parallel matmul, no weight all-gather), every device holds only
its shard, and impossible splits raise clear errors."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ModelConfig
from jaxllm.models.attention import AttentionConfig, AttentionMetadata
from jaxllm.models.decoder import compute_logits, forward
from jaxllm.models.loader import load_params
from jaxllm.models.params import param_specs
from jaxllm.sharding import ParallelConfig, kv_heads_for, logical_to_spec, make_kv_caches, stage_layers
from tests.model_harness import ragged_logits
from tests.tiny_models import make_hf_model, save_checkpoint

SEQS = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [101, 7], [8] * 11, [3]]
CACHED = [9, 1, 4, 0]


@pytest.fixture(scope="module", params=["llama", "baichuan13b"])  # GQA K=2 (tp=4 replicates kv) / MHA ALiBi
def ckpt(request, tmp_path_factory):
    arch = request.param
    d = save_checkpoint(make_hf_model(arch), arch, str(tmp_path_factory.mktemp(arch)))
    return d, ModelConfig.from_hf(d, dtype="float32")


def tp_logits(model_dir, cfg, tp):
    mesh = ParallelConfig(tp, 1).make_mesh()
    params = load_params(model_dir, cfg, mesh)
    # The harness allocates the cache from cfg's kv heads: give it the stored (repeated) count.
    stored = dataclasses.replace(cfg, num_kv_heads=kv_heads_for(cfg.num_kv_heads, tp))
    return params, ragged_logits(params, stored, SEQS, CACHED, attn=AttentionConfig(mesh=mesh))


def test_tp_logits_equal_tp1(ckpt):
    model_dir, cfg = ckpt
    _, ref = tp_logits(model_dir, cfg, 1)
    for tp in (2, 4):
        params, out = tp_logits(model_dir, cfg, tp)
        for o, r in zip(out, ref):
            np.testing.assert_allclose(o, r, rtol=0, atol=2e-5 * np.abs(r).max())
        # Each device holds exactly its shard (loading never placed a full copy on one device).
        layer = params["layers"][0]
        K = kv_heads_for(cfg.num_kv_heads, tp)
        expect = {
            "w_qkv": (64, K // tp, cfg.num_heads // K + 2, 16),
            "wo": (cfg.num_heads // tp, 16, 64),
            "w_gate_up": (64, 2, 96 // tp),
            "w_down": (96 // tp, 64),
            "attn_norm": (64,),
        }
        for name, shape in expect.items():
            shards = layer[name].addressable_shards
            assert len(shards) == tp and {s.data.shape for s in shards} == {shape}, name
        assert {s.data.shape for s in params["embed"].addressable_shards} == {(128 // tp, 64)}
        assert {s.data.shape for s in params["lm_head"].addressable_shards} == {(128 // tp, 64)}


def test_kv_replicated_when_tp_exceeds_kv_heads(ckpt):
    model_dir, cfg = ckpt
    if cfg.num_kv_heads != 2:
        pytest.skip("GQA model only")
    params = load_params(model_dir, cfg, ParallelConfig(4, 1).make_mesh())
    # [D, K'=4, 1 + 2, H]: stored kv head 2k + j holds q head 2k + j and copies of kv head k's k and v.
    w = np.asarray(params["layers"][1]["w_qkv"])
    ref = np.asarray(load_params(model_dir, cfg, ParallelConfig().make_mesh())["layers"][1]["w_qkv"])
    assert w.shape == (64, 4, 3, 16) and ref.shape == (64, 2, 4, 16)
    np.testing.assert_array_equal(w[:, :, 0], ref[:, :, :2].reshape(64, 4, 16))
    np.testing.assert_array_equal(w[:, :, 1:], np.repeat(ref[:, :, 2:], 2, axis=1))
    caches = make_kv_caches(cfg, ParallelConfig(4, 1).make_mesh(), num_pages=8, page_size=4)
    k_pages, v_pages = caches[0]
    assert k_pages.shape == (4, 8, 4, 16) and k_pages is not v_pages
    assert {s.data.shape for s in k_pages.addressable_shards} == {(1, 8, 4, 16)}


def test_xla_partitions_as_declared():
    """tp=2: one all-reduce for the vocab-parallel embedding gather and one per row-parallel matmul (o,
    down) per layer; weights are never all-gathered; logits stay vocab-sharded."""
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        dtype="float32",
    )
    mesh = ParallelConfig(2, 1).make_mesh()
    params = load_params("", cfg, mesh, load_format="dummy")
    kv = make_kv_caches(cfg, mesh, 16, 4)
    T, B = 8, 2
    z = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    meta = AttentionMetadata(z(T), z(T), z(B), z(B + 1), z(B, 4), False)
    attn = AttentionConfig(mesh=mesh)

    def step(params, kv, tok, meta):
        kv, h = forward(params, kv, tok, meta, cfg, attn)
        return kv, compute_logits(params, h, cfg)

    compiled = jax.jit(step, donate_argnums=1).lower(params, kv, z(T), meta).compile()
    hlo = compiled.as_text()

    def ops(name):
        return [line for line in hlo.splitlines() if re.search(rf"= \S+ {name}(-start)?\(", line)]

    reduces = ops("all-reduce")
    assert len(reduces) == 1 + 2 * cfg.num_layers
    assert all(f"f32[{T},64]" in line for line in reduces)
    assert not ops("all-gather") and not ops("all-to-all")
    assert compiled.output_shardings[1].spec == jax.sharding.PartitionSpec(None, "tp")


def test_rules_collision_raises():
    with pytest.raises(ValueError, match="same mesh axis"):
        logical_to_spec(("heads", "ffn"))
    with pytest.raises(ValueError, match="Unknown logical axis"):
        logical_to_spec(("nope",))


def _cfg(**kw):
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return ModelConfig.from_hf(base | kw, dtype="float32")


@pytest.mark.parametrize(
    "tp, pp, kw, match",
    [
        (3, 1, {"num_attention_heads": 6, "num_key_value_heads": 6}, "vocab_size \\(128\\)"),
        (4, 1, {"intermediate_size": 90}, "intermediate_size \\(90\\)"),
        (8, 1, {}, "num_attention_heads \\(4\\) must be divisible by tensor_parallel_size \\(8\\)"),
        (4, 1, {"num_attention_heads": 12, "num_key_value_heads": 3}, "num_key_value_heads \\(3\\)"),
        (2, 4, {}, "pipeline_parallel_size \\(4\\) exceeds"),
        (1, 1, {"vocab_size": 127}, None),
        (2, 1, {"vocab_size": 127}, "vocab_size \\(127\\)"),
    ],
)
def test_parallel_config_errors(tp, pp, kw, match):
    cfg = _cfg(**kw)
    if match is None:
        ParallelConfig(tp, pp).validate(cfg)
        return
    with pytest.raises(ValueError, match=match):
        ParallelConfig(tp, pp).validate(cfg)


def test_mesh_errors_and_layout():
    with pytest.raises(ValueError, match="4 \\* 4 = 16 exceeds the 8 available devices"):
        ParallelConfig(4, 4).make_mesh()
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer"):
        ParallelConfig(0, 1)
    with pytest.raises(ValueError, match="not a multiple"):
        param_specs(_cfg(num_attention_heads=6, num_key_value_heads=2, intermediate_size=96), tp=3)
    mesh = ParallelConfig(2, 2).make_mesh()
    assert mesh.axis_names == ("pp", "tp") and mesh.devices.shape == (2, 2)
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    # pp=2: each layer's weights and pages live on its stage's row of the mesh only.
    cfg = _cfg()
    params = load_params("", cfg, mesh, load_format="dummy")
    rows = [set(mesh.devices[s]) for s in range(2)]
    assert set(params["embed"].devices()) == rows[0] and set(params["lm_head"].devices()) == rows[1]
    assert set(params["layers"][0]["w_qkv"].devices()) == rows[0]
    assert set(params["layers"][1]["w_qkv"].devices()) == rows[1]
    caches = make_kv_caches(cfg, mesh, 8, 4)
    assert set(caches[1][0].devices()) == rows[1]
