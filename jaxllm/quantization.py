"""QuantConfig: how a checkpoint's linear layers are quantized, read once from config.json's quantization_config
(or the `quantization=` argument), with vLLM's method names and messages. Host side: no jax here.

One implementation per format, whatever name selects it (vLLM's kernels differ, the format does not):
    gptq, gptq_marlin          -> gptq                (GPTQ v1 / gptq_v2, 4 / 8 bits, act-order)
    awq, awq_marlin            -> awq                 (AWQ GEMM, 4 bits)
    compressed-tensors         -> compressed-tensors  (llm-compressor: W4A16 / W8A16, FP8 and INT8 W8A8)
    fp8                        -> fp8                 (a serialized fp8 checkpoint, or a 16-bit one quantized while
                                                       loading: vLLM's dynamic FP8)
How the weights are laid out in memory once loaded: jaxllm/models/quant.py.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

# vLLM's method names -> our implementation.
METHODS = {
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "compressed-tensors": "compressed-tensors",
    "fp8": "fp8",
}
# Files older GPTQ / AWQ exports keep the config in (vLLM's get_quant_config reads them too).
SIDE_CONFIG_FILES = ("quantize_config.json", "quant_config.json")


@dataclass(frozen=True)
class QuantConfig:
    method: str  # gptq | awq | compressed-tensors | fp8
    weight_type: str = "int"  # int | float (fp8 e4m3)
    bits: int = 4  # 4 | 8
    group_size: int = -1  # input rows per scale; -1: one group over the whole input (per output channel)
    symmetric: bool = True  # no stored zero points: the zero is 2 ** (bits - 1) (int) or 0 (float)
    act_order: bool = False  # GPTQ desc_act / compressed-tensors actorder: a g_idx tensor names each row's group
    zero_offset: int = 0  # GPTQ v1 stores zero - 1 (1 here), gptq_v2 and the others the zero itself
    activations: str | None = None  # None: weight-only; "dynamic": per-token fp8 / int8; "static": per-tensor scale
    serialized: bool = True  # False: a 16-bit checkpoint quantized to fp8 while loading (quantization="fp8")
    ignore: tuple[str, ...] = ()  # HF module names (or "re:" patterns) the checkpoint keeps unquantized
    source: str = "config.json"  # where the config came from, for error messages

    @property
    def pack_factor(self) -> int:
        """Integer values per int32 word of the packed weight (jaxllm/models/quant.py)."""
        return 32 // self.bits

    def is_ignored(self, module: str) -> bool:
        """True if the HF module (e.g. model.layers.0.mlp.down_proj) is kept unquantized: an "re:" pattern matches it
        from its start; a name matches whole module names in it, anywhere ("down_proj", "layers.1.mlp",
        "model.layers.1.mlp" and the whole name each match model.layers.1.mlp.down_proj; "layers.1" does not match
        layers.10). vLLM's AWQ tests a substring and HF a prefix or suffix; the checkpoint's tensors then decide:
        a module found dense that the config quantizes, or the reverse, is refused by the loader."""
        dotted = f".{module}."
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif f".{pattern.strip('.')}." in dotted:
                return True
        return False

    def describe(self) -> str:
        if self.weight_type == "float":
            act = {
                None: "weight-only",
                "dynamic": "dynamic per-token activations",
                "static": "static activation scales",
            }[self.activations]
            return f"{self.method} fp8 ({act})"
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        acts = ", int8 activations" if self.activations else ""
        return f"{self.method} int{self.bits} ({group}, {'sym' if self.symmetric else 'asym'}{acts})"


def resolve_quantization(
    hf: dict[str, Any],
    quantization: str | None,
    model_dir: str | None = None,
) -> QuantConfig | None:
    """The QuantConfig of a checkpoint: config.json's quantization_config (or an older side file), checked against
    an explicit quantization argument as vLLM does; None for an unquantized model run unquantized."""
    if quantization is not None and quantization not in METHODS:
        raise ValueError(f"Unknown quantization method: {quantization}. Must be one of {list(METHODS)}.")
    qc, source = hf.get("quantization_config"), "config.json quantization_config"
    if not qc and model_dir and quantization not in (None, "fp8"):
        for name in SIDE_CONFIG_FILES:
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                with open(path) as f:
                    qc, source = json.load(f), name
                qc.setdefault("quant_method", METHODS[quantization])
                break
    if not qc:
        if quantization is None:
            return None
        if quantization == "fp8":  # vLLM's dynamic FP8: quantize a 16-bit checkpoint while loading
            return QuantConfig(
                method="fp8",
                weight_type="float",
                bits=8,
                activations="dynamic",
                serialized=False,
                source="quantization='fp8'",
            )
        article = "an" if quantization[:1] in ("a", "e", "i", "o", "u") else "a"
        raise ValueError(
            f"quantization={quantization!r}, but the checkpoint has no quantization_config in "
            f"config.json (nor {' / '.join(SIDE_CONFIG_FILES)}): it is not {article} {quantization} checkpoint."
        )
    if not isinstance(qc, dict):
        raise ValueError(f"{source} must be an object, got {qc!r}.")
    method = qc.get("quant_method")
    if isinstance(method, str):
        method = method.lower()
    if method not in ("gptq", "awq", "compressed-tensors", "fp8"):
        raise ValueError(
            f"{source}.quant_method={method!r} is not supported; jaxllm loads gptq, awq, "
            f"compressed-tensors and fp8 checkpoints."
        )
    if quantization is not None and METHODS[quantization] != method:
        raise ValueError(
            f"Quantization method specified in the model config ({method}) does not match the "
            f"quantization method specified in the `quantization` argument ({quantization})."
        )
    parse = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": _fp8}[method]
    return parse(qc, source)


def _get(qc: dict, key: str, source: str, allowed=None, default=None, required: bool = False):
    if key not in qc or qc[key] is None:
        if required:
            raise ValueError(f"{source} has no {key!r}, which jaxllm needs.")
        return default
    value = qc[key]
    if allowed is not None and value not in allowed:
        raise ValueError(f"{source}.{key}={value!r} is not supported; use one of {list(allowed)}.")
    return value


def _group_size(qc: dict, source: str, key: str = "group_size") -> int:
    g = _get(qc, key, source, default=-1)
    if isinstance(g, bool) or not isinstance(g, int) or not (g == -1 or g > 0 and g % 8 == 0):
        raise ValueError(f"{source}.{key}={g!r} is not supported; use -1 (one group) or a positive multiple of 8.")
    return g


def _gptq(qc: dict, source: str) -> QuantConfig:
    bits = _get(qc, "bits", source, (4, 8), required=True)
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    key = "checkpoint_format" if qc.get("checkpoint_format") else "format"
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{source}.{key}={fmt!r} is not supported; use 'gptq' (v1) or 'gptq_v2'.")
    if qc.get("lm_head"):
        raise ValueError(f"{source}.lm_head=true (a quantized lm_head) is not supported.")
    if qc.get("dynamic"):
        raise ValueError(f"{source}.dynamic (per-module overrides) is not supported.")
    return QuantConfig(
        method="gptq",
        bits=bits,
        group_size=_group_size(qc, source),
        symmetric=bool(_get(qc, "sym", source, (True, False), default=True)),
        act_order=bool(_get(qc, "desc_act", source, (True, False), default=False)),
        zero_offset=1 if fmt == "gptq" else 0,
        ignore=tuple(qc.get("modules_to_not_convert") or ()),
        source=source,
    )


def _awq(qc: dict, source: str) -> QuantConfig:
    bits = _get(qc, "bits", source, (4,), default=qc.get("w_bit"))
    if bits is None:
        raise ValueError(f"{source} has no 'bits', which jaxllm needs.")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{source}.version={version!r} is not supported; jaxllm reads AWQ's GEMM layout ('gemm').")
    g = _group_size(qc, source, "group_size" if "group_size" in qc else "q_group_size")
    return QuantConfig(
        method="awq",
        bits=4,
        group_size=g,
        symmetric=not bool(qc.get("zero_point", True)),
        ignore=tuple(qc.get("modules_to_not_convert") or ()),
        source=source,
    )


def _fp8(qc: dict, source: str) -> QuantConfig:
    act = _get(qc, "activation_scheme", source, ("dynamic", "static"), default="dynamic")
    if qc.get("weight_block_size"):
        raise ValueError(f"{source}.weight_block_size={qc['weight_block_size']!r} (block-wise fp8) is not supported.")
    ignore = tuple(qc.get("ignored_layers") or ()) + tuple(qc.get("modules_to_not_convert") or ())
    return QuantConfig(method="fp8", weight_type="float", bits=8, activations=act, ignore=ignore, source=source)


def _compressed_tensors(qc: dict, source: str) -> QuantConfig:
    if qc.get("sparsity_config"):
        raise ValueError(f"{source}.sparsity_config (sparse compressed-tensors) is not supported.")
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"{source}.kv_cache_scheme (checkpoint KV-cache scales) is not supported.")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(
            f"{source}.config_groups has {len(groups)} schemes; jaxllm supports exactly one scheme "
            "for all Linear layers."
        )
    ((name, group),) = groups.items()
    where = f"{source}.config_groups.{name}"
    targets = group.get("targets") or []
    if "Linear" not in targets:
        raise ValueError(f"{where}.targets={targets!r} is not supported; jaxllm supports schemes targeting 'Linear'.")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ValueError(f"{where}.weights is missing: jaxllm needs a weight scheme.")
    fmt = group.get("format") or qc.get("format")
    wtype = _get(w, "type", f"{where}.weights", ("int", "float"), default="int")
    bits = _get(w, "num_bits", f"{where}.weights", (4, 8) if wtype == "int" else (8,), required=True)
    strategy = _get(
        w,
        "strategy",
        f"{where}.weights",
        ("group", "channel") if wtype == "int" else ("tensor", "channel"),
        required=True,
    )
    if w.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic=true is not supported (weights must carry their scales).")
    group_size = _group_size(w, f"{where}.weights") if strategy == "group" else -1
    symmetric = bool(w.get("symmetric", True))
    # Only actorder "group" (alias "dynamic"; true in older configs) stores weight_g_idx, as vLLM reads it; "weight"
    # (alias "static") orders GPTQ's passes but writes plain groups.
    act_order = w.get("actorder") in (True, "group", "dynamic")
    a = group.get("input_activations")
    activations = None
    if wtype == "float":
        if fmt != "float-quantized":
            raise ValueError(f"{where}.format={fmt!r} is not supported for fp8 weights; use 'float-quantized'.")
        if not symmetric:
            raise ValueError(f"{where}.weights.symmetric=false is not supported for fp8 weights.")
    elif bits == 4 or a is None:
        if fmt != "pack-quantized":
            raise ValueError(f"{where}.format={fmt!r} is not supported for W{bits}A16; use 'pack-quantized'.")
    elif fmt != "int-quantized":
        raise ValueError(f"{where}.format={fmt!r} is not supported for INT8 W8A8; use 'int-quantized'.")
    if a is not None:
        where_a = f"{where}.input_activations"
        _get(a, "num_bits", where_a, (8,), required=True)
        if _get(a, "type", where_a, ("int", "float"), default="int") != wtype:
            raise ValueError(
                f"{where_a}.type={a.get('type')!r} differs from the weights' type {wtype!r}; "
                "jaxllm supports W8A8 with both int or both float."
            )
        if bits != 8:
            raise ValueError(f"{where_a}: activation quantization needs 8-bit weights, got num_bits={bits}.")
        dynamic = bool(a.get("dynamic", False))
        strategies = ("token",) if dynamic else ("tensor",)
        _get(a, "strategy", where_a, strategies, required=True)
        if wtype == "int" and not dynamic:
            raise ValueError(f"{where_a}.dynamic=false (static INT8 activation scales) is not supported.")
        if not a.get("symmetric", True):
            raise ValueError(f"{where_a}.symmetric=false is not supported.")
        activations = "dynamic" if dynamic else "static"
    return QuantConfig(
        method="compressed-tensors",
        weight_type=wtype,
        bits=bits,
        group_size=group_size,
        symmetric=symmetric or wtype == "float",
        act_order=act_order,
        activations=activations,
        ignore=tuple(qc.get("ignore") or ()),
        source=source,
    )
