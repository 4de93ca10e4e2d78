"""The decoder shared by every supported architecture (Llama 2/3/3.1, Mistral, Qwen2/2.5, Baichuan):
pre-norm blocks of attention over the paged KV cache and a SwiGLU MLP. Architecture differences are
ModelConfig fields (biases, RoPE vs ALiBi, sliding window, tied embeddings), not subclasses.

    forward(params, kv_caches, token_ids, meta, cfg) -> (kv_caches, hidden [T, D])
    compute_logits(params, hidden [B, D], cfg) -> [B, V] float32

With LoRA (jaxllm/lora/), forward takes the step's LoRAInputs and adds each token's adapter term beside every
projection (dense or quantized) and the embedding lookup; compute_logits takes the slot weights of its rows for the
lm_head term.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.lora import ops as lora_ops
from jaxllm.models.attention import AttentionConfig, AttentionMetadata, alibi_slopes, paged_attention
from jaxllm.models.quant import QuantizedWeight, qmatmul


def rms_norm(x, weight, eps):
    # Same rounding as HF: normalise in float32, cast back, then scale in the weight dtype.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _proj(x, w, b, eq):
    if isinstance(w, QuantizedWeight):  # x's non-token axes are the weight's (flattened) input
        y = qmatmul(x.reshape(x.shape[0], -1), w)
    else:
        y = jnp.einsum(eq, x, w)
    return y if b is None else y + b


# Small batches on the Pallas backend compute the qkv projection as this many split-K partials (qkv_splits).
QKV_SPLITS = 4
QKV_SPLIT_MAX_TOKENS = 16


def qkv_splits(num_tokens: int, lp: dict, cfg: ModelConfig, attn: AttentionConfig) -> int:
    """Static: how many split-K partials the qkv projection is computed as (0: a plain projection).

    At batch 1 XLA splits the qkv GEMM over its contraction (4 ways on an H100) and sums the partials in a
    kernel of its own (~1.6 us); then the qkv/RoPE/KV-write kernel runs (3.3 us). For token batches of up to
    QKV_SPLIT_MAX_TOKENS on the Pallas backend the decoder makes the partials itself (one batched GEMM) and
    the qkv/RoPE/write kernel sums them, which saves that launch. Not with a qkv bias (added after the sum)
    or tp > 1 (the partials would cross shard_map's specs)."""
    if (attn.backend != "pallas" or num_tokens > QKV_SPLIT_MAX_TOKENS or "b_qkv" in lp
            or isinstance(lp["w_qkv"], QuantizedWeight)):
        return 0
    if attn.mesh is not None and attn.mesh.shape.get("tp", 1) > 1:
        return 0
    return math.gcd(QKV_SPLITS, cfg.hidden_size)


def _split_k_qkv(h, w, splits):
    """h [T, D] @ w [D, K, G + 2, H] as [splits, T, K, G + 2, H] float32 partials over D: one batched GEMM."""
    T, D = h.shape
    hs, ws = h.reshape(T, splits, D // splits), w.reshape(splits, D // splits, *w.shape[1:])
    return jnp.einsum("TSd,SdKGH->STKGH", hs, ws, preferred_element_type=jnp.float32)


def decoder_layer(lp, x, kv_cache, meta: AttentionMetadata, cfg: ModelConfig, attn: AttentionConfig,
                  ll=None, lw=None):
    """ll: this layer's LoRA slot arrays, lw [T, S]: each token's slot (lora_ops.select); None without LoRA."""
    ll = ll or {}
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    splits = qkv_splits(h.shape[0], lp, cfg, attn)
    if splits:
        qkv = _split_k_qkv(h, lp["w_qkv"], splits)
        if "qkv" in ll:  # the partials are summed in the attention kernel: the LoRA term joins the first
            qkv = qkv.at[0].add(lora_ops.delta("qkv", h, *ll["qkv"], lw))
    else:
        qkv = _proj(h, lp["w_qkv"], lp.get("b_qkv"), "TD,DKGH->TKGH")  # per kv head: G q heads, then k, v
        qkv = lora_ops.add(qkv, "qkv", h, ll.get("qkv"), lw)
    inv_freq = slopes = None
    if cfg.position_embedding == "rope":
        inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim), jnp.float32)
    else:
        slopes = jnp.asarray(alibi_slopes(cfg.num_heads))
    out, kv_cache = paged_attention(  # out [T, N, H]: q head n sits in kv head n // G
        qkv, kv_cache, meta, scale=cfg.head_dim**-0.5, rope_inv_freq=inv_freq, alibi_slopes=slopes,
        sliding_window=cfg.sliding_window, config=attn, dtype=x.dtype)
    x = x + lora_ops.add(_proj(out, lp["wo"], lp.get("bo"), "TNH,NHD->TD"), "o", out, ll.get("o"), lw)
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    gate_up = _proj(h, lp["w_gate_up"], lp.get("b_gate_up"), "TD,DCF->TCF")  # C = 2: gate, up
    gate_up = lora_ops.add(gate_up, "gate_up", h, ll.get("gate_up"), lw)
    act = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
    x = x + lora_ops.add(_proj(act, lp["w_down"], lp.get("b_down"), "TF,FD->TD"), "down", act, ll.get("down"), lw)
    return x, kv_cache


