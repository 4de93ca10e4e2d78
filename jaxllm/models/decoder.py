"""The decoder shared by every supported architecture (Llama 2/3/3.1/3.2, Mistral, Mixtral, Qwen2/2.5, Qwen3,
Qwen2-MoE, Qwen3-MoE, Gemma 2, Gemma 3, Baichuan): pre-norm blocks of attention over the paged KV cache and a
gated MLP (or mixture of experts, jaxllm/models/moe.py). Architecture differences are ModelConfig fields
(biases, RoPE vs ALiBi, q/k norms, Gemma's norms and soft-capping, tied embeddings), not subclasses; what
differs between the layers of one model (sliding window or global attention, its RoPE, MoE or dense MLP) is
the layer's LayerKind, a static argument of its trace.

    forward(params, kv_caches, token_ids, meta, cfg) -> (kv_caches, hidden [T, D])
    compute_logits(params, hidden [B, D], cfg) -> [B, V] float32

With LoRA (jaxllm/lora/), forward takes the step's LoRAInputs and adds each token's adapter term to the output of
every adapted projection (dense or quantized; before the norms, activations and soft-capping that follow it, as
PEFT's wrapped modules do) and of the embedding lookup (before Gemma's scaling); compute_logits takes the slot
weights of its rows for the lm_head term. MoE layers' experts take no adapter (jaxllm/lora/peft.py refuses them).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxllm.config import LayerKind, ModelConfig
from jaxllm.lora import ops as lora_ops
from jaxllm.models.attention import AttentionConfig, AttentionMetadata, alibi_slopes, paged_attention
from jaxllm.models.moe import moe_mlp
from jaxllm.models.quant import QuantizedWeight
from jaxllm.models.quant_matmul import (
    Fp8Rows,
    RowsWithMax,
    add_norm_fp8_applies,
    fp8_silu_mlp_applies,
    gemv_silu,
    gemv_silu_applies,
    norm_fp8,
    norm_fp8_applies,
    qmatmul,
    residual_partials,
    silu_mlp,
    split_k,
)
from kernels_pallas.quant import add_rms_norm


def rms_norm(x, weight, eps):
    # Same rounding as HF: normalise in float32, cast back, then scale in the weight dtype.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def gemma_rms_norm(x, weight, eps):
    # Gemma: normalise and scale by (1 + w) in float32, rounded once (HF's Gemma2RMSNorm / Gemma3RMSNorm).
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _norm(x, weight, cfg: ModelConfig):
    return (gemma_rms_norm if cfg.norm_plus_one else rms_norm)(x, weight, cfg.rms_norm_eps)


def _norm_into(x, weight, w, cfg: ModelConfig, attn: AttentionConfig, lora: bool):
    """The norm of x as projection w's input: e4m3 rows with their token scales (Fp8Rows, quant_matmul.norm_fp8:
    the norm and the rounding in one pass) where norm_fp8_applies and no LoRA term reads the norm; else _norm."""
    if not lora and norm_fp8_applies(x, w, kernels=attn.backend == "pallas"):
        return norm_fp8(
            x, weight, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, interpret=attn.interpret, mesh=attn.mesh
        )
    return _norm(x, weight, cfg)


def _add_norm(x, parts, weight, w, cfg: ModelConfig, attn: AttentionConfig, lora: bool):
    """(x + parts summed, its norm as projection w's input): the residual add of a projection's split-K partials and
    the norm after it in one pass (kernels_pallas.quant.add_rms_norm); the norm in e4m3 with its token scales
    (Fp8Rows) where add_norm_fp8_applies to w and no LoRA term reads it."""
    fp8 = not lora and add_norm_fp8_applies(x, w, kernels=attn.backend == "pallas")
    return add_rms_norm(
        x, parts, weight, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, fp8=fp8, interpret=attn.interpret
    )


def _partials_into_residual(x, w, lp: dict, attn: AttentionConfig, ll: dict, bias: str, post_norm: str):
    """x [T, I] times w (the o or down projection) as float32 split-K partials [S, T, D] for the residual add and the
    norm after it to sum in one pass (_add_norm), or None. Where a quantized kernel makes them (quant_matmul.split_k:
    decode steps of 1-2 rows) on the Pallas backend at tp 1, without a bias, post-norm or LoRA term on the
    projection. At batch 1 this runs one kernel where XLA ran three (the sum with the add, the norm's reduction and
    its scaling), twice a layer: fewer nodes in the step's CUDA graph, each of which costs host time every step."""
    if w is None or ll or not _partials_allowed(lp, attn, after=(bias, post_norm)):
        return None  # w None: LoRA's fused weights (in ll) in its place
    x = x if isinstance(x, RowsWithMax) else x.reshape(x.shape[0], -1)
    return residual_partials(x, w, interpret=attn.interpret)


def _qk_norm(qkv, lp, cfg: ModelConfig):
    """Qwen3 / Gemma 3: RMSNorm over each q and k head of the fused projection [T, K, G + 2, H]; v as is."""
    G = qkv.shape[2] - 2
    q = _norm(qkv[:, :, :G], lp["q_norm"], cfg)
    k = _norm(qkv[:, :, G : G + 1], lp["k_norm"], cfg)
    return jnp.concatenate([q, k, qkv[:, :, G + 1 :]], axis=2)


def activation(x, name: str):
    if name == "silu":
        return jax.nn.silu(x)
    # GELU's tanh approximation in float32, rounded once (torch computes it so for 16-bit inputs too).
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


def _proj(x, w, b, eq, attn: AttentionConfig):
    if isinstance(w, QuantizedWeight):  # x's non-token axes are the weight's (flattened) input
        # the quantized GEMMs follow the attention backend: "pallas" (GPUs) runs kernels_pallas's
        x = x if isinstance(x, (Fp8Rows, RowsWithMax)) else x.reshape(x.shape[0], -1)
        y = qmatmul(x, w, kernels=attn.backend == "pallas", interpret=attn.interpret, mesh=attn.mesh)
    else:
        y = jnp.einsum(eq, x, w)
    return y if b is None else y + b


# Small batches on the Pallas backend compute the qkv projection as this many split-K partials (qkv_splits).
QKV_SPLITS = 4
QKV_SPLIT_MAX_TOKENS = 16


def qkv_splits(num_tokens: int, lp: dict, cfg: ModelConfig, attn: AttentionConfig) -> int:
    """Static: how many split-K partials a 16-bit qkv projection is computed as (0: a plain projection).

    At batch 1 XLA splits the qkv GEMM over its contraction (4 ways on an H100) and sums the partials in a
    kernel of its own (~1.6 us); then the qkv/RoPE/KV-write kernel runs (3.3 us). For token batches of up to
    QKV_SPLIT_MAX_TOKENS on the Pallas backend the decoder makes the partials itself (one batched GEMM) and
    the qkv/RoPE/write kernel sums them, which saves that launch (_partials_allowed says where not)."""
    if num_tokens > QKV_SPLIT_MAX_TOKENS or isinstance(lp["w_qkv"], QuantizedWeight) or not _partials_allowed(lp, attn):
        return 0  # quantized weights: qkv_partials' fp8 case
    return math.gcd(QKV_SPLITS, cfg.hidden_size)


def _partials_allowed(lp: dict, attn: AttentionConfig, after=("b_qkv", "q_norm")) -> bool:
    """Whether a projection may be handed on as split-K partials: the Pallas backend, none of the layer's parameters
    `after` that apply to the summed projection (qkv's bias and q/k norms by default), tp 1 (the partials would
    cross shard_map's specs)."""
    tp = 1 if attn.mesh is None else attn.mesh.shape.get("tp", 1)
    return attn.backend == "pallas" and not any(k in lp for k in after) and tp == 1


def qkv_partials(h, lp: dict, cfg: ModelConfig, attn: AttentionConfig):
    """The qkv projection as float32 split-K partials [S, T, K, G + 2, H], summed in the attention kernel, or None
    (a plain projection): 16-bit weights of up to QKV_SPLIT_MAX_TOKENS rows (qkv_splits, one batched GEMM); fp8 W8A8
    weights of 1-2 rows (fp8_gemv's own partials) and int weight-only weights of 1-2 rows (the int kernel's split-K;
    quant_matmul.split_k; h may be Fp8Rows of those rows). Fp8Rows of more rows: a plain projection."""
    if splits := qkv_splits(h.shape[0], lp, cfg, attn):
        return _split_k_qkv(h, lp["w_qkv"], splits)
    if not _partials_allowed(lp, attn):
        return None
    return split_k(h, lp["w_qkv"], interpret=attn.interpret)


def _split_k_qkv(h, w, splits):
    """h [T, D] @ w [D, K, G + 2, H] as [splits, T, K, G + 2, H] float32 partials over D: one batched GEMM."""
    T, D = h.shape
    hs, ws = h.reshape(T, splits, D // splits), w.reshape(splits, D // splits, *w.shape[1:])
    return jnp.einsum("TSd,SdKGH->STKGH", hs, ws, preferred_element_type=jnp.float32)


def mlp(
    h,
    w_gate_up,
    w_down,
    act: str,
    attn: AttentionConfig,
    b_gate_up=None,
    b_down=None,
    ll=None,
    lw=None,
    residual=None,
    down_partials=None,
):
    """ll: the layer's LoRA slot arrays and lw [T, S] each token's slot weights (lora_ops.select), or None.
    residual: the residual stream to add the output to (returned summed), or None. down_partials(a, w_down): the
    down projection as split-K partials or None (_partials_into_residual); where it gives them, mlp returns
    (residual, partials) unsummed, for the next layer's norm to add (decoder_layer)."""
    ll = ll or {}
    kernels = attn.backend == "pallas"
    if act == "silu" and b_gate_up is None and not ll and fp8_silu_mlp_applies(h, w_gate_up, w_down, kernels=kernels):
        out = silu_mlp(h, w_gate_up, w_down, interpret=attn.interpret, mesh=attn.mesh)  # fp8 W8A8, > 2 rows
        out = out if b_down is None else out + b_down
        return out if residual is None else residual + out
    fused = act == "silu" and b_gate_up is None and not ll
    if fused and gemv_silu_applies(h, w_gate_up, w_down, kernels=kernels, mesh=attn.mesh):
        a = gemv_silu(h, w_gate_up, interpret=attn.interpret)  # fp8 W8A8, 1-2 rows: RowsWithMax for down's GEMV
    else:
        a = _activated(h, w_gate_up, act, attn, b_gate_up, ll, lw)
    if residual is not None and down_partials is not None and (parts := down_partials(a, w_down)) is not None:
        return residual, parts
    if "down_fused" in ll:  # the base weight and the slots' B in one
        out = lora_ops.fused_out(a, *ll["down_fused"], lw)
        out = out if b_down is None else out + b_down
        return out if residual is None else residual + out
    out = _proj(a, w_down, b_down, "TF,FD->TD", attn)
    if residual is None:
        return lora_ops.add(out, "down", a, ll.get("down"), lw)
    return lora_ops.add(residual + out, "down", a, ll.get("down"), lw)  # see decoder_layer's o


def _activated(h, w_gate_up, act: str, attn: AttentionConfig, b_gate_up, ll: dict, lw):
    """act(gate) * up [T, F] of the gate / up projection of h (with the layer's LoRA terms)."""
    if "gate_up_fused" in ll:  # the base weight and the slots' A in one (lora/ops.py)
        gate, up = lora_ops.fused_gate_up(h, *ll["gate_up_fused"], lw, b_gate_up)
    else:
        gate_up = _proj(h, w_gate_up, b_gate_up, "TD,DCF->TCF", attn)  # C = 2: gate, up
        gate, up = gate_up[:, 0], gate_up[:, 1]
    if "gate_up" in ll:  # its parts [2, T, F], added where the activation reads them: one fusion, no transpose
        d = lora_ops.delta("gate_up", h, *ll["gate_up"], lw).astype(gate.dtype)
        gate, up = gate + d[0], up + d[1]
    return activation(gate, act) * up


def _moe(lp, h, cfg: ModelConfig, attn: AttentionConfig):
    # the experts' grouped GEMMs follow the attention backend: "pallas" (GPUs) runs kernels_pallas's grouped
    # GEMM, the reference backend (CPU) jax.lax.ragged_dot
    out = moe_mlp(lp, h, cfg, attn.mesh, impl="pallas" if attn.backend == "pallas" else "ragged_dot")
    if "w_shared_gate_up" in lp:  # Qwen2-MoE: a shared expert every token runs, gated by sigmoid(h . w)
        shared = mlp(h, lp["w_shared_gate_up"], lp["w_shared_down"], cfg.hidden_act, attn)
        gate = jax.nn.sigmoid(_proj(h, lp["w_shared_expert_gate"], None, "TD,D->T", attn))
        out = out + gate[:, None] * shared
    return out


def decoder_layer(
    lp, x, kv_cache, meta: AttentionMetadata, cfg: ModelConfig, attn: AttentionConfig, kind: LayerKind, ll=None, lw=None
):
    """ll: this layer's LoRA slot arrays, lw [T, S]: each token's slot (lora_ops.select); None without LoRA.
    x: the residual stream [T, D], or (x, partials [S, T, D]) where the previous layer left its down projection's
    partials unsummed (_partials_into_residual); the returned stream is in the same two forms (forward sums the last)."""
    ll = ll or {}
    if isinstance(x, tuple):
        x, h = _add_norm(*x, lp["attn_norm"], lp.get("w_qkv"), cfg, attn, lora=bool(ll))
    else:
        h = _norm_into(x, lp["attn_norm"], lp.get("w_qkv"), cfg, attn, lora=bool(ll))
    if "qkv_fused" in ll:  # LoRA fused into the base weights (lora/ops.py)
        qkv = lora_ops.fused_qkv(h, *ll["qkv_fused"], lw, lp.get("b_qkv"))
    elif (qkv := qkv_partials(h, lp, cfg, attn)) is not None:
        if "qkv" in ll:  # the partials are summed in the attention kernel: the LoRA term joins the first
            qkv = qkv.at[0].add(lora_ops.delta("qkv", h, *ll["qkv"], lw))
    else:
        qkv = _proj(h, lp["w_qkv"], lp.get("b_qkv"), "TD,DKGH->TKGH", attn)  # per kv head: G q heads, then k, v
        qkv = lora_ops.add(qkv, "qkv", h, ll.get("qkv"), lw)
    if "q_norm" in lp:
        qkv = _qk_norm(qkv, lp, cfg)
    inv_freq = slopes = None
    if cfg.position_embedding == "rope":
        inv_freq = jnp.asarray(kind.rope.inv_freq(cfg.head_dim), jnp.float32)
    else:
        slopes = jnp.asarray(alibi_slopes(cfg.num_heads))
    out, kv_cache = paged_attention(  # out [T, N, H]: q head n sits in kv head n // G
        qkv,
        kv_cache,
        meta,
        scale=kind.attn_scale,
        rope_inv_freq=inv_freq,
        alibi_slopes=slopes,
        sliding_window=kind.sliding_window,
        soft_cap=cfg.attn_softcap,
        config=attn,
        dtype=x.dtype,
    )
    # Without a post-norm the LoRA term is added last, (x + o(out)) + delta, rather than as PEFT does,
    # x + (o(out) + delta) (the same sum, rounded in another order): the base GEMM then adds the residual in its
    # epilogue as in the base model, and the expand adds that sum in its own (lora_ops.add puts the delta first for
    # XLA's GemmRewriter). H100, 8 adapters, batch 64: x + delta first left the o / down adds as kernels of their own
    # (lora_h100_797b2f2.json), or made cuBLAS pick a split-K o GEMM with a reduce kernel after it
    # (lora_h100_7efd0bb.json); this order runs 20 kernels a layer, 219 us (lora_h100_e3a7cfd.json).
    attn_out = out
    o_parts = _partials_into_residual(attn_out, lp.get("wo"), lp, attn, ll, "bo", "post_attn_norm")
    if o_parts is not None:
        w_next = None if kind.moe else lp.get("w_gate_up")
        x, h = _add_norm(x, o_parts, lp["mlp_norm"], w_next, cfg, attn, lora=bool(ll))
    elif "o_fused" in ll:  # the base weight and the slots' B in one: the LoRA term is in out
        out = lora_ops.fused_out(attn_out, *ll["o_fused"], lw)
        out = out if "bo" not in lp else out + lp["bo"]
        x = x + (_norm(out, lp["post_attn_norm"], cfg) if "post_attn_norm" in lp else out)
    else:
        out = _proj(attn_out, lp["wo"], lp.get("bo"), "TNH,NHD->TD", attn)
        if "post_attn_norm" in lp:  # Gemma 2/3
            x = x + _norm(lora_ops.add(out, "o", attn_out, ll.get("o"), lw), lp["post_attn_norm"], cfg)
        else:
            x = lora_ops.add(x + out, "o", attn_out, ll.get("o"), lw)
    if o_parts is None:
        h = _norm_into(x, lp["mlp_norm"], None if kind.moe else lp.get("w_gate_up"), cfg, attn, lora=bool(ll))
    if kind.moe:
        out = _moe(lp, h, cfg, attn)
    else:
        residual = None if "post_mlp_norm" in lp else x
        args = (
            lp.get("w_gate_up"),
            lp.get("w_down"),
            cfg.hidden_act,
            attn,
            lp.get("b_gate_up"),
            lp.get("b_down"),
            ll,
            lw,
        )
        down_partials = functools.partial(
            _partials_into_residual, lp=lp, attn=attn, ll=ll, bias="b_down", post_norm="post_mlp_norm"
        )
        out = mlp(h, *args, residual=residual, down_partials=down_partials)
        if residual is not None:
            return out, kv_cache
    if "post_mlp_norm" in lp:
        out = _norm(out, lp["post_mlp_norm"], cfg)
    return x + out, kv_cache


_ATTENTION = AttentionConfig()  # forward's default: the reference backend, one device


@functools.cache
def _traced_once(layer_fn):
    """layer_fn as a nested jit: every layer of a step has the same input shapes, so the first call's trace
    serves the others of its LayerKind (Gemma's sliding and global layers: two traces). Tracing the unrolled
    32-layer loop of 17 step variants took 28-34 s of Python in an H100 cold start (17-19 s now; the compiles alongside it still bound that start at ~40 s) and most of a
    2-core VM's (a 32-layer tiny model's cold LLM(): 42.5-49.4 -> 41.9 s, tracing 11-12 -> 1.9 s,
    bench/results/cpu_vm_startup_layer_jit.json). XLA inlines the calls (the same operations), but the compiled
    step is not bit-identical to the unrolled one's: that model's float32 logprobs moved by ~1e-3 and its
    greedy tokens after the 5th (random weights; the HF parity tests hold as before)."""
    return jax.jit(layer_fn, static_argnums=(4, 5, 6))


def forward(
    params,
    kv_caches,
    token_ids,
    meta: AttentionMetadata,
    cfg: ModelConfig,
    attn: AttentionConfig = _ATTENTION,
    layers: range | None = None,
    hidden=None,
    capture: tuple[int, ...] = (),
    lora: lora_ops.LoRAInputs | None = None,
):
    """Runs layers (all by default) over the flat token batch. With pipeline stages, a stage passes its
    layer range and the previous stage's hidden states; the first stage embeds token_ids. capture: layers whose
    input hidden states (the residual stream entering them, [T, D] each) are returned too, as a third value
    (EAGLE-3 heads read them). lora: the step's adapters (jaxllm/lora/ops.py), or None."""
    layers = range(cfg.num_layers) if layers is None else layers
    lw = None if lora is None else lora_ops.select(lora.token_slots, lora.num_slots, lora.dtype)
    if hidden is None:
        x = params["embed"][token_ids]
        if lora is not None:
            x = lora_ops.add(x, "embed", token_ids, lora.weights["embed"], lw)
        if cfg.scale_embeddings:  # Gemma: times sqrt(D), rounded to the model dtype as HF does
            x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
    else:
        x = hidden
    kv_caches = list(kv_caches)
    layer = _traced_once(decoder_layer)  # looked up here: bench/probes/step_probe.py swaps decoder_layer
    captured = {}
    for i in layers:
        if i in capture:
            x = _summed(x)
            captured[i] = x
        ll = None if lora is None else lora.weights["layers"][i]
        x, kv_caches[i] = layer(params["layers"][i], x, kv_caches[i], meta, cfg, attn, cfg.layer_kind(i), ll, lw)
    x = _summed(x)
    return (kv_caches, x, [captured[i] for i in capture]) if capture else (kv_caches, x)


def _summed(x):
    """The residual stream from a layer's output: x, or x + its down projection's partials summed (decoder_layer)."""
    if not isinstance(x, tuple):
        return x
    x, parts = x
    return x + parts.sum(0).astype(x.dtype)


def final_normed(params, hidden, cfg: ModelConfig):
    """The last layer's hidden states through the model's final norm: what the lm_head reads, and what an embedding
    model pools."""
    return _norm(hidden, params["final_norm"], cfg)


def compute_logits(params, hidden, cfg: ModelConfig, lora_head=None, row_slots=None):
    """lora_head: the lm_head LoRA slot arrays (A, B) and row_slots [B] each row's slot (-1: none), or None."""
    x = final_normed(params, hidden, cfg)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    logits = jnp.einsum("BD,VD->BV", x, head, preferred_element_type=jnp.float32)
    if lora_head is not None:
        w = lora_ops.select(row_slots, lora_ops.num_slots(lora_head))
        logits = logits + lora_ops.delta("lm_head", x, *lora_head, w)
    if cfg.final_softcap is not None:  # Gemma 2
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits
