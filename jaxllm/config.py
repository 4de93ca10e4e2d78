"""ModelConfig: the model's shape and options, read once from an HF config.json.

Shape letters used across jaxllm: T tokens, D model, N q heads, K kv heads, G = N // K q heads per kv head,
H head dim, F ffn, V vocab, L layers, P pages, S page size, B sequences.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxllm.quantization import QuantConfig, resolve_quantization

# HF architectures name -> our family. Baichuan's two spellings: 7B "BaiChuan", 13B / Baichuan2 "Baichuan".
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "BaiChuanForCausalLM": "baichuan",
    "BaichuanForCausalLM": "baichuan",
}

DTYPES = {
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float": "float32",
}

ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """[H/2] float64 inverse frequencies, with Llama-3.1's frequency-dependent scaling if configured."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type != "llama3":
            return inv
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * np.pi / inv
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return np.where(mid, (1 - smooth) * scaled / self.factor + smooth * scaled, scaled)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # llama | mistral | qwen2 | baichuan
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    position_embedding: str = "rope"  # rope | alibi
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    fused_qkv: bool = False  # Baichuan's W_pack checkpoint layout
    normalize_lm_head: bool = False  # Baichuan2's NormHead
    dtype: str = "bfloat16"  # compute/param dtype: float16 | bfloat16 | float32
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    quantization: QuantConfig | None = None  # quantized linear layers (jaxllm/quantization.py)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, config: str | os.PathLike | dict[str, Any], dtype: str = "auto",
                quantization: str | None = None) -> ModelConfig:
        """Reads a model directory, a config.json path, or its dict. Unsupported options raise ValueError
        naming the field. quantization: vLLM's argument (None: config.json's quantization_config decides)."""
        hf = read_hf_config(config)
        archs = hf.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise ValueError(
                f"architectures={archs!r} is not supported; jaxllm supports {sorted(ARCHITECTURES)}."
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu').")
        D = _require(hf, "hidden_size")
        N = _require(hf, "num_attention_heads")
        K = hf.get("num_key_value_heads") or N
        head_dim = hf.get("head_dim") or D // N
        if N % K:
            raise ValueError(f"num_attention_heads={N} is not a multiple of num_key_value_heads={K}.")
        kw: dict[str, Any] = dict(
            architecture=family,
            vocab_size=_require(hf, "vocab_size"),
            hidden_size=D,
            intermediate_size=_require(hf, "intermediate_size"),
            num_layers=_require(hf, "num_hidden_layers"),
            num_heads=N,
            num_kv_heads=K,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", hf.get("rms_norm_eps", 1e-6))),
            max_position_embeddings=int(
                hf.get("max_position_embeddings") or hf.get("model_max_length") or 4096
            ),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=resolve_dtype(dtype, hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos := hf.get("eos_token_id"), list) else eos,
            quantization=resolve_quantization(hf, quantization, None if isinstance(config, dict) else _dir(config)),
        )
        if family in ("llama", "mistral"):
            kw["qkv_bias"] = kw["o_bias"] = bool(hf.get("attention_bias", False))
            kw["mlp_bias"] = bool(hf.get("mlp_bias", False))
            kw["rope"] = _rope_config(hf)
        if family == "mistral":
            kw["sliding_window"] = hf.get("sliding_window")
        if family == "qwen2":
            kw["qkv_bias"] = True
            kw["rope"] = _rope_config(hf)
            if hf.get("use_sliding_window"):
                raise ValueError("use_sliding_window=True (Qwen2 per-layer sliding windows) is not supported.")
        if family == "baichuan":
            # vLLM's rule: the 13B models (hidden 5120) use ALiBi, the 7B ones RoPE. Baichuan2 (vocab
            # 125696) normalises lm_head rows.
            kw["fused_qkv"] = True
            kw["position_embedding"] = "alibi" if D == 5120 or hf.get("position_embedding") == "alibi" else "rope"
            kw["rope"] = _rope_config(hf)
            kw["normalize_lm_head"] = kw["vocab_size"] == 125696
        return cls(**kw)


def resolve_dtype(dtype: str, hf: dict[str, Any]) -> str:
    """vLLM's dtype rule: "auto" takes the checkpoint's dtype, except that float32 checkpoints run in bf16."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of auto, {', '.join(DTYPES)}.")
        return DTYPES[dtype]
    stored = stored_dtype(hf)
    return "bfloat16" if stored == "float32" else stored


def stored_dtype(hf: dict[str, Any]) -> str:
    """The dtype config.json says the weights are stored in (bfloat16 when it says nothing usable)."""
    stored = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").replace("torch.", "")
    return DTYPES.get(stored, "bfloat16")


def _rope_config(hf: dict[str, Any]) -> RopeConfig:
    # transformers < 5 writes rope_theta + rope_scaling; transformers 5 writes rope_parameters.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params.update(scaling)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; use one of {ROPE_TYPES}.")
    if rope_type == "dynamic":
        # Dynamic NTK changes frequencies with the sequence length; within the original context it is
        # plain RoPE, which is what we run. Longer contexts are refused by max_model_len.
        rope_type = "default"
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def read_hf_config(config: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"No config.json found at {path}.")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None


def _dir(config: str | os.PathLike) -> str:
    path = os.fspath(config)
    return path if os.path.isdir(path) else os.path.dirname(path)


def _require(hf: dict[str, Any], key: str):
    if key not in hf or hf[key] is None:
        raise ValueError(f"config.json has no {key!r}, which jaxllm needs.")
    return hf[key]
