"""Mixture-of-experts layers (jaxllm/models/moe.py): the grouped matmul against the all-experts einsum, expert
parallelism and tensor parallelism against tp=1 on simulated devices, their collectives, and config errors."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ModelConfig, MoeConfig
from jaxllm.models.attention import AttentionConfig, AttentionMetadata
from jaxllm.models.decoder import compute_logits, forward
from jaxllm.models.loader import load_params
from jaxllm.models.moe import expert_mlp, expert_mlp_dense, expert_mlp_gathered, route
from jaxllm.sharding import ParallelConfig, kv_heads_for, make_kv_caches
from tests.model_harness import ragged_logits
from tests.tiny_models import hf_config, make_hf_model, save_checkpoint

SEQS = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [101, 7], [8] * 11, [3]]
CACHED = [9, 1, 4, 0]


@pytest.mark.parametrize("T, E, k, norm", [(1, 4, 1, False), (37, 8, 2, True), (64, 16, 4, False), (5, 3, 3, True)])
def test_grouped_matmul_matches_dense_einsum(T, E, k, norm):
    """ragged_dot over the pairs sorted by expert == every token through every expert weighted by its routing
    (0 where not routed); and the experts split into rank slices (expert parallelism) sum to the same."""
    rng = np.random.default_rng(T + E)
    D, F = 32, 24
    h = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((D, E)), jnp.float32)
    w_gate_up = jnp.asarray(rng.standard_normal((E, D, 2, F)) / np.sqrt(D), jnp.float32)
    w_down = jnp.asarray(rng.standard_normal((E, F, D)) / np.sqrt(F), jnp.float32)
    weights, ids = route(h, router, MoeConfig(num_experts=E, top_k=k, intermediate_size=F, norm_topk_prob=norm))
    assert ids.shape == (T, k) and bool((ids >= 0).all() & (ids < E).all())
    if norm:
        np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
    want = np.asarray(expert_mlp_dense(h, weights, ids, w_gate_up, w_down))
    got = np.asarray(jax.jit(expert_mlp)(h, weights, ids, w_gate_up, w_down))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    got = np.asarray(jax.jit(expert_mlp_gathered)(h, weights, ids, w_gate_up, w_down))  # the few-pairs path
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if E % 2 == 0:  # two "ranks" of E / 2 experts each: each runs only its pairs; their sum is the whole
        half = E // 2
        for fn in (expert_mlp, expert_mlp_gathered):
            parts = [
                fn(
                    h,
                    weights,
                    ids,
                    w_gate_up[r * half : (r + 1) * half],
                    w_down[r * half : (r + 1) * half],
                    first_expert=r * half,
                )
                for r in range(2)
            ]
            np.testing.assert_allclose(np.asarray(parts[0] + parts[1]), want, rtol=1e-5, atol=1e-5)
        if len(set((np.asarray(ids) // half).ravel().tolist())) == 2:  # both ranks have pairs: one alone is not all
            assert not np.allclose(np.asarray(parts[0]), want, atol=1e-3)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    d = save_checkpoint(make_hf_model("qwen2_moe"), "qwen2_moe", str(tmp_path_factory.mktemp("qwen2_moe")))
    return d, ModelConfig.from_hf(d, dtype="float32")


def _logits(model_dir, cfg, tp):
    mesh = ParallelConfig(tp, 1).make_mesh()
    params = load_params(model_dir, cfg, mesh)
    # The harness allocates the cache from cfg's kv heads: give it the stored (repeated) count.
    stored = dataclasses.replace(cfg, num_kv_heads=kv_heads_for(cfg.num_kv_heads, tp))
    return params, ragged_logits(params, stored, SEQS, CACHED, attn=AttentionConfig(mesh=mesh))


def test_tensor_and_expert_parallel_logits_equal_tp1(qwen2_moe):
    """Qwen2-MoE (routed experts, a shared expert, a dense layer) at tp 2 and 4 with and without expert
    parallelism: the logits of tp=1, each device holding only its experts (EP) or its ffn slices."""
    model_dir, cfg = qwen2_moe
    _, ref = _logits(model_dir, cfg, 1)
    for tp in (2, 4):
        for ep in (False, True):
            params, out = _logits(model_dir, dataclasses.replace(cfg, expert_parallel=ep), tp)
            for o, r in zip(out, ref, strict=True):
                np.testing.assert_allclose(o, r, rtol=0, atol=2e-5 * np.abs(r).max())
            layer = params["layers"][0]
            E, D, F = 4, 64, 32
            shapes = {
                "w_experts_gate_up": (E // tp, D, 2, F) if ep else (E, D, 2, F // tp),
                "w_experts_down": (E // tp, F, D) if ep else (E, F // tp, D),
                "router": (D, E),
                "w_shared_gate_up": (D, 2, 48 // tp),
                "w_shared_down": (48 // tp, D),
            }
            for name, shape in shapes.items():
                assert {s.data.shape for s in layer[name].addressable_shards} == {shape}, (tp, ep, name)
            assert {s.data.shape for s in params["layers"][1]["w_gate_up"].addressable_shards} == {(D, 2, 96 // tp)}


def test_few_pairs_path_through_the_model(qwen2_moe, monkeypatch):
    """With GATHERED_MAX_PAIRS above every step's pair count, the model (tp=2, expert parallel) gives the same
    logits through expert_mlp_gathered."""
    from jaxllm.models import decoder, moe
    from tests import model_harness

    model_dir, cfg = qwen2_moe
    _, ref = _logits(model_dir, cfg, 1)
    monkeypatch.setattr(moe, "GATHERED_MAX_PAIRS", 10**6)
    decoder._traced_once.cache_clear()  # traces read the switch: drop the ones made with it off
    model_harness._step.clear_cache()
    try:
        _, out = _logits(model_dir, dataclasses.replace(cfg, expert_parallel=True), 2)
    finally:
        decoder._traced_once.cache_clear()
        model_harness._step.clear_cache()
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=0, atol=2e-5 * np.abs(r).max())


def _qwen3_moe_cfg(**kw):
    hf = hf_config("qwen3_moe").to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]} | kw
    return ModelConfig.from_hf(hf, dtype="float32")


@pytest.mark.parametrize("ep", [False, True])
def test_moe_layer_collectives(ep):
    """tp=2: one all-reduce per MoE layer (its psum), as a dense MLP's down projection has, beside the
    embedding's and one per attention output; no all-gather of weights or tokens, no all-to-all."""
    cfg = dataclasses.replace(_qwen3_moe_cfg(), expert_parallel=ep)
    mesh = ParallelConfig(2, 1).make_mesh()
    params = load_params("", cfg, mesh, load_format="dummy")
    kv = make_kv_caches(cfg, mesh, 16, 4)
    T, B = 8, 2
    z = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    meta = AttentionMetadata(z(T), z(T), z(B), z(B + 1), z(B, 4), False)

    def step(params, kv, tok, meta):
        kv, h = forward(params, kv, tok, meta, cfg, AttentionConfig(mesh=mesh))
        return kv, compute_logits(params, h, cfg)

    hlo = jax.jit(step, donate_argnums=1).lower(params, kv, z(T), meta).compile().as_text()

    def ops(name):
        return [line for line in hlo.splitlines() if re.search(rf"= \S+ {name}(-start)?\(", line)]

    assert len(ops("all-reduce")) == 1 + 2 * cfg.num_layers
    assert not ops("all-gather") and not ops("all-to-all")


