"""LoRA on the architectures whose layers differ from Llama's, against HF + PEFT, with the slots apart from and fused
into the base weights: Qwen3 (q/k norms after the adapted q/k projections, head_dim != hidden / heads), Qwen2 (q/k/v
biases), Gemma 2 / 3 (the embedding adapter before Gemma's sqrt(D)
scaling, adapted o / down projections before the post-norms, lm_head before the final soft-cap, GELU), and a
mixture-of-experts model (Qwen2-MoE: attention adapters on MoE layers, MLP adapters on its dense layer; MLP adapters
on an MoE layer are refused)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from jaxllm.config import ModelConfig
from jaxllm.lora.peft import load_adapter
from tests.test_lora_fused import _jaxllm_logits, _reference
from tests.tiny_models import make_hf_model, make_tiny_model_dir

peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERYTHING = ATTENTION + ["gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]


def _adapter(arch: str, out_dir: str, target_modules):
    """A PEFT adapter of arch's tiny model (tests/tiny_models.py, seed 0), B scaled up so that it matters."""
    torch.manual_seed(1)
    model = peft.get_peft_model(
        make_hf_model(arch), peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, target_modules=target_modules)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.mul_(4.0)
    model.save_pretrained(out_dir)
    return model


# fused: the slots fused into the base projections' weights (LoRASlots.absorb, what one-device engines run);
# Qwen2 for its q/k/v biases, added to the fused GEMM's base part
@pytest.mark.parametrize(
    "arch, fused",
    [("qwen3", False), ("gemma2", False), ("gemma3", False), ("qwen3", True), ("gemma2", True), ("qwen2", True)],
)
def test_adapter_on_every_module_matches_hf_peft(arch, fused, tmp_path):
    model_dir = make_tiny_model_dir(arch, str(tmp_path / "base"))[0]
    adapter = _adapter(arch, str(tmp_path / "adapter"), EVERYTHING)
    got, want = _jaxllm_logits(model_dir, str(tmp_path / "adapter"), 1, fused), _reference(adapter)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=5e-4, rtol=1e-4)


def test_moe_model_attention_and_dense_layer_adapters_match_hf_peft_and_moe_mlp_adapters_are_refused(tmp_path):
    arch = "qwen2_moe"  # layer 0: routed experts + a shared expert; layer 1: a dense MLP
    model_dir = make_tiny_model_dir(arch, str(tmp_path / "base"))[0]
    targets = r".*layers\.\d+\.self_attn\.(q|k|v|o)_proj|.*layers\.1\.mlp\.(gate|up|down)_proj"
    adapter = _adapter(arch, str(tmp_path / "adapter"), targets)
    got, want = _jaxllm_logits(model_dir, str(tmp_path / "adapter"), 2), _reference(adapter)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=1e-4)

    from safetensors.numpy import load_file, save_file

    file = os.path.join(tmp_path / "adapter", "adapter_model.safetensors")
    save_file({k.replace("layers.1.mlp", "layers.0.mlp"): v for k, v in load_file(file).items()}, file)
    cfg = ModelConfig.from_hf(model_dir, dtype="float32")
    moe_mlp = r"^target_modules: model\.layers\.0\.mlp\.(gate|up|down)_proj .* mixture of experts"
    with pytest.raises(ValueError, match=moe_mlp):
        load_adapter(str(tmp_path / "adapter"), cfg, 8)
    # the shared expert's modules (PEFT's names for them) are not ours either
    _adapter(arch, str(tmp_path / "shared"), ["gate_proj"])
    with pytest.raises(ValueError, match=r"^target_modules: .*shared_expert\.gate_proj"):
        load_adapter(str(tmp_path / "shared"), cfg, 8)
