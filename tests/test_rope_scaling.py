"""RoPE scaling as Qwen's long-context recipe enables it (YaRN, through config.json or vLLM's --hf-overrides /
--rope-scaling) and dynamic NTK as vLLM runs it: inverse frequencies and attention factor against transformers',
logits parity past original_max_position_embeddings, greedy equality through the engine, and the max_model_len
vLLM derives from the scaling."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.config import ModelConfig
from jaxllm.models.loader import load_params
from jaxllm.rope import rope_config
from jaxllm.sharding import ParallelConfig
from tests.model_harness import ragged_logits
from tests.tiny_models import hf_config, make_hf_model, make_tiny_model_dir, save_checkpoint

TOL = 1e-4  # float32
_rng = np.random.default_rng(7)
# Positions up to 150, past the tiny configs' original 64; the first steps write 60 / 33 tokens (cache reads).
SEQS = [_rng.integers(3, 128, 150).tolist(), _rng.integers(3, 128, 97).tolist(), [8] * 70, [101, 7]]
CACHED = [60, 33, 0, 1]


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)


@pytest.mark.parametrize(
    "scaling",
    [
        YARN,
        dict(YARN, original_max_position_embeddings=32768),
        dict(YARN, factor=8.0, beta_fast=16, beta_slow=2, truncate=False),
        dict(YARN, factor=40.0, mscale=1.0, mscale_all_dim=0.707),  # DeepSeek's ratio of mscales
        dict(YARN, factor=2.0, attention_factor=0.9),
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},  # the older key
    ],
)
@pytest.mark.parametrize("theta, head_dim", [(1e4, 32), (1e6, 128)])
def test_yarn_matches_transformers(scaling, theta, head_dim):
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    hf = Qwen2Config(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=256,
        rope_theta=theta,
        rope_scaling=dict(scaling),
    )
    inv, factor = _compute_yarn_parameters(hf)
    for raw in (hf.to_dict(), {"rope_theta": theta, "rope_scaling": scaling, "max_position_embeddings": 256}):
        rope = rope_config(raw)  # transformers 5's rope_parameters, and config.json's rope_scaling
        np.testing.assert_allclose(rope.inv_freq(head_dim), inv.double().numpy(), rtol=1e-6)
        assert rope.attention_factor == pytest.approx(factor, rel=1e-12)


def test_dynamic_matches_vllm():
    """vLLM's DynamicNTKScalingRotaryEmbedding: one base, transformers' at factor * max_position_embeddings."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters

    hf = Qwen2Config(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=32,
        rope_scaling=dict(type="dynamic", factor=2.0),
    )
    inv, _ = _compute_dynamic_ntk_parameters(hf, seq_len=64)
    rope = rope_config(hf.to_dict())
    np.testing.assert_allclose(rope.inv_freq(32), inv.double().numpy(), rtol=1e-6)
    assert rope.attention_factor == 1.0


def _parity(arch, seqs, cached, tmp_path):
    model = make_hf_model(arch)
    with torch.no_grad():
        refs = [model(torch.tensor([s])).logits[0].double().numpy() for s in seqs]
    model_dir = save_checkpoint(model, arch, str(tmp_path))
    cfg = ModelConfig.from_hf(model_dir, dtype="float32")
    params = load_params(model_dir, cfg, ParallelConfig().make_mesh())

    def err(c):
        outs = ragged_logits(params, c, seqs, cached, block_size=8, num_pages=64)
        return max(rel_err(o, r[n:]) for o, r, n in zip(outs, refs, cached, strict=True))

    return cfg, err


@pytest.mark.parametrize("arch", ["qwen2_yarn", "qwen3_yarn"])
def test_yarn_logits_match_hf(arch, tmp_path):
    cfg, err = _parity(arch, SEQS, CACHED, tmp_path)
    assert cfg.rope.rope_type == "yarn" and cfg.layer_kind(0).attn_scale == pytest.approx(
        cfg.head_dim**-0.5 * (0.1 * np.log(4.0) + 1) ** 2
    )
    assert err(cfg) <= TOL
    # Without the attention factor (q.k scaled by ~1.3) or without YaRN's frequencies, parity breaks.
    assert err(dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, attention_factor=1.0))) > 10 * TOL
    assert err(dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, rope_type="default"))) > 10 * TOL


