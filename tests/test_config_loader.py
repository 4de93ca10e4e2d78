"""Config parsing and loader errors name the field or tensor at fault."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm.config import ModelConfig
from jaxllm.models.loader import load_params
from jaxllm.sharding import ParallelConfig
from tests.tiny_models import hf_config, make_hf_model, save_checkpoint


def test_llama31_rope_scaling_and_dtypes():
    cfg = ModelConfig.from_hf(hf_config("llama31").to_dict() | {"architectures": ["LlamaForCausalLM"]})
    assert cfg.rope.rope_type == "llama3" and cfg.rope.factor == 8.0 and cfg.rope.theta == 500000.0
    assert cfg.dtype == "bfloat16"  # float32 checkpoints run in bf16 under "auto"
    old_style = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                 "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}, "torch_dtype": "float16"}
    cfg = ModelConfig.from_hf(old_style)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.dtype) == (1e6, "linear", "float16")
    assert ModelConfig.from_hf(old_style, dtype="float").dtype == "float32"


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_unsupported_config_names_field(change, field):
    base = hf_config("llama").to_dict() | {"architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(base | change)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_hf(hf_config("llama").to_dict() | {"architectures": ["LlamaForCausalLM"]}, dtype="int8")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama"))
    return save_checkpoint(make_hf_model("llama"), "llama", d)


def _rewrite(src, dst, edit):
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return dst


def test_missing_tensor_named(llama_dir, tmp_path):
    d = _rewrite(llama_dir, str(tmp_path / "m"), lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    cfg = ModelConfig.from_hf(d, dtype="float32")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_params(d, cfg, ParallelConfig().make_mesh())


def test_misshaped_tensor_names_both_shapes(llama_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)

    d = _rewrite(llama_dir, str(tmp_path / "s"), edit)
    cfg = ModelConfig.from_hf(d, dtype="float32")
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(8, 64\).*\(64, 2, 4, 16\)"):
        load_params(d, cfg, ParallelConfig().make_mesh())


def test_no_weights_and_bad_load_format(tmp_path, llama_dir):
    (tmp_path / "config.json").write_text(json.dumps(hf_config("llama").to_dict()))
    cfg = ModelConfig.from_hf(llama_dir, dtype="float32")
    with pytest.raises(ValueError, match="No weights"):
        load_params(str(tmp_path), cfg, ParallelConfig().make_mesh())
    with pytest.raises(ValueError, match="load_format"):
        load_params(llama_dir, cfg, ParallelConfig().make_mesh(), load_format="gguf2")


def test_dummy_weights_shapes_and_sharding(llama_dir):
    import jax

    cfg = ModelConfig.from_hf(llama_dir, dtype="bfloat16")
    mesh = ParallelConfig(tensor_parallel_size=2).make_mesh()
    params = load_params(llama_dir, cfg, mesh, load_format="dummy")
    w = params["layers"][0]["w_qkv"]  # [D, K, G + 2, H]
    assert w.shape == (64, 2, 4, 16) and w.dtype == jax.numpy.bfloat16
    assert w.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None, None)
    assert float(jax.numpy.std(w.astype("float32"))) > 0.01


def test_kv_budget_leaves_autotuning_headroom(monkeypatch):
    """The KV cache leaves room for XLA's GEMM autotuner (operand copies up to the [V, D] lm_head) even when
    the step's own activations are small (an 8B model with max_num_batched_tokens 128 failed to compile)."""
    import types

    import jax

    from jaxllm.engine import setup

    cfg = ModelConfig("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128)
    stats = {"bytes_limit": 72 << 30, "bytes_in_use": 16 << 30}
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(memory_stats=lambda: stats)])
    args = types.SimpleNamespace(num_gpu_blocks_override=None, kv_cache_memory_bytes=None,
                                 gpu_memory_utilization=0.9)
    per_block = 2 << 20
    small = setup._num_blocks(args, per_block, 128, 8, cfg, gpu=True)
    assert small * per_block <= (72 - 16) * 2**30 - 2 * 128256 * 4096 * 2
    big = setup._num_blocks(args, per_block, 8192, 512, cfg, gpu=True)  # activations already cover it
    assert big < small and big * per_block > (72 - 16 - 4) * 2**30
