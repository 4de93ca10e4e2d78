"""Logits parity with HF transformers on tiny random checkpoints of every architecture."""

import dataclasses

import numpy as np
import pytest
import torch

from jaxllm.config import ModelConfig
from jaxllm.models.loader import load_params
from jaxllm.sharding import ParallelConfig
from tests.model_harness import ragged_logits
from tests.tiny_models import ARCHS, NEW_ARCHS, alibi_reference_logits, make_hf_model, save_checkpoint

SEQS = [
    [5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43],  # crosses pages, > window 7
    [101, 7],
    [8] * 11,
    [3],
]
CACHED = [9, 1, 4, 0]  # tokens written in a first step (prefix-cache hits / earlier chunks)
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def hf_reference(model, arch):
    refs = []
    for s in SEQS:
        if arch == "baichuan13b":
            refs.append(alibi_reference_logits(model, s))
        else:
            with torch.no_grad():
                refs.append(model(torch.tensor([s])).logits[0].double().numpy())
    return refs


@pytest.fixture(scope="module", params=ARCHS + NEW_ARCHS)
def hf_case(request, tmp_path_factory):
    arch = request.param
    model = make_hf_model(arch)
    return arch, model, hf_reference(model, arch), tmp_path_factory.mktemp(arch)


def jax_logits(model_dir, dtype):
    cfg = ModelConfig.from_hf(model_dir, dtype=dtype)
    params = load_params(str(model_dir), cfg, ParallelConfig().make_mesh())
    return cfg, params, ragged_logits(params, cfg, SEQS, CACHED)


def max_err(outs, refs):
    return max(rel_err(o, r[c:]) for o, r, c in zip(outs, refs, CACHED, strict=True))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_fp32_parity(hf_case, fmt):
    arch, model, refs, tmp = hf_case
    if fmt == "bin" and arch in NEW_ARCHS:
        pytest.skip("the .bin reader does not depend on the architecture (tested on the others)")
    model_dir = save_checkpoint(model, arch, str(tmp / fmt), fmt)
    cfg, params, outs = jax_logits(model_dir, "float32")
    assert max_err(outs, refs) <= TOL["float32"]
    # The check can fail: one changed weight breaks parity (every expert's, in a MoE layer).
    name = "w_down" if "w_down" in params["layers"][1] else "w_experts_down"
    params["layers"][1][name] = params["layers"][1][name].at[..., 3, 5].add(0.5)
    assert max_err(ragged_logits(params, cfg, SEQS, CACHED), refs) > TOL["float32"]
    if arch in ARCH_FEATURES:  # and so does running without any one of the architecture's features
        params["layers"][1][name] = params["layers"][1][name].at[..., 3, 5].add(-0.5)
        assert max_err(ragged_logits(params, cfg, SEQS, CACHED), refs) <= TOL["float32"]
        for change in ARCH_FEATURES[arch]:
            wrong = dataclasses.replace(cfg, **change(cfg))
            assert max_err(ragged_logits(params, wrong, SEQS, CACHED), refs) > 10 * TOL["float32"], change(cfg)


# Per architecture, configs without one of its features (each must break parity): Gemma's soft-caps, its
# alternation of sliding and global layers, Gemma 3's local RoPE and the global
# layers' RoPE scaling, the routers' top-k renormalisation (Qwen3-MoE) or its absence (Qwen2-MoE).
ARCH_FEATURES = {
    "gemma2": [lambda c: dict(attn_softcap=None), lambda c: dict(final_softcap=None), lambda c: dict(layer_types=None)],
    "gemma3": [
        lambda c: dict(layer_types=None),
        lambda c: dict(rope_local=None),
        lambda c: dict(rope=dataclasses.replace(c.rope, rope_type="default")),
    ],
    "qwen3_moe": [lambda c: dict(moe=dataclasses.replace(c.moe, norm_topk_prob=False))],
    "qwen2_moe": [lambda c: dict(moe=dataclasses.replace(c.moe, norm_topk_prob=True))],
}


def test_bf16_parity(hf_case):
    arch, model, refs, tmp = hf_case
    model_dir = save_checkpoint(model, arch, str(tmp / "bf16"), "safetensors")
    _, _, outs = jax_logits(model_dir, "bfloat16")
    assert max_err(outs, refs) <= TOL["bfloat16"]


def test_sharded_safetensors(tmp_path):
    model = make_hf_model("llama")
    refs = hf_reference(model, "llama")
    model_dir = save_checkpoint(model, "llama", str(tmp_path), "sharded")
    import os

    assert os.path.exists(os.path.join(model_dir, "model.safetensors.index.json"))
    _, _, outs = jax_logits(model_dir, "float32")
    assert max_err(outs, refs) <= TOL["float32"]
