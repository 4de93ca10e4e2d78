"""Config parsing and loader errors name the field or tensor at fault."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm.config import ModelConfig, RopeConfig
from jaxllm.models.loader import load_params
from jaxllm.sharding import ParallelConfig
from tests.tiny_models import hf_config, make_hf_model, save_checkpoint


def test_llama31_rope_scaling_and_dtypes():
    cfg = ModelConfig.from_hf(hf_config("llama31").to_dict() | {"architectures": ["LlamaForCausalLM"]})
    assert cfg.rope.rope_type == "llama3" and cfg.rope.factor == 8.0 and cfg.rope.theta == 500000.0
    assert cfg.dtype == "bfloat16"  # float32 checkpoints run in bf16 under "auto"
    old_style = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "torch_dtype": "float16",
    }
    cfg = ModelConfig.from_hf(old_style)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.dtype) == (1e6, "linear", "float16")
    assert ModelConfig.from_hf(old_style, dtype="float").dtype == "float32"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "su", "short_factor": [1.0], "long_factor": [1.0]}}, "rope_type"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
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


def test_unused_tensors_are_an_error(llama_dir, tmp_path):
    """Weights the config does not use mean the two disagree (here: a checkpoint with a bias the config has
    not, and a config with one layer fewer): loading would silently run another model. RoPE buffers are fine."""

    def add(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    d = _rewrite(llama_dir, str(tmp_path / "b"), add)
    cfg = ModelConfig.from_hf(d, dtype="float32")
    with pytest.raises(
        ValueError,
        match=r"1 tensor\(s\) the model config does not use, e\.g\. "
        r"'model\.layers\.0\.self_attn\.q_proj\.bias'",
    ):
        load_params(d, cfg, ParallelConfig().make_mesh())
    hf = json.load(open(os.path.join(llama_dir, "config.json")))
    cfg = ModelConfig.from_hf(hf | {"num_hidden_layers": hf["num_hidden_layers"] - 1}, dtype="float32")
    with pytest.raises(ValueError, match="does not use.*model\\.layers\\.1\\."):
        load_params(llama_dir, cfg, ParallelConfig().make_mesh())


def test_unused_quantized_tensors_say_why(llama_dir, tmp_path):
    """A quantized lm_head (llm-compressor with lm_head not ignored) is named as such, and quantized tensors in a
    checkpoint whose config.json has no quantization_config point at quantize_config.json when it is there."""

    def head(t):
        t["lm_head.weight_packed"] = np.zeros((4, 4), np.int32)
        t["lm_head.weight_scale"] = np.ones((4, 1), np.float32)

    d = _rewrite(llama_dir, str(tmp_path / "h"), head)
    cfg = ModelConfig.from_hf(d, dtype="float32")
    with pytest.raises(ValueError, match=r"lm_head is quantized \('lm_head\.weight_packed'.*not supported"):
        load_params(d, cfg, ParallelConfig().make_mesh())
    d = _rewrite(
        llama_dir, str(tmp_path / "q"), lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": np.zeros(4)})
    )
    with pytest.raises(ValueError, match=r"quantized tensors .*no quantization_config\.$"):
        load_params(d, cfg, ParallelConfig().make_mesh())
    with open(os.path.join(d, "quantize_config.json"), "w") as f:
        json.dump({"bits": 4}, f)
    with pytest.raises(ValueError, match=r"quantize_config\.json is there: pass --quantization gptq"):
        load_params(d, cfg, ParallelConfig().make_mesh())


def test_unreadable_weight_files_are_named(llama_dir, tmp_path):
    d = _rewrite(llama_dir, str(tmp_path / "t"), lambda t: None)
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(100)
    cfg = ModelConfig.from_hf(d, dtype="float32")
    with pytest.raises(ValueError, match="Cannot read weights from .*model.safetensors"):
        load_params(d, cfg, ParallelConfig().make_mesh())


def test_legacy_torch_bin_loads(llama_dir, tmp_path):
    """pytorch_model.bin written without the zip format (torch < 1.6) cannot be memory-mapped: read normally."""
    import torch

    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    d = tmp_path / "legacy"
    d.mkdir()
    torch.save(
        {k: torch.from_numpy(v) for k, v in tensors.items()},
        d / "pytorch_model.bin",
        _use_new_zipfile_serialization=False,
    )
    (d / "config.json").write_text(open(os.path.join(llama_dir, "config.json")).read())
    cfg = ModelConfig.from_hf(str(d), dtype="float32")
    mesh = ParallelConfig().make_mesh()
    got, want = load_params(str(d), cfg, mesh), load_params(llama_dir, cfg, mesh)
    np.testing.assert_array_equal(np.asarray(got["layers"][1]["w_down"]), np.asarray(want["layers"][1]["w_down"]))


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

    cfg = ModelConfig(
        "llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
    )
    stats = {"bytes_limit": 72 << 30, "bytes_in_use": 16 << 30}
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(memory_stats=lambda: stats)])
    args = types.SimpleNamespace(num_gpu_blocks_override=None, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9)
    per_block = 2 << 20
    small = setup._num_blocks(args, per_block, 128, 8, cfg, gpu=True)
    assert small * per_block <= (72 - 16) * 2**30 - 2 * 128256 * 4096 * 2
    big = setup._num_blocks(args, per_block, 8192, 512, cfg, gpu=True)  # activations already cover it
    assert big < small and big * per_block > (72 - 16 - 4) * 2**30
    # a tiny model still leaves 1 GiB of working memory (all but ~60 MB went to its cache on an H100)
    tiny = ModelConfig(
        "llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    stats.update(bytes_in_use=1 << 20)
    blocks = setup._num_blocks(args, 4096, 16384, 1024, tiny, gpu=True)
    assert (72 << 30) - (1 << 20) - blocks * 4096 >= 1 << 30


def test_default_batch_limits_follow_vllm_by_gpu():
    """vLLM's defaults: 1024 sequences and 16384 tokens a step (8192 for the server) on GPUs of 70 GiB or more
    except the A100, 256 and 8192 (2048) on the others; explicit values stand."""
    from jaxllm.engine import setup
    from jaxllm.engine.args import EngineArgs

    GiB = 2**30
    h100, a100, l4 = (80 * GiB, "NVIDIA H100 80GB HBM3"), (80 * GiB, "NVIDIA A100-SXM4-80GB"), (22 * GiB, "NVIDIA L4")
    limits = lambda device, **kw: setup.default_limits(EngineArgs(model="m", **kw), True, device)  # noqa: E731
    assert [limits(d) for d in (h100, a100, l4, None)] == [(1024, 16384), (256, 8192), (256, 8192), (1024, 16384)]
    assert [limits(d, server_mode=True) for d in (h100, a100, l4)] == [(1024, 8192), (256, 2048), (256, 2048)]
    assert limits(l4, max_num_seqs=64, max_num_batched_tokens=4096) == (64, 4096)
    assert setup.default_limits(EngineArgs(model="m"), False) == (8, 256)
    assert setup.default_limits(EngineArgs(model="m", max_num_seqs=512), False) == (512, 512)  # a default grows
    assert setup.default_limits(EngineArgs(model="m", max_num_batched_tokens=4), False) == (8, 4)  # refused later


@pytest.mark.parametrize(
    "kw,message",
    [
        (
            dict(max_num_batched_tokens=4),
            r"max_num_batched_tokens \(4\) must be greater than or equal to max_num_seqs \(8\)",
        ),
        (
            dict(max_num_batched_tokens=32, enable_chunked_prefill=False),
            r"max_num_batched_tokens \(32\) is smaller than max_model_len \(128\)",
        ),
    ],
)
def test_explicit_step_limits_vllm_refuses_are_refused_before_weights_load(tmp_path, monkeypatch, kw, message):
    """An explicit max_num_batched_tokens below max_num_seqs, or below max_model_len without chunked prefill, was
    raised silently (a user's budget overridden); vLLM's SchedulerConfig refuses both. Refused before the weights
    load; without chunked prefill a default budget still grows to max_model_len."""
    from jaxllm import LLM
    from jaxllm.models import loader
    from tests.tiny_models import make_tiny_model_dir

    model = make_tiny_model_dir("llama", str(tmp_path / "tiny"))[0]
    monkeypatch.setattr(loader, "load_params", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match=message):
        LLM(model, max_model_len=128, **kw)


GEMMA3_1B = {  # google/gemma-3-1b-it's config.json as the Hub has it (transformers 4.50 layout)
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rope_local_base_freq": 10000,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}
GEMMA2_2B = {  # google/gemma-2-2b-it's config.json (transformers 4.42 layout: no layer_types)
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}


def test_gemma_hub_configs():
    """Configs as the Hub ships them, before transformers 5 wrote layer_types and per-layer-type RoPE: Gemma 3
    has 5 sliding layers per global one, its global layers RoPE base 1e6 (and rope_scaling, 4B and up), its
    sliding ones 1e4 unscaled; Gemma 2 alternates, starting with a sliding layer."""
    cfg = ModelConfig.from_hf(GEMMA3_1B)
    kinds = [cfg.layer_kind(i) for i in range(12)]
    assert [k.sliding_window for k in kinds] == ([512] * 5 + [None]) * 2
    assert {k.rope.theta for k in kinds if k.sliding_window} == {1e4} and kinds[5].rope.theta == 1e6
    assert (
        cfg.qk_norm,
        cfg.norm_plus_one,
        cfg.sandwich_norm,
        cfg.scale_embeddings,
        cfg.tie_word_embeddings,
        cfg.hidden_act,
        cfg.attn_softcap,
        cfg.final_softcap,
    ) == (True, True, True, True, True, "gelu_tanh", None, None)
    assert cfg.attn_scale == 256**-0.5
    scaled = ModelConfig.from_hf(GEMMA3_1B | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert (scaled.layer_kind(5).rope.rope_type, scaled.layer_kind(5).rope.factor) == ("linear", 8.0)
    assert scaled.layer_kind(0).rope == RopeConfig(theta=1e4)
    cfg = ModelConfig.from_hf(GEMMA2_2B)
    assert [cfg.layer_kind(i).sliding_window for i in range(4)] == [4096, None, 4096, None]
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.qk_norm, cfg.dtype) == (50.0, 30.0, False, "bfloat16")
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf(GEMMA2_2B | {"layer_types": ["sliding_attention"] * 3})
    with pytest.raises(ValueError, match="only 'silu'"):
        ModelConfig.from_hf(
            hf_config("mixtral").to_dict()
            | {"architectures": ["MixtralForCausalLM"], "hidden_act": "gelu_pytorch_tanh"}
        )


def test_max_model_len_past_the_models_needs_vllms_env_var(tmp_path, monkeypatch):
    """A max_model_len above the config's max_position_embeddings is refused naming VLLM_ALLOW_LONG_MAX_MODEL_LEN;
    with it set (vLLM's override) the engine starts with the longer length, and a prompt past the model's 256
    positions runs."""
    from jaxllm import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model_dir

    model = make_tiny_model_dir("llama", str(tmp_path / "tiny"))[0]
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(
        ValueError, match=r"\(256: max_position_embeddings=256.*set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
    ):
        LLM(model, max_model_len=512)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = LLM(model, max_model_len=512, dtype="float32", enforce_eager=True, max_num_batched_tokens=512)
    assert llm.llm_engine.max_model_len == 512
    out = llm.generate({"prompt_token_ids": [5] * 300}, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