@functools.lru_cache(maxsize=None)
def _traced_once(layer_fn):
    """layer_fn as a nested jit: every layer of a step has the same input shapes, so the first call's trace
    serves the others. Tracing the unrolled 32-layer loop of 17 step variants took 28-34 s of Python in an
    H100 cold start (17-19 s now; the compiles alongside it still bound that start at ~40 s) and most of a
    2-core VM's (a 32-layer tiny model's cold LLM(): 42.5-49.4 -> 41.9 s, tracing 11-12 -> 1.9 s,
    bench/results/cpu_vm_startup_layer_jit.json). XLA inlines the calls (the same operations), but the compiled
    step is not bit-identical to the unrolled one's: that model's float32 logprobs moved by ~1e-3 and its
    greedy tokens after the 5th (random weights; the HF parity tests hold as before)."""
    return jax.jit(layer_fn, static_argnums=(4, 5))


def forward(params, kv_caches, token_ids, meta: AttentionMetadata, cfg: ModelConfig,
            attn: AttentionConfig = AttentionConfig(), layers: range | None = None, hidden=None,
            lora: lora_ops.LoRAInputs | None = None):
    """Runs layers (all by default) over the flat token batch. With pipeline stages, a stage passes its
    layer range and the previous stage's hidden states; the first stage embeds token_ids. lora: the step's
    adapters (jaxllm/lora/ops.py), or None."""
    layers = range(cfg.num_layers) if layers is None else layers
    lw = None if lora is None else lora_ops.select(lora.token_slots, lora.num_slots)
    if hidden is None:
        x = params["embed"][token_ids]
        if lora is not None:
            x = lora_ops.add(x, "embed", token_ids, lora.weights["embed"], lw)
    else:
        x = hidden
    kv_caches = list(kv_caches)
    layer = _traced_once(decoder_layer)  # looked up here: bench/probes/step_probe.py swaps decoder_layer
    for i in layers:
        ll = None if lora is None else lora.weights["layers"][i]
        x, kv_caches[i] = layer(params["layers"][i], x, kv_caches[i], meta, cfg, attn, ll, lw)
    return kv_caches, x


def compute_logits(params, hidden, cfg: ModelConfig, lora_head=None, row_slots=None):
    """lora_head: the lm_head LoRA slot arrays (A, B) and row_slots [B] each row's slot (-1: none), or None."""
    x = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    logits = jnp.einsum("BD,VD->BV", x, head, preferred_element_type=jnp.float32)
    if lora_head is not None:
        logits = logits + lora_ops.delta("lm_head", x, *lora_head, lora_ops.select(row_slots, lora_head[0].shape[0]))
    return logits
