"""Model-based proposers on the device: a draft model or an EAGLE / EAGLE-3 head, run by the draft program that
follows every target step (programs.py compiles it; runner.py launches it right after the step).

KV: the drafter has its own paged KV cache (its layers' pages, as many pages as the target's), addressed by the
target's block tables: the same block manager and page ids, so prefix caching, preemption and the release of
rejected tokens' pages need nothing of their own. Invariant: the drafter's KV holds every position the target's
does (num_computed_tokens), which the draft program keeps by running over each step's tokens:

- plain steps (prefill chunks, mixed, decodes) "sync": the draft model runs over the step's tokens; an EAGLE head
  over the pairs (target feature at p, token at p + 1), the token after a chunk's last one being the sampled one,
  or the next prompt token for a partial prefill (next_ids). No proposals.
- verify steps (the target verified K or fewer proposals and emitted e = accepted + 1 tokens per sequence) run
  one ragged pass over R rows per sequence from its first verified position L - 1: the draft model over [the last
  known token, the e emitted ones, padding] (R = K + 2), an EAGLE head over the pairs (target feature of verified
  row j, emitted token j + 1) (R = K + 1). Rows past the emitted tokens write garbage past the sequence's known
  positions, which the next step writes again before any query reads them. The row of the last emitted token
  gives the first proposal; K - 1 decode passes (one row per sequence, the head's own output as the feature for
  EAGLE) give the rest. Proposals are argmax (greedy drafting, as vLLM's), verified by the rejection sampler
  (rejection_sampler.py), so outputs follow the target whatever the drafter proposes.
Writes land only in the sequence's own pages (num_pages): past them a write is dropped (the scheduler reserves K
lookahead slots when it can; without them proposals lose context, outputs are unchanged).

Shapes: T the step's tokens, B its sequences, K proposals, D the drafter's width, F the target features' width.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.engine.packing import PackedLayout, unpack_host_args
from jaxllm.models.attention import AttentionConfig, AttentionMetadata, paged_attention
from jaxllm.models.decoder import _proj, compute_logits, forward, rms_norm


@dataclass(frozen=True)
class Drafter:
    """What the draft program is compiled for (static): the method, the drafter's config and, for EAGLE, which
    target hidden states it reads."""

    method: str  # draft_model | eagle | eagle3
    cfg: ModelConfig  # the draft model's, or the head's (num_layers 1)
    num_spec: int  # K
    target_hidden: int = 0  # the target's hidden size (EAGLE features are its hidden states)
    feature_layers: tuple[int, ...] = ()  # eagle3: the target layers whose input hidden states are concatenated

    @property
    def rows(self) -> int:
        """Rows per sequence of a verify step's first draft pass (see the module docstring)."""
        return self.num_spec + (2 if self.method == "draft_model" else 1)

    @property
    def uses_features(self) -> bool:
        return self.method != "draft_model"

    @property
    def feature_dim(self) -> int:
        """F: the width of the target features a step hands over (0: none)."""
        return 0 if not self.uses_features else self.target_hidden * max(1, len(self.feature_layers))


def target_features(params, x, captured, cfg: ModelConfig, drafter: Drafter | None):
    """What the target step hands the drafter ([T, F]; None for a draft model): EAGLE reads the target's last
    hidden states after its final norm, EAGLE-3 the residual stream entering its feature layers, concatenated."""
    if drafter is None or not drafter.uses_features:
        return None
    if drafter.method == "eagle":
        return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return jnp.concatenate(captured, axis=-1)


def _slots(block_tables, positions, num_pages, live, S: int):
    """Cache slots of positions [B, R] (or [B]) of each sequence; -1 past its pages or for padding sequences."""
    M = block_tables.shape[1]
    page = positions // S
    pages_b = num_pages if positions.ndim == 1 else num_pages[:, None]
    ok = (live if positions.ndim == 1 else live[:, None]) & (page < pages_b) & (page < M)
    rows = jnp.take_along_axis(block_tables, jnp.clip(page, 0, M - 1).reshape(block_tables.shape[0], -1), axis=1)
    return jnp.where(ok, rows.reshape(positions.shape) * S + positions % S, -1).astype(jnp.int32)