def test_moe_config_parsing_and_errors():
    cfg = _qwen3_moe_cfg(decoder_sparse_step=2, mlp_only_layers=[1])
    assert cfg.moe == MoeConfig(
        num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True, dense_layers=(0, 1)
    )  # layer 0: not a multiple of the step; 1: listed
    assert [cfg.layer_kind(i).moe for i in range(2)] == [False, False]
    old = {k: v for k, v in hf_config("qwen3_moe").to_dict().items() if k != "num_local_experts"}
    cfg = ModelConfig.from_hf(old | {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8})  # Hub spelling
    assert cfg.moe.num_experts == 8 and cfg.moe.dense_layers == ()
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        _qwen3_moe_cfg(num_experts_per_tok=9)
    cfg = _qwen3_moe_cfg(num_local_experts=6)
    ParallelConfig(2, 1).validate(dataclasses.replace(cfg, expert_parallel=True))
    with pytest.raises(ValueError, match=r"the number of experts \(6\) must be divisible by tensor_parallel_size"):
        ParallelConfig(4, 1).validate(dataclasses.replace(cfg, expert_parallel=True))
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(30\) must be divisible by tensor_parallel_size"):
        ParallelConfig(4, 1).validate(_qwen3_moe_cfg(moe_intermediate_size=30))


def test_converted_checkpoint_restores_with_expert_parallel(qwen2_moe, tmp_path):
    """`python -m jaxllm.convert` writes the experts in the checkpoint layout; restored at tp=2 with expert
    parallelism, each device reads its own experts, and the arrays equal the HF checkpoint's."""
    from convert import convert_checkpoint

    model_dir, cfg = qwen2_moe
    out = convert_checkpoint(model_dir, str(tmp_path / "orbax"), tp=2, dtype="float32", progress=False)
    ep = dataclasses.replace(cfg, expert_parallel=True)
    mesh = ParallelConfig(2, 1).make_mesh()
    got, want = load_params(out, ep, mesh), load_params(model_dir, ep, mesh)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert {s.data.shape for s in got["layers"][0]["w_experts_down"].addressable_shards} == {(2, 32, 64)}


def test_qwen2_moe_without_qkv_bias(tmp_path):
    """Qwen2-MoE's config has qkv_bias (default true, as Qwen2's always-on biases); a checkpoint with it false has no
    q / k / v biases, and jaxllm reads it so (it asked for the biases and refused to load)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm import LLM, SamplingParams
    from tests.tiny_models import save_tiny_tokenizer

    cfg = hf_config("qwen2_moe")
    cfg.qkv_bias = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is None
    d = save_checkpoint(model, "qwen2_moe", str(tmp_path))
    save_tiny_tokenizer(d, cfg.vocab_size)
    base = hf_config("qwen2_moe").to_dict() | {"architectures": ["Qwen2MoeForCausalLM"]}
    assert not ModelConfig.from_hf(d).qkv_bias and ModelConfig.from_hf(base).qkv_bias
    prompt = [5, 9, 2, 77, 31]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    llm = LLM(d, dtype="float32", num_gpu_blocks_override=16, max_model_len=64, enforce_eager=True)
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert list(got[0].outputs[0].token_ids) == want[0, len(prompt) :].tolist()
    with pytest.raises(ValueError, match="has num_local_experts=0: a MoE model needs at least one expert"):
        ModelConfig.from_hf(base | {"num_experts": 0, "num_local_experts": 0})
