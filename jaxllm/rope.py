"""RoPE: the rope_scaling / rope_parameters of an HF config.json, read into a frozen RopeConfig whose inv_freq
the attention layer rotates q and k by.

Types, as transformers' modeling_rope_utils and vLLM's get_rope compute them:
- default; linear (inverse frequencies divided by factor); llama3 (Llama 3.1's per-frequency blend);
- yarn (Qwen2.5 / Qwen3 long context): low frequencies interpolated (divided by factor), high ones kept, a linear
  ramp between the beta_fast / beta_slow correction dims; cos and sin are multiplied by attention_factor, which
  multiplies q.k by its square: ModelConfig.layer_kind folds that into the layer's attention scale, so the
  kernels and the KV cache see plain RoPE;
- dynamic (NTK): vLLM's DynamicNTKScalingRotaryEmbedding, a fixed base theta * (factor^2 - factor + 1) ^
  (H / (H - 2)), the base HF's dynamic update reaches at factor * max_position_embeddings tokens (HF recomputes
  the base from each forward pass's length; vLLM, and so jaxllm, uses that longest-context base at every length).
longrope (Phi-3) and the other types are refused with the field's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: the ramp's ends, in rotations over the original context
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the correction dims rounded outwards to whole dims
    attention_factor: float = 1.0  # yarn: cos and sin scaled by it (q.k by its square)

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """[H/2] float64 inverse frequencies, with the configured scaling."""
        theta = self.theta
        if self.rope_type == "dynamic":
            theta = theta * (self.factor * self.factor - (self.factor - 1)) ** (head_dim / (head_dim - 2))
        inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "yarn":
            return self._yarn(inv, head_dim)
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

    def _yarn(self, inv: np.ndarray, head_dim: int) -> np.ndarray:
        def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the context
            return (
                head_dim
                * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(self.theta))
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # as HF: no division by zero
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        # dims below `low` turn fast enough to keep (extrapolate); above `high` they are interpolated
        return inv / self.factor * ramp + inv * (1 - ramp)


def rope_config(hf: dict[str, Any]) -> RopeConfig:
    """The RopeConfig of a config.json dict (or of one layer type's rope_parameters, given as
    {"rope_parameters": ..., "rope_theta": default, "max_position_embeddings": ...})."""
    # transformers < 5 writes rope_theta + rope_scaling; transformers 5 writes rope_parameters.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params.update(scaling)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; use one of {ROPE_TYPES}.")
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (RoPE turns every dim of a head).")
    if rope_type == "dynamic" and "factor" not in params:  # vLLM's other variant (Hunyuan's "alpha")
        raise ValueError("rope_scaling.rope_type='dynamic' without 'factor' is not supported.")
    max_pos = hf.get("max_position_embeddings")
    # HF's rule for the scaled types: a top-level original_max_position_embeddings first (Phi-3 keeps it
    # there), then rope_scaling's, then max_position_embeddings.
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn"):
        original = original or max_pos
    original = int(original or 8192)
    factor = params.get("factor")
    if factor is None:  # HF: yarn without a factor (DeepSeek-V3's layout) takes the context ratio
        factor = max_pos / original if rope_type == "yarn" and max_pos else 1.0
    factor = float(factor)
    if rope_type != "default" and factor <= 0:
        raise ValueError(f"rope_scaling.factor={factor} must be positive.")
    kw: dict[str, Any] = {}
    if rope_type == "yarn":
        kw = dict(
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=_yarn_attention_factor(params, factor),
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        **kw,
    )


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """attention_factor if given, else 0.1 ln(factor) + 1 (with DeepSeek's mscale / mscale_all_dim ratio when
    both are set): HF's _compute_yarn_parameters and vLLM's YaRNScalingRotaryEmbedding."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    return mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale(1.0)
