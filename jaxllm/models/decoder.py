"""The decoder shared by every supported architecture (Llama 2/3/3.1, Mistral, Qwen2/2.5, Baichuan):
pre-norm blocks of attention over the paged KV cache and a SwiGLU MLP. Architecture differences are
ModelConfig fields (biases, RoPE vs ALiBi, sliding window, tied embeddings), not subclasses.

    forward(params, kv_caches, token_ids, meta, cfg) -> (kv_caches, hidden [T, D])
    compute_logits(params, hidden [B, D], cfg) -> [B, V] float32
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

import kernels_pallas
from jaxllm.config import ModelConfig
from jaxllm.models.attention import AttentionConfig, AttentionMetadata, alibi_slopes, paged_attention
from kernels_pallas.reference import rms_norm

__all__ = ["forward", "compute_logits", "rms_norm", "decoder_layer", "split_k_plan"]


def _proj(x, w, b, eq):
    y = jnp.einsum(eq, x, w)
    return y if b is None else y + b


def _rope_and_slopes(cfg: ModelConfig):
    if cfg.position_embedding == "rope":
        return jnp.asarray(cfg.rope.inv_freq(cfg.head_dim), jnp.float32), None
    return None, jnp.asarray(alibi_slopes(cfg.num_heads))


def decoder_layer(lp, x, kv_cache, meta: AttentionMetadata, cfg: ModelConfig, attn: AttentionConfig):
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    qkv = _proj(h, lp["w_qkv"], lp.get("b_qkv"), "TD,DKGH->TKGH")  # per kv head: G q heads, then k, v
    inv_freq, slopes = _rope_and_slopes(cfg)
    out, kv_cache = paged_attention(  # out [T, N, H]: q head n sits in kv head n // G
        qkv, kv_cache, meta, scale=cfg.head_dim**-0.5, rope_inv_freq=inv_freq, alibi_slopes=slopes,
        sliding_window=cfg.sliding_window, config=attn)
    x = x + _proj(out, lp["wo"], lp.get("bo"), "TNH,NHD->TD")
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    gate_up = _proj(h, lp["w_gate_up"], lp.get("b_gate_up"), "TD,DCF->TCF")  # C = 2: gate, up
    x = x + _proj(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], lp["w_down"], lp.get("b_down"), "TF,FD->TD")
    return x, kv_cache


# Split-K plan of the small-batch path (split_k_plan): splits of the qkv, o and down projections' contraction.
# XLA's own choice at batch 1 on an H100 was 4, 8, 8 (bench/step_probe.py).
SPLIT_K = {"qkv": 4, "o": 8, "down": 8}
# Token batches up to this size take the split-K path (0: never).
SPLIT_K_MAX_TOKENS = 16


def split_k_plan(num_tokens: int, lp: dict, cfg: ModelConfig, attn: AttentionConfig):
    """Static: ((qkv, o, down) splits) for the small-batch path, or None for the plain layer.

    At batch 1 every small kernel of a decode step costs ~1.7 us on an H100 whatever its size, and XLA's
    split-K GEMMs for the qkv, o and down projections each need one more (the split reduction). The
    small-batch path computes those projections as split-K partials itself (one batched XLA GEMM each) and
    sums them inside the kernel that comes next anyway: the qkv/RoPE/KV-write kernel, and one kernel per
    residual add that also does the RMSNorm after it (kernels_pallas.add_rms_norm). Pallas backend, one tp
    shard (row-parallel o / down would all-reduce S times the bytes), no o / down biases; the splits are
    SPLIT_K's where they divide the contraction (else their greatest common divisor)."""
    if attn.backend != "pallas" or num_tokens > SPLIT_K_MAX_TOKENS:
        return None
    if attn.mesh is not None and attn.mesh.shape.get("tp", 1) > 1:
        return None
    if "bo" in lp or "b_down" in lp:
        return None
    D, F, N = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads
    if D & (D - 1):  # add_rms_norm's kernel wants a power-of-two hidden size
        return None
    # the qkv bias is added after the sum: a plain qkv projection then
    sq = 1 if "b_qkv" in lp else math.gcd(SPLIT_K["qkv"], D)
    return sq, math.gcd(SPLIT_K["o"], N), math.gcd(SPLIT_K["down"], F)