def test_dynamic_logits_match_hf(tmp_path):
    """HF's dynamic NTK recomputes the base from each forward pass's length; at factor * max_position_embeddings
    (2 * 32) tokens it is the base vLLM uses at every length."""
    seq = _rng.integers(3, 128, 64).tolist()
    cfg, err = _parity("qwen2_dynamic", [seq], [20], tmp_path)
    assert err(cfg) <= TOL
    assert err(dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, rope_type="default"))) > 10 * TOL


def _raw(**kw):
    base = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32768,
    )
    return ModelConfig.from_hf(base | kw)


def test_derived_max_model_len_as_vllm():
    """vLLM's _get_and_verify_max_len: yarn -> original_max_position_embeddings * factor; linear, dynamic ->
    max_position_embeddings * factor; llama3 and Gemma 3 already count it."""
    assert _raw(rope_scaling=dict(YARN, original_max_position_embeddings=32768)).derived_max_model_len()[0] == 131072
    assert _raw(rope_parameters=dict(YARN, rope_theta=1e6)).derived_max_model_len()[0] == 256
    assert _raw(rope_scaling={"type": "linear", "factor": 2.0}).derived_max_model_len()[0] == 65536
    assert _raw(rope_scaling={"rope_type": "dynamic", "factor": 2.0}).derived_max_model_len()[0] == 65536
    llama31 = hf_config("llama31").to_dict() | {"architectures": ["LlamaForCausalLM"]}
    assert ModelConfig.from_hf(llama31).derived_max_model_len()[0] == 256
    assert _raw().derived_max_model_len() == (32768, "max_position_embeddings=32768")
    gemma3 = hf_config("gemma3").to_dict() | {"architectures": ["Gemma3ForCausalLM"]}
    assert ModelConfig.from_hf(gemma3).derived_max_model_len()[0] == 256  # its linear factor 8 not applied


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "rope_type"),
        ({"rope_scaling": dict(YARN), "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_scaling": {"rope_type": "dynamic", "alpha": 1000.0}}, "factor"),
    ],
)
def test_unsupported_rope_names_field(change, field):
    with pytest.raises(ValueError, match=field):
        _raw(**change)


def test_yarn_greedy_through_engine_with_hf_overrides(tmp_path):
    """Qwen's documented command: a plain config.json, YaRN enabled by --hf-overrides (LLM(hf_overrides=...))
    and a max_model_len past max_position_embeddings. Greedy tokens equal HF's under chunked prefill and a
    prefix-cache hit, for prompts and outputs past original_max_position_embeddings (64)."""
    model_dir, model = make_tiny_model_dir("qwen2_yarn", str(tmp_path / "m"))
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw.pop("rope_scaling", None)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    with open(path, "w") as f:
        json.dump(raw, f)
    shared = SEQS[0][:80]
    prompts = [SEQS[0][:100], SEQS[1], [8] * 70, [101, 7], shared + [1, 2], shared + [3]]
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        refs = [
            model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
            for p in prompts
        ]
    kw = dict(
        dtype="float32",
        num_gpu_blocks_override=96,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=8,
        max_model_len=256,
        enforce_eager=True,
        compilation_cache_dir=None,
    )
    with pytest.raises(ValueError, match=r"derived max_model_len \(64: max_position_embeddings=64"):
        LLM(model_dir, **kw)  # refused before the weights load: without YaRN the model is 64 tokens long
    llm = LLM(model_dir, hf_overrides={"rope_scaling": YARN}, **kw)
    assert llm.llm_engine.max_model_len == 256
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs[:4]
    first = llm.generate({"prompt_token_ids": prompts[4]}, greedy, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompts[5]}, greedy, use_tqdm=False)[0]
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == refs[4:]
    assert second.num_cached_tokens == 80
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "KV blocks leaked"


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_theta"])
def test_rope_theta_override_reaches_either_config_layout(layout):
    """--rope-theta / hf_overrides={"rope_theta": ...} set the base whether config.json keeps it at the top level
    (transformers < 5) or inside rope_parameters (transformers 5, whose value rope_config reads first)."""
    from jaxllm.engine.args import EngineArgs
    from jaxllm.rope import rope_config

    hf = {"max_position_embeddings": 64}
    hf |= (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
        if layout == "rope_parameters"
        else {"rope_theta": 1e4}
    )
    for args in (EngineArgs(model="m", rope_theta=5e5), EngineArgs(model="m", hf_overrides={"rope_theta": 5e5})):
        assert rope_config(args.overridden_config(hf)).theta == 5e5
    assert rope_config(EngineArgs(model="m").overridden_config(hf)).theta == 1e4
