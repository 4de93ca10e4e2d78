"""Quantized expert weights (jaxllm/models/moe_quant.py): tiny Qwen2-MoE, Qwen3-MoE and Mixtral checkpoints quantized
by gptqmodel (GPTQ int4) and llm-compressor (compressed-tensors W4A16, FP8 and INT8 W8A8), each expert's Linears
quantized on their own and the routers kept unquantized as the tools and vLLM keep them; checked against HF on the
same folders (logits on the library's own dequantization, greedy tokens through the engine at tp=2 with and without
expert parallelism) and for the splits tensor parallelism refuses.

All checkpoints come from one producer subprocess (tests/quant_producers.py, which has HF build the MoE blocks with
one Linear per expert, as the checkpoints store them)."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ModelConfig
from jaxllm.models.moe_quant import QuantizedExperts
from jaxllm.sharding import ParallelConfig
from tests.quant_producers import PROMPT, PROMPTS
from tests.test_quant import _greedy_refs, _make_llm, _need, _produce, _rel, _run, _tokens

_ROUTERS = ["lm_head", "re:.*mlp.gate$"]  # llm-compressor's MoE recipes: routers (and shared expert gates) stay dense
JOBS = [
    # Qwen3-30B-A3B-GPTQ-Int4's scheme (sym, no act-order) at group 32: its experts' 32 down rows do not split over
    # tp=2 (refused), expert parallelism keeps them whole
    {"name": "gptq_qwen3_moe", "arch": "qwen3_moe", "tool": "gptqmodel", "bits": 4, "group_size": 32},
    # act-order, asymmetric, in the Hub's Mixtral names (block_sparse_moe.experts.{e}.w1 / w3 / w2): g_idx per expert,
    # rows split over tp=2 with their g_idx
    {
        "name": "gptq_mixtral",
        "arch": "mixtral",
        "tool": "gptqmodel",
        "bits": 4,
        "group_size": 32,
        "desc_act": True,
        "sym": False,
        "hub_names": True,
    },
    # llm-compressor's Mixtral names (block_sparse_moe.experts.{e}.gate_proj); groups of 16 split over tp=2
    {
        "name": "ct_w4a16_mixtral",
        "arch": "mixtral",
        "tool": "llmcompressor",
        "bits": 4,
        "strategy": "group",
        "group_size": 16,
        "ignore": _ROUTERS,
    },
    # fp8 experts and shared expert, per-token fp8 activations; the shared expert's sigmoid gate stays dense
    {
        "name": "ct_fp8_qwen2_moe",
        "arch": "qwen2_moe",
        "tool": "llmcompressor",
        "preset": "FP8_DYNAMIC",
        "ignore": [*_ROUTERS, "re:.*shared_expert_gate$"],
    },
    {"name": "ct_w8a8_qwen3_moe", "arch": "qwen3_moe", "tool": "llmcompressor", "preset": "W8A8", "ignore": _ROUTERS},
]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    _need("gptqmodel", "llmcompressor", "defuser")
    root = tmp_path_factory.mktemp("quant_moe")
    _produce(root, JOBS)
    return {j["name"]: str(root / j["name"]) for j in JOBS}


def _load(path, tp=1, ep=False):
    from jaxllm.models.loader import load_params

    cfg = dataclasses.replace(ModelConfig.from_hf(path, dtype="float32"), expert_parallel=ep)
    mesh = ParallelConfig(tp, 1).make_mesh()
    return cfg, mesh, load_params(path, cfg, mesh)


@pytest.mark.parametrize("name", [j["name"] for j in JOBS])
def test_logits_match_hf(ckpts, name):
    from tests.model_harness import ragged_logits

    path = ckpts[name]
    cfg, _, params = _load(path)
    layer = params["layers"][0]
    assert isinstance(layer["w_experts_gate_up"], QuantizedExperts)
    assert isinstance(layer["w_experts_down"], QuantizedExperts)
    assert layer["router"].dtype == jnp.float32  # the router (and Qwen2-MoE's shared expert gate) stay dense
    if cfg.moe.shared_intermediate_size:
        assert layer["w_shared_expert_gate"].dtype == jnp.float32
        assert layer["w_shared_down"].scheme.weight_type == "float"
    ours = ragged_logits(params, cfg, [PROMPT], [0])[0]
    refs = np.load(os.path.join(path, "refs.npz"))
    # HF's float32 model on the library's own dequantization of every Linear (the experts' too); W8A8:
    # compressed-tensors rounds activations with scale amax / 127.5, vLLM (and jaxllm) with amax / 127.
    assert _rel(ours, refs["dense_logits"]) < (2e-2 if "w8a8" in name else 1e-5)
    # HF's own integration (gptqmodel's CPU kernels run in bfloat16)
    assert _rel(ours, refs["hf_logits"]) < 2e-2
    assert (ours.argmax(-1) == refs["hf_logits"].argmax(-1)).mean() >= 0.9
    assert _rel(ours, refs["src_logits"]) > 1e-3  # quantized: not the unquantized model's numbers


@pytest.mark.parametrize("name,tp,ep", [("gptq_qwen3_moe", 2, True), ("gptq_mixtral", 2, False)])
def test_engine_greedy(ckpts, name, tp, ep):
    """Chunked prefill, batching, prefix caching; decode steps dequantize only the experts their tokens chose."""
    path = ckpts[name]
    outs = _run(_make_llm(path, tensor_parallel_size=tp, enable_expert_parallel=ep))
    assert _tokens(outs) == _greedy_refs(path)
    assert outs[-1].num_cached_tokens == 16
    assert len(_tokens(outs)) == len(PROMPTS)


def _experts_reference(h, lp, cfg):
    """The routed experts one (token, expert) pair at a time in numpy, on the dequantized weights, each projection's
    input rounded per token as vLLM's W8A8 MoE kernels round it (int8: scale amax / 127; fp8 e4m3: amax / 448)."""
    import ml_dtypes

    from jaxllm.models.moe import route
    from jaxllm.models.moe_quant import dequantize_experts

    q, E, D = cfg.quantization, cfg.moe.num_experts, cfg.hidden_size
    w_gate_up = np.asarray(dequantize_experts(lp["w_experts_gate_up"], jnp.arange(E), jnp.float32)).reshape(E, D, -1)
    w_down = np.asarray(dequantize_experts(lp["w_experts_down"], jnp.arange(E), jnp.float32))

    def rounded(x):
        if q.activations is None:
            return x
        if q.weight_type == "float":
            s = np.abs(x).max() / 448.0
            return (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
        s = np.abs(x).max() / 127.0
        return np.round(x / s) * s

    weights, ids = map(np.asarray, route(h, lp["router"], cfg.moe))
    h, out = np.asarray(h), np.zeros(h.shape, np.float64)
    for t in range(len(h)):
        for w, e in zip(weights[t], ids[t], strict=True):
            gate, up = np.split(rounded(h[t]) @ w_gate_up[e], 2)
            out[t] += w * (rounded(gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    return out


@pytest.mark.parametrize("name", ["ct_w4a16_mixtral", "ct_fp8_qwen2_moe", "ct_w8a8_qwen3_moe"])
def test_experts_tp_and_expert_parallel_equal_tp1(ckpts, name):
    """One MoE layer's routed experts against a pair-by-pair reference (W8A8: each projection's input rounded per
    token), and at tp=2, each device holding its experts (expert parallel) or every expert's ffn slice with its
    groups (weight-only schemes; W8A8 rounds the down projection's input per device, over its slice, as vLLM does),
    equal to tp=1."""
    from jaxllm.models.moe import moe_mlp

    path = ckpts[name]
    h = jnp.asarray(np.random.default_rng(0).standard_normal((11, 64)), jnp.float32)
    cfg, _, params = _load(path)
    want = np.asarray(jax.jit(lambda lp, h: moe_mlp(lp, h, cfg))(params["layers"][0], h))
    np.testing.assert_allclose(
        want, _experts_reference(h, params["layers"][0], cfg), rtol=0, atol=1e-5 * np.abs(want).max()
    )
    modes = (True,) if cfg.quantization.activations else (True, False)
    for ep in modes:
        cfg, mesh, params = _load(path, 2, ep)
        lp = params["layers"][0]
        got = np.asarray(jax.jit(lambda lp, h, cfg=cfg, mesh=mesh: moe_mlp(lp, h, cfg, mesh))(lp, h))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        E, F = cfg.moe.num_experts, cfg.moe.intermediate_size
        down = {s.data.shape for s in lp["w_experts_down"].packed.addressable_shards}
        rows = F // (1 if cfg.quantization.weight_type == "float" else cfg.quantization.pack_factor)
        assert down == {(E // 2, rows, 64) if ep else (E, rows // 2, 64)}, (ep, down)


def test_packed_experts_memory(ckpts):
    """What the devices hold: the packed experts (int4 words, scales), not dense ones."""
    from jaxllm.models.loader import abstract_weights

    mesh = ParallelConfig(1, 1).make_mesh()
    q = ModelConfig.from_hf(ckpts["gptq_qwen3_moe"], dtype="float32")
    dense = dataclasses.replace(q, quantization=None)

    def experts(cfg):
        layer = abstract_weights(cfg, mesh)["layers"][0]
        return sum(
            x.size * x.dtype.itemsize
            for k in ("w_experts_gate_up", "w_experts_down")
            for x in jax.tree.leaves(layer[k])
        )

    assert experts(q) < 0.2 * experts(dense)  # int4 + a float32 scale per 32 rows against float32


def test_bad_input(ckpts, tmp_path):
    # a tp split of the experts' rows that is not whole groups (vLLM's message), before any weight is read
    with pytest.raises(
        ValueError,
        match=r"The input size is not aligned with the quantized weight shape: "
        r"layers.0.w_experts_down has 32 input rows per expert, 16 per shard .*"
        r"--enable-expert-parallel keeps experts whole",
    ):
        _make_llm(ckpts["gptq_qwen3_moe"], tensor_parallel_size=2)
    # a missing expert tensor, named as the checkpoint names it
    from safetensors.numpy import load_file, save_file

    miss = tmp_path / "missing"
    shutil.copytree(ckpts["gptq_mixtral"], miss)
    state = load_file(str(miss / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.3.w2.scales"]
    save_file(state, str(miss / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.block_sparse_moe.experts.3.w2.scales'"):
        _make_llm(str(miss))
    # one expert's Linear kept unquantized where the others of its layer are quantized: one weight for all experts
    part = tmp_path / "partial"
    shutil.copytree(ckpts["ct_w4a16_mixtral"], part)
    cfg = json.loads((part / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("re:.*layers.0.block_sparse_moe.experts.1.w1$")
    (part / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError,
        match=r"keeps \['model.layers.0.block_sparse_moe.experts.1.w1'\] unquantized but "
        r"quantizes",
    ):
        _make_llm(str(part))
