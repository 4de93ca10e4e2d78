"""The decoder shared by every supported architecture (Llama 2/3/3.1, Mistral, Qwen2/2.5, Baichuan):
pre-norm blocks of attention over the paged KV cache and a SwiGLU MLP. Architecture differences are
ModelConfig fields (biases, RoPE vs ALiBi, sliding window, tied embeddings), not subclasses.

    forward(params, kv_caches, token_ids, meta, cfg) -> (kv_caches, hidden [T, D])
    compute_logits(params, hidden [B, D], cfg) -> [B, V] float32
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.models.attention import AttentionConfig, AttentionMetadata, alibi_slopes, paged_attention
from kernels_pallas import reference
from kernels_pallas.reference import rms_norm


def add_norm(x, delta, weight, eps, attn: AttentionConfig):
    """(x + delta, rms_norm(x + delta) * weight); delta None: (x, rms_norm(x) * weight). With the Pallas
    backend (no tp mesh: the kernel is not partitioned) one launch instead of XLA's two to three."""
    if delta is None:
        return x, rms_norm(x, weight, eps)
    if attn.backend == "pallas" and (attn.mesh is None or attn.mesh.shape.get("tp", 1) == 1):
        import kernels_pallas

        return kernels_pallas.add_rms_norm(x, delta, weight, eps=eps, interpret=attn.interpret)
    return reference.add_rms_norm(x, delta, weight, eps)


def _proj(x, w, b, eq):
    y = jnp.einsum(eq, x, w)
    return y if b is None else y + b


def decoder_layer(lp, x, delta, kv_cache, meta: AttentionMetadata, cfg: ModelConfig, attn: AttentionConfig):
    """x: the residual stream without the previous layer's MLP output delta (None before the first layer), so
    that add fuses with this layer's input norm. Returns (x, this layer's MLP output, kv_cache)."""
    x, h = add_norm(x, delta, lp["attn_norm"], cfg.rms_norm_eps, attn)
    qkv = _proj(h, lp["w_qkv"], lp.get("b_qkv"), "TD,DKGH->TKGH")  # per kv head: G q heads, then k, v
    inv_freq = slopes = None
    if cfg.position_embedding == "rope":
        inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim), jnp.float32)
    else:
        slopes = jnp.asarray(alibi_slopes(cfg.num_heads))
    out, kv_cache = paged_attention(  # out [T, N, H]: q head n sits in kv head n // G
        qkv, kv_cache, meta, scale=cfg.head_dim**-0.5, rope_inv_freq=inv_freq, alibi_slopes=slopes,
        sliding_window=cfg.sliding_window, config=attn)
    x, h = add_norm(x, _proj(out, lp["wo"], lp.get("bo"), "TNH,NHD->TD"), lp["mlp_norm"], cfg.rms_norm_eps, attn)
    gate_up = _proj(h, lp["w_gate_up"], lp.get("b_gate_up"), "TD,DCF->TCF")  # C = 2: gate, up
    delta = _proj(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], lp["w_down"], lp.get("b_down"), "TF,FD->TD")
    return x, delta, kv_cache


def forward(params, kv_caches, token_ids, meta: AttentionMetadata, cfg: ModelConfig,
            attn: AttentionConfig = AttentionConfig(), layers: range | None = None, hidden=None):
    """Runs layers (all by default) over the flat token batch. With pipeline stages, a stage passes its
    layer range and the previous stage's hidden states; the first stage embeds token_ids."""
    layers = range(cfg.num_layers) if layers is None else layers
    x = params["embed"][token_ids] if hidden is None else hidden
    kv_caches = list(kv_caches)
    delta = None
    for i in layers:
        x, delta, kv_caches[i] = decoder_layer(params["layers"][i], x, delta, kv_caches[i], meta, cfg, attn)
    return kv_caches, x if delta is None else x + delta


def compute_logits(params, hidden, cfg: ModelConfig):
    x = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("BD,VD->BV", x, head, preferred_element_type=jnp.float32)
