"""A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors / .bin / .pt) -> LoRAAdapter: host
float32 arrays in the decoder's layout, PEFT's scaling folded into B. Everything the engine cannot run exactly is
refused here with a ValueError naming the adapter_config.json field (or the tensor), before any device work.

Layouts (r: the module's rank; shapes as jaxllm/models/params.py lays the base weights out, checkpoint kv heads):

    qkv      A [D, 3, r]  (q, k, v: a fused qkv_proj / W_pack adapter has one A, copied to the three)
             B [r, K, G + 2, H]  (q columns read A's slice 0, k columns slice 1, v columns slice 2)
    o        A [N, H, r]          B [r, D]
    gate_up  A [D, 2, r]          B [r, 2, F]   (gate_up_proj: one A for both)
    down     A [F, r]             B [r, D]
    embed    A [V, r]             B [r, D]      (PEFT's lora_embedding_A / _B)
    lm_head  A [D, r]             B [r, V]

so that a token x adds  (x @ A) @ B  to the projection, per sub-module part, scaling included.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from jaxllm.config import ModelConfig

# PEFT module names -> (our module, parts of it: None for a fused one)
_LAYER_MODULES = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "qkv_proj": ("qkv", None),
    "W_pack": ("qkv", None),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "gate_up_proj": ("gate_up", None),
    "down_proj": ("down", 0),
}
SUPPORTED_MODULES = tuple(_LAYER_MODULES) + ("embed_tokens", "lm_head")
LAYER_KEYS = ("qkv", "o", "gate_up", "down")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_EMBED_RE = re.compile(r"(?:^|\.)embed_tokens\.lora_embedding_([AB])$")
_HEAD_RE = re.compile(r"(?:^|\.)lm_head\.lora_([AB])\.weight$")
# Base weights PEFT saves beside embedding adapters (save_embedding_layers); vLLM skips them too.
_BASE_EMBEDDING_RE = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.base_layer\.weight$")
# adapter_config.json fields that change the math in ways jaxllm does not implement: refused when truthy
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA adapters are not supported (vLLM does not support DoRA either)",
    "modules_to_save": "only modules_to_save being None is supported (as in vLLM)",
    "lora_bias": "LoRA bias terms are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layouts) is not supported by the supported architectures",
    "use_qalora": "QA-LoRA adapters are not supported",
    "use_bdlora": "block-diagonal LoRA adapters are not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) adapters are not supported",
    "trainable_token_indices": "trainable token indices are not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "layer_replication": "layer_replication is not supported",
    "arrow_config": "Arrow routing is not supported",
}


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host: modules[("layers", i, "qkv")] = (A, B) in the layouts above; the rank
    is the largest module rank (rank_pattern may give modules their own)."""

    path: str
    rank: int
    modules: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def read_adapter_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise ValueError(
            f"No adapter found at {path}: lora_path must be a local folder holding a PEFT adapter "
            "(adapter_config.json and adapter_model.safetensors)."
        )
    if not os.path.isfile(cfg_path):
        raise ValueError(f"No adapter found at {path}: it has no adapter_config.json.")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{cfg_path} cannot be read as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object.")
    return cfg


def check_adapter_config(cfg: dict, path: str, max_lora_rank: int) -> None:
    """The config's own refusals (before any tensor is read)."""
    where = os.path.join(path, "adapter_config.json")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"peft_type: {where} is a {peft_type} adapter; only LoRA adapters are supported.")
    for name in ("r", "lora_alpha"):
        v = cfg.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{name}: {where} must give a positive number, got {v!r}.")
    for name, why in _UNSUPPORTED_FIELDS.items():
        if cfg.get(name):
            raise ValueError(f"{name}: {where} sets {name}={cfg[name]!r}; {why}.")
    if cfg.get("bias", "none") != "none":
        raise ValueError(
            f"bias: {where} sets bias={cfg['bias']!r}; adapters with bias terms are not supported "
            "(vLLM: 'Adapter bias cannot be used without bias_enabled')."
        )
    for extra in ("new_embeddings.safetensors", "new_embeddings.bin"):  # tokens trained into the adapter
        if os.path.isfile(os.path.join(path, extra)):
            raise ValueError(
                f"{extra}: {path} adds tokens to the vocabulary; adapters with added tokens are not "
                "supported (the base model's tokenizer and vocabulary are served)."
            )
    ranks = [cfg["r"], *(cfg.get("rank_pattern") or {}).values()]
    if max(ranks) > max_lora_rank:
        raise ValueError(
            f"r: LoRA rank {max(ranks)} is greater than max_lora_rank {max_lora_rank} ({where}); "
            f"start the engine with a larger max_lora_rank (--max-lora-rank)."
        )