def _eagle_layer(lp, attn_in, residual, kv, meta, cfg: ModelConfig, attn: AttentionConfig):
    """The head's decoder layer: attention over attn_in (EAGLE: the fused input, no input norm; EAGLE-3: the
    normed embedding and feature side by side, [T, 2D]) added to residual, then the MLP. Returns the residual
    stream after it (the head's hidden state before any final norm)."""
    qkv = _proj(attn_in, lp["w_qkv"], lp.get("b_qkv"), "TD,DKGH->TKGH", attn)
    kind = cfg.layer_kind(0)  # a Llama layer: its RoPE (a head's rope_scaling included) and score scale
    inv_freq = jnp.asarray(kind.rope.inv_freq(cfg.head_dim), jnp.float32)
    out, kv = paged_attention(
        qkv, kv, meta, scale=kind.attn_scale, rope_inv_freq=inv_freq, config=attn, dtype=residual.dtype
    )
    x = residual + _proj(out, lp["wo"], lp.get("bo"), "TNH,NHD->TD", attn)
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    gate_up = _proj(h, lp["w_gate_up"], lp.get("b_gate_up"), "TD,DCF->TCF", attn)
    return x + _proj(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], lp["w_down"], lp.get("b_down"), "TF,FD->TD", attn), kv


def _head_forward(params, dparams, dkv, token_ids, feats, meta, drafter: Drafter, attn, from_target: bool):
    """One pass of an EAGLE head over pairs (feature, token) -> (dkv, hidden [T, D]). from_target: the features
    are the target's (EAGLE-3 maps them through fc first); otherwise the head's own hidden states."""
    cfg, lp = drafter.cfg, dparams["layer"]
    embeds = params["embed"][token_ids].astype(cfg.dtype)
    if drafter.method == "eagle":
        x = _proj(
            jnp.concatenate([embeds, feats.astype(cfg.dtype)], -1),
            dparams["fc"],
            dparams.get("fc_bias"),
            "TE,ED->TD",
            attn,
        )
        attn_in = x
    else:
        x = feats.astype(cfg.dtype)
        if from_target:
            x = _proj(x, dparams["fc"], None, "TE,ED->TD", attn)
        attn_in = jnp.concatenate(
            [
                rms_norm(embeds, lp["attn_norm"], cfg.rms_norm_eps),
                rms_norm(x, dparams["hidden_norm"], cfg.rms_norm_eps),
            ],
            -1,
        )
    h, kv = _eagle_layer(lp, attn_in, x, dkv[0], meta, cfg, attn)
    return [kv], h


def _head_tokens(params, dparams, h, drafter: Drafter):
    """Argmax proposals in the target's vocabulary from head hidden states [B, D]."""
    cfg = drafter.cfg
    if drafter.method == "eagle":  # the target's output head on the un-normed state (vLLM's llama_eagle)
        head = params["embed"] if "lm_head" not in params else params["lm_head"]
        logits = jnp.einsum("BD,VD->BV", h.astype(head.dtype), head, preferred_element_type=jnp.float32)
        return jnp.argmax(logits, -1).astype(jnp.int32)
    logits = jnp.einsum(
        "BD,VD->BV",
        rms_norm(h, dparams["final_norm"], cfg.rms_norm_eps),
        dparams["lm_head"],
        preferred_element_type=jnp.float32,
    )
    ids = jnp.argmax(logits, -1).astype(jnp.int32)  # in the draft vocabulary: d2t maps it (offsets)
    return ids + dparams["d2t"][ids] if "d2t" in dparams else ids


def _pass(params, dparams, dkv, token_ids, feats, meta, drafter: Drafter, attn, from_target: bool):
    """One drafter pass -> (dkv, hidden [T, D] for _propose_from)."""
    if drafter.method == "draft_model":
        return forward(dparams, dkv, token_ids, meta, drafter.cfg, attn)
    return _head_forward(params, dparams, dkv, token_ids, feats, meta, drafter, attn, from_target)


def _propose_from(params, dparams, h, drafter: Drafter):
    if drafter.method == "draft_model":
        return jnp.argmax(compute_logits(dparams, h, drafter.cfg), -1).astype(jnp.int32)
    return _head_tokens(params, dparams, h, drafter)


