"""EAGLE and EAGLE-3 heads: which method a checkpoint is, its config, its weights (the public checkpoints' layout)
and how they are sharded. The head's forward pass is drafter.py's.

Checkpoint layouts, as published (yuhuili/EAGLE-LLaMA3-Instruct-8B, yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) and read
by vLLM (model_executor/models/llama_eagle.py, llama_eagle3.py):
- EAGLE: a Llama config with num_hidden_layers 1 ("architectures": ["LlamaForCausalLM"], optional "bias" for
  fc); tensors fc.weight [D, 2D] (+ fc.bias), layers.0.self_attn.{q,k,v,o}_proj.weight,
  layers.0.post_attention_layernorm.weight, layers.0.mlp.{gate,up,down}_proj.weight, and embed_tokens.weight (a
  copy of the target's, which is used instead). Layer 0 has no input norm; its input is fc([embedding, feature])
  with the target's final-normed hidden state as the feature; the target's output head reads the layer's output.
- EAGLE-3: "architectures": ["LlamaForCausalLMEagle3"], draft_vocab_size; tensors midlayer.self_attn.* (q, k, v
  over 2D inputs), midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight, midlayer.mlp.*,
  norm.weight, fc.weight [D, 3 D_target], lm_head.weight [draft vocab, D], d2t [draft vocab] (target id = draft
  id + d2t[id]) and t2d (unused); no embeddings (the target's). Features: the target's hidden states entering
  layers (2, L // 2, L - 3) (vLLM's default; eagle_aux_hidden_state_layer_ids in the config overrides).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jaxllm.config import ModelConfig, read_hf_config
from jaxllm.models.checkpoint_files import CheckpointReader
from jaxllm.models.loader import (
    _fuse_gate_up,
    _fuse_qkv,
    _out_heads,
    _transpose,
)
from jaxllm.models.params import ParamSpec, is_spec, param_shardings, param_specs

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_LAYER = {  # our layer weight -> (tensor names under the layer's prefix, hook)
    "attn_norm": (("input_layernorm.weight",), None),
    "w_qkv": (tuple(f"self_attn.{p}_proj.weight" for p in "qkv"), _fuse_qkv),
    "wo": (("self_attn.o_proj.weight",), _out_heads),
    "mlp_norm": (("post_attention_layernorm.weight",), None),
    "w_gate_up": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), _fuse_gate_up),
    "w_down": (("mlp.down_proj.weight",), _transpose),
}


def detect_method(model_dir: str) -> str:
    """vLLM's speculative_config without "method": the drafter's own files decide (EAGLE-3 by architecture or
    its midlayer tensors, EAGLE by its fc tensor, otherwise a draft model)."""
    hf = read_hf_config(model_dir)
    if set(hf.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES):
        return "eagle3"
    names = _tensor_names(model_dir)
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    return "eagle" if "fc.weight" in names else "draft_model"


def _tensor_names(model_dir: str) -> set[str]:
    try:
        return {_strip(n) for n in CheckpointReader(model_dir).keys()}
    except ValueError:  # no weight files (load_format="dummy" drafts): only the config can tell
        return set()


def _strip(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def head_config(model_dir: str, method: str, dtype: str) -> tuple[ModelConfig, dict]:
    """The head's ModelConfig (one Llama layer; its attention shapes and RoPE) and its raw config."""
    hf = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(dict(hf, architectures=["LlamaForCausalLM"], num_hidden_layers=1), dtype=dtype)
    if method == "eagle3" and hf.get("draft_vocab_size") is None:
        hf = dict(hf, draft_vocab_size=hf["vocab_size"])
    return cfg, hf


