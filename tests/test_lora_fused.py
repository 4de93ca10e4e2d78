"""PEFT adapters whose target modules are fused projections: Phi-3's qkv_proj and gate_up_proj, Baichuan's W_pack.
The reference is HF's Phi3ForCausalLM + PEFT itself: a Phi-3 is a Llama whose q/k/v and gate/up weights are
concatenated (qkv_proj rows q, k, v; gate_up_proj rows gate, up), so jaxllm serves its weights split into a Llama
checkpoint, and, with as many kv heads as heads, into a Baichuan-7B checkpoint (W_pack: the same rows as qkv_proj),
with the adapter PEFT saved for the Phi-3 modules (for Baichuan, its qkv_proj tensors under W_pack's name)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxllm.config import ModelConfig
from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.request import LoRARequest
from jaxllm.lora.slots import LoRASlots
from jaxllm.sharding import ParallelConfig
from tests.test_lora import _logits
from tests.tiny_models import _COMMON, hf_config, save_checkpoint, save_tiny_tokenizer

peft = pytest.importorskip("peft")

PROMPTS = [[3, 17, 42, 9, 100], [5, 77, 6, 2]]


def _phi3(num_kv_heads: int):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    cfg = Phi3Config(
        **dict(_COMMON, num_key_value_heads=num_kv_heads),
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms, so that a norm read in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _as_llama(phi3, arch: str, out_dir: str) -> str:
    """phi3's weights as arch's checkpoint (llama, or baichuan7b: W_pack), with a tokenizer."""
    from transformers import AutoModelForCausalLM

    c = phi3.config
    H = c.hidden_size // c.num_attention_heads
    q, kv, F = c.num_attention_heads * H, c.num_key_value_heads * H, c.intermediate_size
    state = {}
    for name, w in phi3.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            for part, rows in zip("qkv", (w[:q], w[q : q + kv], w[q + kv :]), strict=True):
                state[name.replace("qkv_proj", f"{part}_proj")] = rows
        elif name.endswith("gate_up_proj.weight"):
            state[name.replace("gate_up_proj", "gate_proj")] = w[:F]
            state[name.replace("gate_up_proj", "up_proj")] = w[F:]
        else:
            state[name] = w
    llama = AutoModelForCausalLM.from_config(hf_config(arch))
    llama.load_state_dict(state, strict=True)
    save_checkpoint(llama, arch, out_dir)
    save_tiny_tokenizer(out_dir, c.vocab_size)
    return out_dir


def _adapter(phi3, out_dir: str, target_modules: list[str]):
    """A PEFT adapter of phi3 (B scaled up from PEFT's random init so that it matters), saved by PEFT."""
    torch.manual_seed(1)
    model = peft.get_peft_model(
        phi3, peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, target_modules=target_modules)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(out_dir)
    return model


def _rename_modules(adapter_dir: str, old: str, new: str) -> None:
    from safetensors.numpy import load_file, save_file

    file = os.path.join(adapter_dir, "adapter_model.safetensors")
    tensors = load_file(file)
    save_file({k.replace(f".{old}.", f".{new}."): v for k, v in tensors.items()}, file)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["target_modules"] = [new if m == old else m for m in cfg["target_modules"]]
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)


def _jaxllm_logits(model_dir: str, adapter_dir: str, tp: int, fused: bool = False) -> list[np.ndarray]:
    """Each of PROMPTS' logits, the first through the adapter and the second through the base model, in one
    batch. fused (tp 1): the slots fused into the base projections' weights (LoRASlots.absorb), as engines on one
    device run them."""
    from jaxllm.engine.inputs import SeqChunk, build_step_inputs
    from jaxllm.models.attention import AttentionConfig, AttentionMetadata
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import make_kv_caches

    cfg = ModelConfig.from_hf(model_dir, dtype="float32")
    mesh = ParallelConfig(tp).make_mesh()
    params = load_params(model_dir, cfg, mesh)
    slots = LoRASlots(LoRAConfig(max_loras=1, max_lora_rank=8), cfg, mesh)
    slots.add(LoRARequest("fused", 1, adapter_dir))
    slot = slots.activate([1])[1]
    if fused:
        params = slots.absorb(params)
        assert slots.absorbed and "w_qkv" not in params["layers"][0]
    chunks = [SeqChunk(p, 0, [1 + 2 * i, 2 + 2 * i]) for i, p in enumerate(PROMPTS)]
    inp = build_step_inputs(chunks, 4, 16, 4, 4)
    meta = AttentionMetadata(
        *(
            jnp.asarray(getattr(inp, f))
            for f in ("positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables")
        ),
        inp.decode_only,
    )
    token_slots = np.full(16, -1, np.int32)
    token_slots[: len(PROMPTS[0])] = slot
    out = np.asarray(
        _logits(
            params,
            make_kv_caches(cfg, mesh, 16, 4),
            jnp.asarray(inp.token_ids),
            meta,
            slots.arrays,
            jnp.asarray(token_slots),
            cfg,
            AttentionConfig(mesh=mesh),
        )
    )
    n = len(PROMPTS[0])
    return [out[:n], out[n : n + len(PROMPTS[1])]]


def _reference(peft_model) -> list[np.ndarray]:
    """HF + PEFT: PROMPTS[0] through the adapter, PROMPTS[1] without it (and the adapter matters)."""
    with torch.no_grad():
        with_adapter = peft_model(torch.tensor([PROMPTS[0]])).logits[0].numpy()
        with peft_model.disable_adapter():
            base = peft_model(torch.tensor([PROMPTS[1]])).logits[0].numpy()
            without = peft_model(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    assert np.abs(with_adapter - without).max() > 0.1
    return [with_adapter, base]


@pytest.mark.parametrize("tp, fused", [(1, False), (2, False), (1, True)])
def test_phi3_qkv_proj_and_gate_up_proj_adapter_matches_hf_peft(tmp_path, tp, fused):
    phi3 = _phi3(num_kv_heads=2)  # GQA: qkv_proj's rows are 4 q heads, then 2 k and 2 v heads
    model_dir = _as_llama(phi3, "llama", str(tmp_path / "base"))
    adapter = _adapter(phi3, str(tmp_path / "adapter"), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    with open(os.path.join(tmp_path / "adapter", "adapter_config.json")) as f:
        assert set(json.load(f)["target_modules"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    got, want = _jaxllm_logits(model_dir, str(tmp_path / "adapter"), tp, fused), _reference(adapter)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_baichuan_w_pack_adapter_matches_hf_peft(tmp_path, fused):
    phi3 = _phi3(num_kv_heads=4)  # MHA: qkv_proj's rows are W_pack's
    model_dir = _as_llama(phi3, "baichuan7b", str(tmp_path / "base"))
    with open(os.path.join(model_dir, "config.json")) as f:
        assert json.load(f)["model_type"] == "baichuan"
    adapter = _adapter(phi3, str(tmp_path / "adapter"), ["qkv_proj", "o_proj", "down_proj"])
    _rename_modules(str(tmp_path / "adapter"), "qkv_proj", "W_pack")
    got, want = _jaxllm_logits(model_dir, str(tmp_path / "adapter"), 1, fused), _reference(adapter)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=1e-4)