def draft_step_fn(
    params,
    dparams,
    dkv,
    ints,
    floats,
    prev_in,
    prev_out,
    feats,
    emitted,
    next_ids,
    num_pages,
    layout: PackedLayout,
    *,
    drafter: Drafter,
    attn: AttentionConfig,
    block_size: int,
):
    """The draft program of one target step (see the module docstring). params: the target's (embedding and
    output head, shared by EAGLE heads); dparams / dkv: the drafter's weights and KV (donated); ints, floats,
    layout: the step's packed host inputs; prev_in / prev_out: prev_tokens before / after the step (tokens fed
    from the device, tokens sampled); feats [T, F] the step's target features (EAGLE); emitted: a verify step's
    (tokens [B, K + 1], num_emitted [B]), None for a plain step; next_ids [B]: the token after each chunk when
    the step sampled none for it (a partial prefill), else -1; num_pages [B]: each sequence's pages.
    Returns (dkv, proposals [B, K] or None)."""
    token_ids, src_rows, meta, logits_slot, *_ = unpack_host_args(ints, floats, layout)  # (smd, targets, slots)
    token_ids = jnp.where(src_rows >= 0, prev_in[jnp.maximum(src_rows, 0)], token_ids)
    qsl, seq_lens = meta.query_start_loc, meta.seq_lens
    B = seq_lens.shape[0]
    live = seq_lens > 0
    if emitted is None:  # a plain step: keep the drafter's KV in step with the target's
        if drafter.uses_features:
            T = token_ids.shape[0]
            nxt = jnp.concatenate([token_ids[1:], jnp.zeros((1,), jnp.int32)])
            last = jnp.where(live, qsl[1:] - 1, T)  # padding sequences: out of range, dropped
            nxt = nxt.at[last].set(jnp.where(next_ids >= 0, next_ids, prev_out[:B]), mode="drop")
            dkv, _ = _pass(params, dparams, dkv, nxt, feats, meta, drafter, attn, True)
        else:
            dkv, _ = _pass(params, dparams, dkv, token_ids, None, meta, drafter, attn, True)
        return dkv, None

    tokens, num_emitted = emitted
    K, R, S = drafter.num_spec, drafter.rows, block_size
    start = meta.positions[jnp.minimum(qsl[:B], token_ids.shape[0] - 1)]  # the first verified position (L - 1)
    pos = start[:, None] + jnp.arange(R)[None, :]  # [B, R]
    if drafter.uses_features:  # pairs (feature of verified row j, emitted token j + 1)
        chunk_ids = jnp.maximum(tokens, 0)
        chunk_feats = feats[logits_slot[0]]  # the verify rows, [B * (K + 1), F] (repeated past a row's drafts)
    else:  # [the last known token, the emitted ones]
        chunk_ids = jnp.concatenate(
            [token_ids[jnp.minimum(qsl[:B], token_ids.shape[0] - 1)][:, None], jnp.maximum(tokens, 0)], axis=1
        )
        chunk_feats = None
    n_live = live.sum()
    chunk_meta = AttentionMetadata(
        pos.reshape(-1),
        _slots(meta.block_tables, pos, num_pages, live, S).reshape(-1),
        jnp.where(live, start + R, 0).astype(jnp.int32),
        (R * jnp.minimum(jnp.arange(B + 1), n_live)).astype(jnp.int32),
        meta.block_tables,
        False,
    )
    dkv, h = _pass(params, dparams, dkv, chunk_ids.reshape(-1), chunk_feats, chunk_meta, drafter, attn, True)
    # The row of the last emitted token: e - 1 for the draft model's [known, emitted...], e - 1 for EAGLE's
    # pairs (feature j, token j + 1) whose token is the last emitted one.
    at = jnp.arange(B) * R + num_emitted - (1 if drafter.uses_features else 0)
    h = h[at]
    first = _propose_from(params, dparams, h, drafter)
    # Pass i feeds proposal i: the draft model at its own position (L - 1 + e + i), an EAGLE head as the pair
    # (its previous hidden state, proposal i) one position earlier.
    p0 = start + num_emitted - (1 if drafter.uses_features else 0)

    def step(i, carry):
        dkv, h, tok, out = carry
        p = p0 + i
        m = AttentionMetadata(
            p,
            _slots(meta.block_tables, p, num_pages, live, S),
            jnp.where(live, p + 1, 0),
            jnp.arange(B + 1, dtype=jnp.int32),
            meta.block_tables,
            True,
        )
        dkv, h = _pass(params, dparams, dkv, tok, h, m, drafter, attn, False)
        tok = _propose_from(params, dparams, h, drafter)
        return dkv, h, tok, out.at[:, i].set(tok)

    out = jnp.zeros((B, K), jnp.int32).at[:, 0].set(first)
    dkv, _, _, out = jax.lax.fori_loop(1, K, step, (dkv, h, first, out))
    return dkv, out
