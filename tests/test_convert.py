"""HF -> Orbax conversion: round trip to logits parity with HF on the same and on other meshes, the CLI, and
bad inputs (clear error, nothing half-written left behind)."""

import json
import os

import numpy as np
import pytest
import torch

from convert import ConversionError, convert_checkpoint
from convert.cli import main as convert_main
from jaxllm.config import ModelConfig
from jaxllm.models.attention import AttentionConfig
from jaxllm.models.checkpoint_files import MANIFEST
from jaxllm.models.loader import load_params
from jaxllm.sharding import ParallelConfig, kv_heads_for
from tests.model_harness import ragged_logits
from tests.tiny_models import make_hf_model, save_checkpoint, save_tiny_tokenizer

SEQS = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [101, 7], [8] * 11, [3]]
CACHED = [9, 1, 4, 0]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = make_hf_model("llama")
    d = save_checkpoint(model, "llama", str(tmp_path_factory.mktemp("hf")), "bin")  # PyTorch .bin via torch
    save_tiny_tokenizer(d, 128)
    with torch.no_grad():
        refs = [model(torch.tensor([s])).logits[0].double().numpy() for s in SEQS]
    return d, refs


def logits(model_dir, tp):
    cfg = ModelConfig.from_hf(model_dir, dtype="float32")  # "auto" would run a float32 checkpoint in bf16
    mesh = ParallelConfig(tp, 1).make_mesh()
    params = load_params(model_dir, cfg, mesh)
    import dataclasses

    stored = dataclasses.replace(cfg, num_kv_heads=kv_heads_for(cfg.num_kv_heads, tp))
    return ragged_logits(params, stored, SEQS, CACHED, attn=AttentionConfig(mesh=mesh))


def test_round_trip_cli(hf_dir, tmp_path, capsys):
    src, refs = hf_dir
    out = str(tmp_path / "ckpt")
    # --dtype auto stores the checkpoint's own dtype (float32 here); running it applies vLLM's rule later
    assert convert_main(["--model", src, "--out", out, "--tp", "2", "--no-progress"]) == 0
    files = set(os.listdir(out))
    assert {
        MANIFEST,
        "params",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= files
    assert not [f for f in os.listdir(tmp_path) if ".partial-" in f]
    manifest = json.load(open(os.path.join(out, MANIFEST)))
    assert manifest["dtype"] == "float32" and manifest["tensor_parallel_size"] == 2
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "float32"
    assert manifest["format_version"] == 2 and manifest["params"]["layers/1/w_qkv"]["shape"] == [64, 2, 4, 16]
    for tp in (1, 4):  # the mesh it was written for does not matter; tp=4 > 2 kv heads
        for o, r, c in zip(logits(out, tp), refs, CACHED):
            assert np.max(np.abs(o - r[c:])) / np.max(np.abs(r)) <= 1e-4
    cfg = ModelConfig.from_hf(out, dtype="float32")
    for fmt in ("safetensors", "pt"):  # the weights are there, in Orbax: say how to load them
        with pytest.raises(ValueError, match="is a jaxllm \\(Orbax\\) checkpoint, not .* load_format='auto'"):
            load_params(out, cfg, ParallelConfig(1, 1).make_mesh(), load_format=fmt)
    manifest["format_version"] = 1  # a checkpoint of separate wq/wk/wv...: a clear error, never garbage
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match="version 1, but this jaxllm reads 'jaxllm-orbax' version 2.*convert"):
        logits(out, 1)


def test_bf16_and_pp_restore(hf_dir, tmp_path):
    src, _ = hf_dir
    out = convert_checkpoint(src, str(tmp_path / "bf16"), dtype="bfloat16", progress=False)
    cfg = ModelConfig.from_hf(out)
    assert cfg.dtype == "bfloat16"
    mesh = ParallelConfig(4, 2).make_mesh()  # tp=4 > 2 kv heads: restored kv heads are expanded per device
    direct, restored = load_params(src, cfg, mesh), load_params(out, cfg, mesh)
    import jax

    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(restored)):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    slashes = load_params("/" + out, cfg, ParallelConfig(1, 1).make_mesh())  # "//tmp/...": a path Orbax refused
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(slashes)[0]), np.asarray(jax.tree.leaves(restored)[0]))


def _leftovers(parent, name):
    return [f for f in os.listdir(parent) if f == name or ".partial-" in f]


def test_bad_inputs(hf_dir, tmp_path):
    src, _ = hf_dir
    out = str(tmp_path / "o")
    with pytest.raises(ConversionError, match="no such directory"):
        convert_checkpoint(str(tmp_path / "missing"), out)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConversionError, match="no config.json"):
        convert_checkpoint(str(empty), out)
    (empty / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConversionError, match="GPT2LMHeadModel.*not supported"):
        convert_checkpoint(str(empty), out)
    # config.json says one thing, the weights another.
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.load(open(os.path.join(src, "config.json")))
    (bad / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 100}))
    os.symlink(os.path.join(src, "pytorch_model.bin"), bad / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="mlp.down_proj.weight.*has shape \\(64, 96\\)"):
        convert_checkpoint(str(bad), out, progress=False)
    assert not _leftovers(tmp_path, "o")
    (bad / "config.json").write_text(json.dumps(cfg))
    os.remove(bad / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="No weights"):
        convert_checkpoint(str(bad), out)
    with pytest.raises(ConversionError, match="tensor_parallel_size \\(8\\)"):
        convert_checkpoint(src, out, tp=8)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConversionError, match="not empty"):
        convert_checkpoint(src, str(tmp_path / "full"))
    with pytest.raises(ConversionError, match="parent directory .* does not exist"):
        convert_checkpoint(src, str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(ConversionError, match="cannot write|not writable"):
        convert_checkpoint(src, "/proc/jaxllm-ckpt", progress=False)
    assert not _leftovers(tmp_path, "o")
    # --out may not be the source or contain it (--overwrite would delete the checkpoint being converted)
    with pytest.raises(ConversionError, match="would delete the checkpoint being converted"):
        convert_checkpoint(src, src, overwrite=True)
    with pytest.raises(ConversionError, match="would delete the checkpoint being converted"):
        convert_checkpoint(src, os.path.dirname(src), overwrite=True)
    assert os.path.isfile(os.path.join(src, "pytorch_model.bin"))
    # an empty --out survives a failed conversion
    (tmp_path / "empty_out").mkdir()
    with pytest.raises(ConversionError, match="tensor_parallel_size"):
        convert_checkpoint(src, str(tmp_path / "empty_out"), tp=8)
    assert (tmp_path / "empty_out").is_dir()
    # The CLI prints the message and exits 2 rather than a traceback.
    assert convert_main(["--model", str(tmp_path / "missing"), "--out", out]) == 2