def feature_layers(hf: dict, target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's feature layers: the config's, else vLLM's default (2, L // 2, L - 3)."""
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    layers = tuple(ids) if ids else (2, target_layers // 2, target_layers - 3)
    if not layers or not all(0 <= i < target_layers for i in layers):
        raise ValueError(
            f"EAGLE-3 feature layers {layers} do not fit a target of {target_layers} layers "
            "(eagle_aux_hidden_state_layer_ids, or a target with at least 4 layers)."
        )
    return layers


def head_specs(method: str, cfg: ModelConfig, hf: dict, target_hidden: int, tp: int) -> dict:
    """The head's params pytree as ParamSpecs (its layer sharded over tp as a target layer is)."""
    D = cfg.hidden_size
    layer = dict(param_specs(cfg, tp)["layers"][0])
    specs: dict = {}
    if method == "eagle":
        del layer["attn_norm"]  # layer 0 of an EAGLE head has no input norm
        specs["fc"] = ParamSpec((2 * D, D), (None, "embed"))
        if hf.get("bias"):
            specs["fc_bias"] = ParamSpec((D,), ("embed",), "zeros")
    else:
        qkv = layer["w_qkv"]
        layer["w_qkv"] = ParamSpec((2 * D,) + qkv.shape[1:], qkv.axes, kv_repeat=qkv.kv_repeat)
        n = len(
            hf.get("eagle_aux_hidden_state_layer_ids")
            or (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            or (0, 0, 0)
        )
        specs["fc"] = ParamSpec((n * hf.get("target_hidden_size", target_hidden), D), (None, "embed"))
        specs["hidden_norm"] = ParamSpec((D,), ("embed",), "ones")
        specs["final_norm"] = ParamSpec((D,), ("embed",), "ones")
        specs["lm_head"] = ParamSpec((hf["draft_vocab_size"], D), (None, "embed"))
        specs["d2t"] = ParamSpec((hf["draft_vocab_size"],), (None,), "zeros", dtype="int32")
    specs["layer"] = layer
    return specs


def _host_weights(reader: CheckpointReader, method: str, cfg: ModelConfig, specs: dict) -> dict:
    """Our path -> host array, from the checkpoint's names (a leading "model." is accepted)."""
    names = {_strip(n): n for n in reader.keys()}
    prefix = "layers.0." if method == "eagle" else "midlayer."

    def get(name):
        if name not in names:
            raise ValueError(f"The {method} head checkpoint is missing tensor {name!r}.")
        return reader.get(names[name])

    out = {}
    for key in specs["layer"]:
        hf_names, hook = _LAYER[key]
        raw = [get(prefix + n) for n in hf_names]
        out[("layer", key)] = raw[0] if hook is None else hook(*raw, cfg)
    out[("fc",)] = get("fc.weight").T
    if "fc_bias" in specs:
        out[("fc_bias",)] = get("fc.bias")
    if method == "eagle3":
        out[("hidden_norm",)] = get(prefix + "hidden_norm.weight")
        out[("final_norm",)] = get("norm.weight")
        out[("lm_head",)] = get("lm_head.weight")
        out[("d2t",)] = get("d2t") if "d2t" in names else np.zeros(specs["d2t"].shape, np.int64)
    return out


def load_head(
    model_dir: str,
    method: str,
    cfg: ModelConfig,
    hf: dict,
    target_hidden: int,
    mesh,
    load_format: str = "auto",
    seed: int = 0,
):
    """The head's params, created sharded over mesh (load_format="dummy": random weights, d2t zero)."""
    import jax.numpy as jnp

    from jaxllm.models.params import dummy_params
    from jaxllm.sharding import mesh_tp

    specs = head_specs(method, cfg, hf, target_hidden, mesh_tp(mesh))
    shardings = param_shardings(specs, mesh)
    dtype = jnp.dtype(cfg.dtype)
    if load_format == "dummy":
        return dummy_params(specs, dtype, shardings, seed=seed)
    if not os.path.isdir(model_dir):
        raise ValueError(f"speculative_config model {model_dir!r} is not a directory.")
    host = _host_weights(CheckpointReader(model_dir, load_format), method, cfg, specs)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    flat_sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    leaves = []
    for (path, spec), sharding in zip(flat, flat_sh, strict=True):
        key = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)
        x = spec.expand(np.asarray(host[key]).astype(spec.checkpoint_dtype or dtype))
        if x.shape != spec.shape:
            raise ValueError(
                f"The {method} head's {'/'.join(map(str, key))} has shape {x.shape}; its config gives {spec.shape}."
            )
        leaves.append(jax.make_array_from_callback(x.shape, sharding, lambda idx, h=x: h[idx]))
    return jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_spec), leaves)
