"""ModelConfig: the model's shape and options, read once from an HF config.json.

Shape letters used across jaxllm: T tokens, D model, N q heads, K kv heads, G = N // K q heads per kv head,
H head dim, F ffn, V vocab, L layers, P pages, S page size, B sequences.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from jaxllm.quantization import QuantConfig, resolve_quantization
from jaxllm.rope import RopeConfig, rope_config

# HF architectures name -> our family. Baichuan's two spellings: 7B "BaiChuan", 13B / Baichuan2 "Baichuan".
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "BaiChuanForCausalLM": "baichuan",
    "BaichuanForCausalLM": "baichuan",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# hidden_act / hidden_activation values -> the activation we run. gelu_pytorch_tanh is GELU's tanh approximation
# (Gemma); gelu_new and gelu_fast are the same function.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}

DTYPES = {
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float": "float32",
}


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): each token runs top_k of num_experts SwiGLU
    experts of width intermediate_size, weighted by the router's softmax probabilities (renormalised over the
    top_k when norm_topk_prob). Qwen2-MoE adds a shared expert (width shared_intermediate_size) gated by
    sigmoid(x . w). Layers listed in dense_layers run the ordinary MLP instead."""

    num_experts: int  # E
    top_k: int
    intermediate_size: int  # F of one expert
    norm_topk_prob: bool = True
    shared_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class LayerKind:
    """What can differ between the layers of one model (a static argument of the layer's trace: layers of the
    same kind share it). sliding_window None: global attention. attn_scale: what q.k is multiplied by, RoPE's
    attention factor included (YaRN scales cos and sin, so q and k, by it; the kernels take it as this scale)."""

    attn_scale: float
    sliding_window: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    moe: bool = False


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a value of ARCHITECTURES
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
    hidden_act: str = "silu"  # silu | gelu_tanh (the MLP's gate activation)
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w), in float32
    sandwich_norm: bool = False  # Gemma 2/3: attention and MLP outputs are normed too, before the residual add
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(D) (rounded to dtype)
    query_scale: float | None = None  # attention score scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    layer_types: tuple[str, ...] | None = None  # per layer sliding_attention | full_attention; None: all alike
    rope_local: RopeConfig | None = None  # Gemma 3: the RoPE of sliding-window layers
    moe: MoeConfig | None = None
    expert_parallel: bool = False  # a run-time choice (vLLM's enable_expert_parallel): experts split over tp

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attn_scale(self) -> float:
        """The score scale before RoPE's attention factor (LayerKind.attn_scale is the one a layer runs)."""
        return self.head_dim**-0.5 if self.query_scale is None else self.query_scale

    def layer_kind(self, i: int) -> LayerKind:
        sliding = self.layer_types is None or self.layer_types[i] == "sliding_attention"
        rope = self.rope_local if sliding and self.rope_local is not None else self.rope
        rope_factor = rope.attention_factor if self.position_embedding == "rope" else 1.0
        return LayerKind(
            attn_scale=self.attn_scale * rope_factor * rope_factor,
            sliding_window=self.sliding_window if sliding else None,
            rope=rope,
            moe=self.moe is not None and i not in self.moe.dense_layers,
        )

    def derived_max_model_len(self) -> tuple[int, str]:
        """vLLM's _get_and_verify_max_len: max_position_embeddings times rope_scaling's factor (yarn:
        original_max_position_embeddings times it), except for llama3 scaling and Gemma 3, whose
        max_position_embeddings already counts it. Returns the length and what it was derived from."""
        rope, length, key = self.rope, self.max_position_embeddings, "max_position_embeddings"
        if self.architecture == "gemma3" or rope.rope_type == "llama3":
            return length, f"{key}={length}"
        if rope.rope_type == "yarn":
            length, key = rope.original_max_position_embeddings, "original_max_position_embeddings"
        elif rope.factor == 1.0:
            return length, f"{key}={length}"
        return int(length * rope.factor), f"{key}={length} times rope_scaling factor {rope.factor}"

    @classmethod
    def from_hf(
        cls,
        config: str | os.PathLike | dict[str, Any],
        dtype: str = "auto",
        quantization: str | None = None,
        model_dir: str | None = None,
    ) -> ModelConfig:
        """Reads a model directory, a config.json path, or its dict. Unsupported options raise ValueError
        naming the field. quantization: vLLM's argument (None: config.json's quantization_config decides);
        model_dir: where a dict came from (older checkpoints keep their quantization config in a side file)."""
        hf = read_hf_config(config)
        archs = hf.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise ValueError(f"architectures={archs!r} is not supported; jaxllm supports {sorted(ARCHITECTURES)}.")
        act_key = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
        act = hf.get(act_key) or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"{act_key}={act!r} is not supported (use one of {sorted(ACTIVATIONS)}).")
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
            max_position_embeddings=int(hf.get("max_position_embeddings") or hf.get("model_max_length") or 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=resolve_dtype(dtype, hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos := hf.get("eos_token_id"), list) else eos,
            quantization=resolve_quantization(
                hf, quantization, model_dir or (None if isinstance(config, dict) else _dir(config))
            ),
            hidden_act=ACTIVATIONS[act],
        )
        if family in ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe"):
            kw["qkv_bias"] = kw["o_bias"] = bool(hf.get("attention_bias", False))
            kw["rope"] = rope_config(hf)
        if family in ("llama", "mistral"):
            kw["mlp_bias"] = bool(hf.get("mlp_bias", False))
        if family in ("mistral", "mixtral"):
            kw["sliding_window"] = hf.get("sliding_window")
        if family in ("qwen2", "qwen2_moe"):
            # Qwen2 always has q / k / v biases; Qwen2-MoE's config says (transformers' qkv_bias, default true)
            kw["qkv_bias"] = family == "qwen2" or bool(hf.get("qkv_bias", True))
            kw["rope"] = rope_config(hf)
        if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True (Qwen per-layer sliding windows) is not supported.")
        if family in ("qwen3", "qwen3_moe"):
            kw["qk_norm"] = True
        if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
            kw["moe"] = _moe_config(hf, family, kw["num_layers"])
            if kw["hidden_act"] != "silu":  # jaxllm/models/moe.py's experts are SwiGLU
                raise ValueError(f"{act_key}={act!r} is not supported for mixture-of-experts models (only 'silu').")
        if family in ("gemma2", "gemma3"):
            kw.update(_gemma_fields(hf, family, kw["num_layers"]))
        if family == "baichuan":
            # vLLM's rule: the 13B models (hidden 5120) use ALiBi, the 7B ones RoPE. Baichuan2 (vocab
            # 125696) normalises lm_head rows.
            kw["fused_qkv"] = True
            kw["position_embedding"] = "alibi" if D == 5120 or hf.get("position_embedding") == "alibi" else "rope"
            kw["rope"] = rope_config(hf)
            kw["normalize_lm_head"] = kw["vocab_size"] == 125696
        return cls(**kw)


