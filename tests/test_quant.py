"""Quantized checkpoints written by the public quantizers (gptqmodel: GPTQ and AWQ; llm-compressor:
compressed-tensors), loaded by jaxllm and checked against HF transformers on the same folders: logits against HF's
own integration and against HF's float32 model on the library's own dequantization of the weights, greedy tokens
through the engine (batching, prefix caching, tp=2, pp=2), conversion, dummy weights and bad input."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ModelConfig
from tests.quant_producers import MAX_TOKENS, PROMPT, PROMPTS

JOBS = [
    # GPTQ v1, act-order, asymmetric, groups of 32 (Llama)
    {"name": "gptq_llama", "arch": "llama", "tool": "gptqmodel", "bits": 4, "group_size": 32, "desc_act": True,
     "sym": False},
    # GPTQ 8-bit, one group per column, gptq_v2 zero points (Qwen2: qkv biases, tied embeddings)
    {"name": "gptq8_qwen2", "arch": "qwen2", "tool": "gptqmodel", "bits": 8, "group_size": -1, "sym": False,
     "format": "gptq_v2"},
    # GPTQ into Baichuan-7B's fused W_pack
    {"name": "gptq_baichuan", "arch": "baichuan7b", "tool": "gptqmodel", "bits": 4, "group_size": 32},
    # AWQ GEMM (its clip search needs output dims that are multiples of 64)
    {"name": "awq_qwen2", "arch": "qwen2", "tool": "gptqmodel", "method": "awq", "group_size": 32,
     "overrides": {"num_key_value_heads": 4, "intermediate_size": 128}},
    {"name": "ct_w4a16", "arch": "llama", "tool": "llmcompressor", "bits": 4, "strategy": "group", "group_size": 32},
    {"name": "ct_w8a16", "arch": "llama", "tool": "llmcompressor", "bits": 8, "strategy": "channel"},
    {"name": "ct_fp8", "arch": "llama", "tool": "llmcompressor", "preset": "FP8"},  # static activation scales
    {"name": "ct_fp8_dynamic", "arch": "llama", "tool": "llmcompressor", "preset": "FP8_DYNAMIC"},
    {"name": "ct_w8a8", "arch": "llama", "tool": "llmcompressor", "preset": "W8A8"},
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    import importlib.util

    for tool in ("gptqmodel", "llmcompressor"):  # not imported here: they patch torch / transformers
        if importlib.util.find_spec(tool) is None:
            pytest.skip(f"{tool}, the checkpoints' producer, is not installed (.ci/run installs it)")
    root = tmp_path_factory.mktemp("quant")
    jobs = root / "jobs.json"
    jobs.write_text(json.dumps(JOBS))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, GPTQMODEL_CPU_WORKERS="2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    # cwd: the tools write logs/ and caches into their working directory, never the repository
    proc = subprocess.run([sys.executable, "-m", "tests.quant_producers", str(root), str(jobs)], env=env,
                          cwd=str(root), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {j["name"]: str(root / j["name"]) for j in JOBS}


def _logits(path, **kw):
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import ParallelConfig
    from tests.model_harness import ragged_logits

    cfg = ModelConfig.from_hf(path, dtype="float32", **kw)
    params = load_params(path, cfg, ParallelConfig(1, 1).make_mesh())
    return cfg, ragged_logits(params, cfg, [PROMPT], [0])[0]


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", [j["name"] for j in JOBS])
def test_logits_match_hf(ckpts, name):
    cfg, ours = _logits(ckpts[name])
    refs = np.load(os.path.join(ckpts[name], "refs.npz"))
    assert cfg.quantization is not None
    # HF's float32 model on the library's own dequantization: the same numbers. W8A8: compressed-tensors rounds
    # activations with scale amax / 127.5, vLLM (and jaxllm) with amax / 127.
    assert _rel(ours, refs["dense_logits"]) < (2e-2 if name == "ct_w8a8" else 1e-5)
    if refs["hf_logits"].size:  # HF's own integration (gptqmodel's CPU kernels run in bfloat16)
        assert _rel(ours, refs["hf_logits"]) < 2e-2
        assert (ours.argmax(-1) == refs["hf_logits"].argmax(-1)).mean() >= 0.9


def _make_llm(path, **kw):
    base = dict(dtype="float32", num_gpu_blocks_override=96, max_num_seqs=8, max_num_batched_tokens=64,
                block_size=8, enforce_eager=True, max_model_len=128)
    return LLM(path, **(base | kw))


def _greedy_refs(path):
    refs = np.load(os.path.join(path, "refs.npz"))
    return [refs[f"dense_{i}"].tolist() for i in range(len(PROMPTS))]


def _run(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    return outs


@pytest.mark.parametrize("kw", [dict(), dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp1", "tp2", "pp2"])
def test_engine_greedy_gptq_act_order(ckpts, kw):
    """Batching and prefix caching (the last two prompts share 2 blocks), act-order rows split over tp."""
    outs = _run(_make_llm(ckpts["gptq_llama"], quantization="gptq_marlin", **kw))
    assert [o.outputs[0].token_ids for o in outs] == _greedy_refs(ckpts["gptq_llama"])
    assert outs[-1].num_cached_tokens == 16


@pytest.mark.parametrize("name", ["gptq_baichuan", "awq_qwen2", "ct_w4a16", "ct_fp8"])
def test_engine_greedy_formats(ckpts, name):
    outs = _run(_make_llm(ckpts[name]))
    assert [o.outputs[0].token_ids for o in outs] == _greedy_refs(ckpts[name])


def test_convert_keeps_packed_weights(ckpts, tmp_path):
    from convert import convert_checkpoint

    out = convert_checkpoint(ckpts["gptq_llama"], str(tmp_path / "conv"), tp=2, progress=False)
    with open(os.path.join(out, "jaxllm_manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["quantization"]["method"] == "gptq"
    assert manifest["params"]["layers/0/w_gate_up/packed"]["dtype"] == "int32"
    outs = _run(_make_llm(out))
    assert [o.outputs[0].token_ids for o in outs] == _greedy_refs(ckpts["gptq_llama"])


def test_dummy_weights_and_memory(ckpts):
    import jax

    from jaxllm.models.loader import abstract_weights
    from jaxllm.sharding import ParallelConfig

    mesh = ParallelConfig(1, 1).make_mesh()
    q = ModelConfig.from_hf(ckpts["gptq_llama"], dtype="float32")
    dense = ModelConfig.from_hf(ckpts["gptq_llama"] + "/../.src-gptq_llama", dtype="float32")
    size = lambda cfg: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_weights(cfg, mesh)))  # noqa: E731
    layer = lambda cfg: size(cfg) - cfg.vocab_size * cfg.hidden_size * 4 * 2  # noqa: E731 - without embed and lm_head
    assert layer(q) < 0.3 * layer(dense)  # int4 + scales + zeros against float32
    llm = _make_llm(ckpts["gptq_llama"], load_format="dummy")
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS


def test_dynamic_fp8_on_16_bit_checkpoint(ckpts):
    """quantization="fp8" on an unquantized checkpoint: per-tensor fp8 weights, dynamic per-token activations."""
    src = ckpts["gptq_llama"] + "/../.src-gptq_llama"
    cfg, ours = _logits(src, quantization="fp8")
    assert cfg.quantization.method == "fp8" and not cfg.quantization.serialized
    _, dense = _logits(src)
    err = _rel(ours, dense)
    assert 1e-4 < err < 0.1  # rounded (not the dense numbers), yet close to them
    with pytest.raises(ValueError, match=r"Quantization method specified in the model config \(gptq\) does not "
                                         r"match the quantization method specified in the `quantization` argument"):
        ModelConfig.from_hf(ckpts["gptq_llama"], quantization="fp8")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_input(ckpts, tmp_path):
    path = ckpts["gptq_llama"]
    with pytest.raises(ValueError, match="Unknown quantization method: int3. Must be one of"):
        _make_llm(path, quantization="int3")
    with pytest.raises(ValueError, match=r"model config \(gptq\) does not match .* argument \(awq\)"):
        ModelConfig.from_hf(path, quantization="awq")
    # config that disagrees with the tensors: named field, named tensor and file, before any weight is read
    bad = _copy(path, tmp_path / "bits")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"qweight' in .*model.safetensors has shape \(12, 64\).*bits=8"):
        _make_llm(str(bad))
    cfg["quantization_config"].update(bits=3)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantization_config.bits=3 is not supported"):
        _make_llm(str(bad))
    cfg["quantization_config"].update(bits=4, group_size=16)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"down_proj.scales' in .*model.safetensors has shape \(3, 64\).*group_size=16"):
        _make_llm(str(bad))
    cfg["quantization_config"].update(group_size=32, quant_method="awq", version="gemv")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"version='gemv' is not supported"):
        _make_llm(str(bad))
    # tp shards must hold whole groups (vLLM's message): F = 96 rows of down_proj in groups of 32 over 2 shards
    with pytest.raises(ValueError, match=r"The input size is not aligned with the quantized weight shape: "
                                         r"layers.0.w_down has 96 input rows, 48 per shard"):
        _make_llm(ckpts["ct_w4a16"], tensor_parallel_size=2)
    # a missing scale
    from safetensors.numpy import load_file, save_file

    miss = _copy(path, tmp_path / "missing")
    state = load_file(str(miss / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.scales"]
    save_file(state, str(miss / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.down_proj.scales'.*gptq int4"):
        _make_llm(str(miss))