def load_adapter(path: str, model: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Reads and checks a PEFT adapter for model (ValueError naming the field on anything it cannot run)."""
    cfg = read_adapter_config(path)
    check_adapter_config(cfg, path, max_lora_rank)
    tensors = _read_tensors(path)
    parsed, unknown = {}, []
    for name, x in tensors.items():
        if _BASE_EMBEDDING_RE.search(name):
            continue
        m = _LAYER_RE.search(name)
        if m and m.group(2) in _LAYER_MODULES:
            parsed[name] = (("layers", int(m.group(1)), m.group(2)), m.group(3), x)
        elif (m := _EMBED_RE.search(name)) is not None:
            parsed[name] = (("embed",), m.group(1), x)
        elif (m := _HEAD_RE.search(name)) is not None:
            parsed[name] = (("lm_head",), m.group(1), x)
        else:
            unknown.append(name)
    if unknown:
        shown = sorted(
            {re.sub(r"\.(lora_\w+|weight|bias)$", "", re.sub(r"\.lora_\w+\.weight$", "", n)) for n in unknown}
        )
        raise ValueError(
            f"target_modules: while loading {path}, expected target modules in {list(SUPPORTED_MODULES)} "
            f"but received {shown[:8]}. Please verify that the loaded LoRA module is correct."
        )
    if not parsed:
        raise ValueError(f"target_modules: {path} holds no LoRA weights.")
    # (module key, peft module name) -> {"A": x, "B": x}
    pairs: dict[tuple, dict[str, np.ndarray]] = {}
    for name, (key, ab, x) in parsed.items():
        module_name = name.rsplit(".lora_", 1)[0].removeprefix("base_model.model.")
        pairs.setdefault((key, module_name), {})[ab] = np.asarray(x, np.float32)
    adapter = LoRAAdapter(path, 0)
    builders: dict[tuple, _Builder] = {}
    for (key, module_name), ab in sorted(pairs.items(), key=lambda kv: str(kv[0])):
        if set(ab) != {"A", "B"}:
            raise ValueError(
                f"target_modules: {path} has lora_{'B' if 'A' in ab else 'A'} but no "
                f"lora_{'A' if 'A' in ab else 'B'} for {module_name}."
            )
        a, b = ab["A"], ab["B"]  # [r, in], [out, r] (lora_embedding_A [r, V] reads the token's column)
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != r:
            raise ValueError(
                f"base_model_name_or_path: {module_name}'s lora_A {a.shape} and lora_B {b.shape} "
                f"do not form a LoRA pair ({path})."
            )
        if r > max_lora_rank:
            raise ValueError(
                f"r: LoRA rank {r} is greater than max_lora_rank {max_lora_rank} ({module_name} in "
                f"{path}); start the engine with a larger max_lora_rank (--max-lora-rank)."
            )
        scale = _scaling(cfg, module_name, r)
        if key[0] == "layers":
            i, peft_name = key[1], key[2]
            if i >= model.num_layers:
                raise _mismatch(cfg, path, f"it adapts layer {i}, but the model has {model.num_layers} layers")
            ours, part = _LAYER_MODULES[peft_name]
            if ours in ("gate_up", "down") and model.layer_kind(i).moe:
                raise ValueError(
                    f"target_modules: {module_name} in {path}: layer {i} of this model is a mixture of "
                    "experts, whose MLP takes no LoRA adapter in jaxllm (attention modules can)."
                )
            b_key = ("layers", i, ours)
            builders.setdefault(b_key, _Builder(ours, model)).add(part, a, b * scale, module_name, cfg, path)
        else:
            builders.setdefault(key, _Builder(key[0], model)).add(0, a, b * scale, module_name, cfg, path)
    for key, builder in builders.items():
        adapter.modules[key] = builder.build()
        adapter.rank = max(adapter.rank, builder.rank)
    return adapter


def _scaling(cfg: dict, module_name: str, r: int) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; alpha_pattern may set a module's
    alpha (PEFT matches its keys against the module name's tail)."""
    alpha = cfg["lora_alpha"]
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            alpha = value
            break
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _mismatch(cfg: dict, path: str, what: str) -> ValueError:
    base = cfg.get("base_model_name_or_path")
    trained = f" (trained on {base!r})" if base else ""
    return ValueError(f"base_model_name_or_path: the adapter at {path}{trained} does not fit this model: {what}.")


class _Builder:
    """Gathers one of our modules' parts (q, k, v or gate, up) into the layouts of the module docstring."""

    def __init__(self, key: str, model: ModelConfig):
        self.key, self.cfg = key, model
        self.parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.rank = 0

    def add(self, part, a, b, module_name, adapter_cfg, path):
        c = self.cfg
        D, N, K, H, F, V = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size
        q, kv = N * H, K * H
        ins = {"qkv": D, "o": N * H, "gate_up": D, "down": F, "embed": V, "lm_head": D}[self.key]
        outs = {"qkv": [q, kv, kv], "o": [D], "gate_up": [F, F], "down": [D], "embed": [D], "lm_head": [V]}[self.key]
        want_out = sum(outs) if part is None else outs[part]
        if a.shape[1] != ins or b.shape[0] != want_out:
            if self.key == "embed":
                what = (
                    f"The embedding LoRA size({a.shape[1]}) must be consistent with the base model's vocabulary "
                    f"size({V})"
                    if a.shape[1] != V
                    else f"its embedding B has {b.shape[0]} rows, not {D}"
                )
            else:
                what = (
                    f"{module_name} maps {a.shape[1]} -> {b.shape[0]} features, but the model's takes {ins} -> "
                    f"{want_out}"
                )
            raise _mismatch(adapter_cfg, path, what)
        if part is None:  # fused: one A for every part, B's rows split between them
            splits = np.cumsum(outs)[:-1]
            for j, bj in enumerate(np.split(b, splits)):
                self._put(j, a, bj, module_name, path)
        else:
            self._put(part, a, b, module_name, path)

    def _put(self, part, a, b, module_name, path):
        if part in self.parts:
            raise ValueError(f"target_modules: {path} adapts {module_name} twice (a fused and a separate module).")
        self.parts[part] = (a, b)
        self.rank = max(self.rank, a.shape[0])

    def build(self) -> tuple[np.ndarray, np.ndarray]:
        c, r = self.cfg, self.rank
        N, K, H, D, F = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size
        G = N // K

        def a_col(j):  # [in, r] of part j, zero-padded to the module's rank
            a = self.parts[j][0] if j in self.parts else None
            return _pad_rank(a.T, r, 1) if a is not None else None

        def b_row(j):  # [r, out] of part j
            b = self.parts[j][1] if j in self.parts else None
            return _pad_rank(b.T, r, 0) if b is not None else None

        if self.key == "qkv":
            A = np.zeros((D, 3, r), np.float32)
            B = np.zeros((r, K, G + 2, H), np.float32)
            for j in range(3):
                if j in self.parts:
                    A[:, j] = a_col(j)
                    bj = b_row(j).reshape(r, K, -1, H)  # q rows: head n = k * G + g; k, v rows: head k
                    B[:, :, slice(0, G) if j == 0 else slice(G + j - 1, G + j)] = bj
            return A, B
        if self.key == "gate_up":
            A = np.zeros((D, 2, r), np.float32)
            B = np.zeros((r, 2, F), np.float32)
            for j in range(2):
                if j in self.parts:
                    A[:, j], B[:, j] = a_col(j), b_row(j)
            return A, B
        A, B = a_col(0), b_row(0)
        if self.key == "o":
            A = A.reshape(N, H, r)
        return A, B


def _pad_rank(x: np.ndarray, r: int, axis: int) -> np.ndarray:
    pad = r - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return np.pad(x, widths)


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """adapter_model.safetensors, else adapter_model.bin / .pt (torch), as float32 numpy (vLLM's file order)."""
    from jaxllm.models.checkpoint_files import CheckpointReader

    for name in ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            reader = CheckpointReader.for_files([file])
            try:
                return {k: np.asarray(reader.get(k), np.float32) for k in reader.keys()}
            except Exception as e:  # noqa: BLE001 - a corrupt file: name it, not the parser
                raise ValueError(f"Cannot read LoRA weights from {file}: {type(e).__name__}: {e}") from None
    raise ValueError(f"{path} doesn't contain tensors (adapter_model.safetensors or adapter_model.bin).")