def _moe_config(hf: dict[str, Any], family: str, num_layers: int) -> MoeConfig:
    # Mixtral names the expert count num_local_experts; Qwen's configs num_experts (transformers 5 writes
    # num_local_experts for Qwen3-MoE too).
    E = hf.get("num_local_experts") or hf.get("num_experts")
    if not E:
        given = next((f"{k}={hf[k]!r}" for k in ("num_local_experts", "num_experts") if k in hf), None)
        raise ValueError(
            f"config.json has {given}: a MoE model needs at least one expert (a dense model of this family is not supported)."
            if given
            else "config.json has no 'num_local_experts' / 'num_experts', which a MoE model needs."
        )
    top_k = int(_require(hf, "num_experts_per_tok"))
    if not 1 <= top_k <= E:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({E}).")
    if family == "mixtral":
        return MoeConfig(num_experts=int(E), top_k=top_k, intermediate_size=int(_require(hf, "intermediate_size")))
    step = int(hf.get("decoder_sparse_step") or 1)
    only = set(hf.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return MoeConfig(
        num_experts=int(E),
        top_k=top_k,
        intermediate_size=int(_require(hf, "moe_intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        dense_layers=dense,
    )


_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer is global when config.json has no layer_types


def _gemma_fields(hf: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """Gemma 2 / Gemma 3 (text): (1 + w) norms around attention and MLP, embeddings scaled by sqrt(D), attention
    scaled by query_pre_attn_scalar ** -0.5, sliding-window layers interleaved with global ones; Gemma 2
    soft-caps attention scores and logits; Gemma 3 norms q and k and gives sliding layers their own RoPE base."""
    types = hf.get("layer_types")
    if types is None:
        n = int(hf.get("sliding_window_pattern") or _GEMMA_PATTERN[family])
        types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(
            f"layer_types={types!r} must list sliding_attention / full_attention for each of the {num_layers} layers."
        )
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    out: dict[str, Any] = dict(
        norm_plus_one=True,
        sandwich_norm=True,
        scale_embeddings=True,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        query_scale=float(hf.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        sliding_window=hf.get("sliding_window"),
        layer_types=tuple(types),
        final_softcap=hf.get("final_logit_softcapping"),
    )
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported.")
    if family == "gemma2":
        out["attn_softcap"] = hf.get("attn_logit_softcapping")
        out["rope"] = rope_config(hf)
        return out
    # Gemma 3: HF's attention takes no soft-capping (attn_logit_softcapping is unused there, as in vLLM).
    out["qk_norm"] = True
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one entry per layer type
        ctx = {"max_position_embeddings": hf.get("max_position_embeddings")}
        out["rope"] = rope_config(ctx | {"rope_parameters": params.get("full_attention") or {}, "rope_theta": 1e6})
        out["rope_local"] = rope_config(
            ctx | {"rope_parameters": params.get("sliding_attention") or {}, "rope_theta": 1e4}
        )
    else:  # rope_theta + rope_scaling for global layers, rope_local_base_freq (unscaled) for sliding ones
        out["rope"] = rope_config(dict(hf, rope_theta=hf.get("rope_theta", 1e6)))
        out["rope_local"] = RopeConfig(theta=float(hf.get("rope_local_base_freq", 1e4)))
    return out


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