def _split_k(x, w, splits, eq):
    """einsum(eq, x, w) with the contraction (x's and w's leading-after-T / leading axis) cut into `splits`:
    [splits, T, ...] float32 partials, one batched GEMM."""
    T, C = x.shape[0], x.shape[1]
    xs = x.reshape(T, splits, C // splits, *x.shape[2:])
    ws = w.reshape(splits, C // splits, *w.shape[1:])
    lhs, rhs_out = eq.split(",")
    rhs, out = rhs_out.split("->")
    return jnp.einsum(f"{lhs[0]}S{lhs[1:]},S{rhs}->S{out}", xs, ws, preferred_element_type=jnp.float32)


def decoder_layer_split(lp, x, parts, kv_cache, meta: AttentionMetadata, cfg: ModelConfig, attn: AttentionConfig,
                        plan):
    """decoder_layer for small batches (split_k_plan): x is the residual stream before the previous layer's
    down projection, whose split-K partials are `parts` (None in the first layer). Returns (x, this layer's
    down partials, kv_cache); forward adds the last layer's."""
    sq, so, sd = plan
    eps, interpret = cfg.rms_norm_eps, attn.interpret
    if parts is None:
        h = rms_norm(x, lp["attn_norm"], eps)
    else:
        x, h = kernels_pallas.add_rms_norm(parts, x, lp["attn_norm"], eps, interpret=interpret)
    if sq > 1:
        qkv = _split_k(h, lp["w_qkv"], sq, "TD,DKGH->TKGH")
    else:
        qkv = _proj(h, lp["w_qkv"], lp.get("b_qkv"), "TD,DKGH->TKGH")
    inv_freq, slopes = _rope_and_slopes(cfg)
    out, kv_cache = paged_attention(
        qkv, kv_cache, meta, scale=cfg.head_dim**-0.5, rope_inv_freq=inv_freq, alibi_slopes=slopes,
        sliding_window=cfg.sliding_window, config=attn, dtype=x.dtype)
    x, h = kernels_pallas.add_rms_norm(_split_k(out, lp["wo"], so, "TNH,NHD->TD"), x, lp["mlp_norm"], eps,
                                       interpret=interpret)
    gate_up = _proj(h, lp["w_gate_up"], lp.get("b_gate_up"), "TD,DCF->TCF")
    return x, _split_k(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], lp["w_down"], sd, "TF,FD->TD"), kv_cache


@functools.lru_cache(maxsize=None)
def _traced_once(layer_fn, static=(4, 5)):
    """layer_fn as a nested jit: every layer of a step has the same input shapes, so the first call's trace
    serves the others. Tracing the unrolled 32-layer loop of 17 step variants took 28-34 s of Python in an
    H100 cold start (17-19 s now; the compiles alongside it still bound that start at ~40 s) and most of a
    2-core VM's (a 32-layer tiny model's cold LLM(): 42.5-49.4 -> 41.9 s, tracing 11-12 -> 1.9 s,
    bench/results/cpu_vm_startup_layer_jit.json). XLA inlines the calls (the same operations), but the compiled
    step is not bit-identical to the unrolled one's: that model's float32 logprobs moved by ~1e-3 and its
    greedy tokens after the 5th (random weights; the HF parity tests hold as before)."""
    return jax.jit(layer_fn, static_argnums=static)


def forward(params, kv_caches, token_ids, meta: AttentionMetadata, cfg: ModelConfig,
            attn: AttentionConfig = AttentionConfig(), layers: range | None = None, hidden=None):
    """Runs layers (all by default) over the flat token batch. With pipeline stages, a stage passes its
    layer range and the previous stage's hidden states; the first stage embeds token_ids."""
    layers = range(cfg.num_layers) if layers is None else layers
    x = params["embed"][token_ids] if hidden is None else hidden
    kv_caches = list(kv_caches)
    plan = split_k_plan(x.shape[0], params["layers"][layers[0]], cfg, attn) if len(layers) else None
    if plan is not None:
        layer, parts = _traced_once(decoder_layer_split, (5, 6, 7)), None
        for i in layers:
            x, parts, kv_caches[i] = layer(params["layers"][i], x, parts, kv_caches[i], meta, cfg, attn, plan)
        return kv_caches, x + parts.sum(0).astype(x.dtype)
    layer = _traced_once(decoder_layer)  # looked up here: bench/step_probe.py swaps decoder_layer
    for i in layers:
        x, kv_caches[i] = layer(params["layers"][i], x, kv_caches[i], meta, cfg, attn)
    return kv_caches, x


def compute_logits(params, hidden, cfg: ModelConfig):
    x = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("BD,VD->BV", x, head, preferred_element_type=jnp.float32)
