"""On-device sampling: a pure function of the logits and per-request arrays.

Greedy requests are temperature 0 inside the same compiled function, so a mixed batch never recompiles.
Static switches (SamplerFlags) only turn on work a batch needs: sorting for top-p/top-k, penalties, sparse
logit biases, top-logprobs. Randomness is per request: the key for a request's i-th output token is
fold_in(key(seed), i), so seeded outputs do not depend on the batch they run in; a draw takes two uniforms of it
(categorical: inverse CDF over the vocabulary's chunks, then within the chunk).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class SamplerFlags:
    filtering: bool = False  # any top_p < 1 or top_k > 0 (needs a sort over the vocabulary)
    penalties: bool = False  # any presence/frequency/repetition penalty
    bias: bool = False  # any sparse logit bias (logit_bias, min_tokens, bad_words, allowed_token_ids)
    num_logprobs: int = 0  # top-k logprobs to return (0: only the sampled token's)
    grammar: bool = False  # any structured-output mask (token_bitmask)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence",
        "frequency",
        "repetition",
        "seeds",
        "steps",
        "penalty_tokens",
        "penalty_is_output",
        "bias_ids",
        "bias_values",
        "allowed_ids",
        "token_bitmask",
        "bitmask_slot",
        "lora_slots",
    ],
    meta_fields=[],
)
@dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [B] f32, 0 = greedy
    top_p: jax.Array  # [B] f32
    top_k: jax.Array  # [B] int32, 0 = off
    min_p: jax.Array  # [B] f32
    presence: jax.Array  # [B] f32
    frequency: jax.Array  # [B] f32
    repetition: jax.Array  # [B] f32
    seeds: jax.Array  # [B] uint32
    steps: jax.Array  # [B] int32 index of the token being sampled in the request's output
    penalty_tokens: jax.Array  # [B, Lp] int32 prompt + output ids, -1 padding ([B, 1] when unused)
    penalty_is_output: jax.Array  # [B, Lp] bool
    bias_ids: jax.Array  # [B, Lb] int32, -1 padding
    bias_values: jax.Array  # [B, Lb] f32
    allowed_ids: jax.Array  # [B, La] int32, -1 padding; all -1 = everything allowed
    # Structured outputs: [Bc, W] int32 masks, W = ceil(V / 32), of the Bc (a power of 2) constrained rows: token t
    # allowed iff bit t % 32 of word t // 32 is set ([1, 1] when unused); and each row's mask in it ([B] int32,
    # -1: unconstrained)
    token_bitmask: jax.Array
    bitmask_slot: jax.Array
    lora_slots: jax.Array | None = None  # [B] int32 LoRA slot of each row (lm_head adapters; -1: none), or None


def sample(logits, md: SamplingMetadata, flags: SamplerFlags):
    """logits: [B, V] f32. Returns (tokens [B] int32, logprobs [B] f32 of the sampled tokens under the raw
    model distribution (constrained by grammar masks, as vLLM's), ranks [B] int32 (zeros unless
    flags.num_logprobs), top_ids [B, k], top_logprobs [B, k]).

    Each pass over [B, V] costs ~0.1 ms at B = 500 and V = 128k, so the batch's raw log-softmax is never
    materialized: log p = logit - logsumexp, and the rank and the top-k follow the raw logits' order."""
    logits = constrained(logits, md, flags)
    raw_max = logits.max(-1)
    x, y, y_max = process_logits(logits, md, flags, raw_max)
    lse, y_masses = lse_and_masses(logits, raw_max, y, y_max)
    greedy_tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
    random_tokens = categorical(y, row_keys(md), y_max, y_masses)
    tokens = jnp.where(md.temperature > 0, random_tokens, greedy_tokens)
    return (tokens, *token_logprobs(logits, tokens, raw_max, lse, flags, greedy_tokens if x is logits else None))


def constrained(logits, md: SamplingMetadata, flags: SamplerFlags):
    """logits [B, V] with each row's structured-output mask applied (-inf where its grammar forbids a token; rows
    with no mask, slot -1, as they are). As vLLM applies the grammar bitmask to the logits before its sampler, the
    returned logprobs (and their ranks and top-k) are those of the constrained distribution; penalties, biases and
    temperature still do not change them. A mask that allows nothing leaves its row unmasked."""
    if not flags.grammar:
        return logits
    V = logits.shape[1]
    t = jnp.arange(V)
    words = md.token_bitmask[jnp.maximum(md.bitmask_slot, 0)]  # [B, W]
    allowed = ((words[:, t >> 5] >> (t & 31)) & 1 == 1) | (md.bitmask_slot < 0)[:, None]
    allowed = allowed | ~allowed.any(-1, keepdims=True)
    return jnp.where(allowed, logits, -jnp.inf)


def process_logits(logits, md: SamplingMetadata, flags: SamplerFlags, raw_max=None):
    """The request's processing of logits [B, V] (raw, or constrained() by grammar masks): (x, y, y_max) with x the
    greedy space (allowed ids, logit biases, penalties), y the sampling space (x / temperature, min_p, top-k / top-p;
    -inf outside what may be sampled) and y_max [B] its row maxima. x is logits itself when nothing changed it. The
    rejection sampler runs the same function on its per-position rows, so speculation samples from exactly these
    distributions. A biased or penalized -inf stays -inf, so no bias brings back a token the grammar forbids."""
    B, V = logits.shape
    x = logits
    if flags.bias:  # vLLM V1's order: allowed ids and logit biases, then penalties (on the biased logits)
        rows = jnp.arange(B)[:, None]
        x = x.at[rows, jnp.where(md.bias_ids < 0, V, md.bias_ids)].add(md.bias_values, mode="drop")
        allowed = (
            jnp.zeros((B, V), bool).at[rows, jnp.where(md.allowed_ids < 0, V, md.allowed_ids)].set(True, mode="drop")
        )
        any_allowed = (md.allowed_ids >= 0).any(-1, keepdims=True)
        x = jnp.where(any_allowed & ~allowed, -jnp.inf, x)
    if flags.penalties:
        x = _apply_penalties(x, md)
    temp = jnp.where(md.temperature > 0, md.temperature, 1.0)[:, None]
    y = x / temp
    # min_p, then top-k / top-p on what it leaves (vLLM V1's order). min_p keeps p >= min_p * p_max, i.e.
    # y >= y_max + log(min_p): no softmax needed (log 0 = -inf keeps all). y_max = max(x) / temp exactly (dividing
    # by temp > 0 is monotonic, and min_p / top-k / top-p keep the best token), so the logits' max serves unless
    # penalties or biases changed x: one pass over [B, V] less.
    x_max = raw_max if x is logits and raw_max is not None else x.max(-1)
    y_max = x_max[:, None] / temp
    y = jnp.where(y < y_max + jnp.log(md.min_p)[:, None], -jnp.inf, y)
    if flags.filtering:
        y = _top_k_top_p(y, md.top_k, md.top_p)
    return x, y, y_max[:, 0]


def lse_and_masses(logits, raw_max, y, y_max):
    """(logsumexp [B] of the raw logits [B, V], chunk_masses(y, y_max) [B, nc]) from one variadic reduction over
    the logits' chunks: one pass for both (H100, B 500 x V 128k: one 127 us kernel where the two reductions took 102
    + 88 us; bench/results/throughput_fp8_h100_{229f0ef,7d6e529}_prof.json). The sampler and the rejection sampler
    both take lse from here, so their logprobs agree to the bit."""
    raw_masses, y_masses = jax.lax.reduce(
        (_mass(_chunks(logits), raw_max[:, None, None]), _mass(_chunks(y), y_max[:, None, None])),
        (np.float32(0), np.float32(0)),
        lambda a, b: (a[0] + b[0], a[1] + b[1]),
        (2,),
    )
    return raw_max + jnp.log(raw_masses.sum(-1)), y_masses


def row_keys(md: SamplingMetadata):
    """Each row's PRNG key: fold_in(key(seed), index of the token being sampled in the request's output)."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(md.seeds, md.steps)


# categorical's chunk: a draw picks a chunk of the vocabulary by the chunks' masses, then a token in it.
SAMPLE_CHUNK = 1024


def categorical(y, keys, y_max=None, masses=None):
    """One draw from softmax(y) in each row of y [B, V] (f32, -inf: never drawn) with that row's key: int32 [B].
    y_max: y's row maxima [B] where known (process_logits'), else computed (a pass over [B, V]); masses: its
    chunk_masses(y, y_max) where computed already.

    Inverse-CDF sampling in two levels with two uniforms a row: a chunk of SAMPLE_CHUNK tokens by the chunks'
    masses (sum of exp(y - max y), one pass over [B, V]), then a token of that chunk by its cumulative mass. Gumbel-max
    (argmax(y + Gumbel noise)) draws the same distribution but needs a random value per token: at B 500 x V 128k on an
    H100 the sampler's reductions took 373 + 90 us a step with it, 127 + 90 with this draw (lse_and_masses;
    bench/results/throughput_fp8_h100_{d3d7775_old,229f0ef}_prof.json)."""
    C = min(SAMPLE_CHUNK, y.shape[1])
    u = jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys)
    y_max = jnp.max(y, axis=-1) if y_max is None else y_max
    chunk = inverse_cdf(chunk_masses(y, y_max) if masses is None else masses, u[:, 0])
    in_chunk = jnp.take_along_axis(_chunks(y), chunk[:, None, None], axis=1)[:, 0]  # [B, C]: y of the chosen chunk
    return (chunk * C + inverse_cdf(_mass(in_chunk, y_max[:, None]), u[:, 1])).astype(jnp.int32)


def chunk_masses(v, v_max):
    """[B, ceil(V / SAMPLE_CHUNK)]: sum of exp(v - v_max) over each chunk of SAMPLE_CHUNK columns of v [B, V]."""
    return _mass(_chunks(v), v_max[:, None, None]).sum(-1)


def _chunks(v):
    """v [B, V] as [B, nc, C] chunks of C = min(SAMPLE_CHUNK, V) columns, the last padded with -inf."""
    B, V = v.shape
    C = min(SAMPLE_CHUNK, V)
    nc = -(-V // C)
    return jnp.pad(v, ((0, 0), (0, nc * C - V)), constant_values=-jnp.inf).reshape(B, nc, C)


def _mass(v, v_max):
    """exp(v - v_max), 0 where v is -inf (also where a whole row is: no NaN)."""
    return jnp.where(v == -jnp.inf, 0.0, jnp.exp(v - v_max))


def inverse_cdf(w, u):
    """[B] index i of w [B, n] (weights >= 0) with probability w_i / sum(w), for u ~ U[0, 1): the first positive
    weight whose cumulative sum exceeds u * sum(w); the last positive weight where rounding leaves none (0 when
    every weight is 0)."""
    c = jnp.cumsum(w, axis=-1)
    over = (c > (u * c[:, -1])[:, None]) & (w > 0)
    last = w.shape[-1] - 1 - jnp.argmax((w > 0)[:, ::-1], axis=-1)
    return jnp.where(over.any(-1), jnp.argmax(over, axis=-1), jnp.where((w > 0).any(-1), last, 0)).astype(jnp.int32)


def token_logprobs(logits, tokens, raw_max, lse, flags: SamplerFlags, raw_argmax=None):
    """(logprobs [B], ranks [B], top ids [B, k], top logprobs [B, k]) of tokens under the raw logits; ranks
    and the top-k only with flags.num_logprobs (raw_argmax, when known, fills the [B, 1] slot otherwise)."""
    B = logits.shape[0]
    token_logit = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    token_lp = token_logit - lse
    if flags.num_logprobs:  # the rank, like the top-k, is only returned with logprobs (the runner asks for >= 1)
        ranks = (logits > token_logit[:, None]).sum(-1).astype(jnp.int32) + 1
        top_logits, top_ids = jax.lax.top_k(logits, flags.num_logprobs)
        top_lp = top_logits - lse[:, None]
    else:  # not returned to anyone: zero ranks, and the raw argmax is enough to fill the [B, 1] slot
        ranks = jnp.zeros((B,), jnp.int32)
        top_ids = (jnp.argmax(logits, -1) if raw_argmax is None else raw_argmax)[:, None]
        top_lp = (raw_max - lse)[:, None]
    return token_lp, ranks, top_ids.astype(jnp.int32), top_lp


def _apply_penalties(x, md: SamplingMetadata):
    B, V = x.shape
    rows = jnp.arange(B)[:, None]
    ids = jnp.where(md.penalty_tokens < 0, V, md.penalty_tokens)
    out_counts = jnp.zeros((B, V), jnp.float32).at[rows, ids].add(md.penalty_is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((B, V), bool).at[rows, ids].set(True, mode="drop")
    rep = md.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)  # HF/vLLM: prompt and output tokens
    x = x - md.frequency[:, None] * out_counts - md.presence[:, None] * (out_counts > 0)
    return x


def _top_k_top_p(y, top_k, top_p):
    V = y.shape[-1]
    sorted_y = jnp.sort(y, axis=-1)[:, ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_y, (k - 1)[:, None], axis=-1)
    sorted_y = jnp.where(jnp.arange(V)[None, :] < k[:, None], sorted_y, -jnp.inf)
    probs = jax.nn.softmax(sorted_y, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep = (before < top_p[:, None]) | (jnp.arange(V) == 0)[None, :]  # the best token always stays (top_p
    # may be a positive double that is 0 in float32)
    cutoff = jnp.min(jnp.where(keep, sorted_y, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(cutoff, kth)
    return jnp.where(y < threshold, -jnp.inf, y)


def pad_rows(rows: list[list], width_bucket: int, fill, dtype) -> np.ndarray:
    """[len(rows), width] array of ragged rows (width = smallest power of 2 >= longest, >= width_bucket)."""
    width = max([len(r) for r in rows] + [1])
    width = max(width_bucket, 1 << (width - 1).bit_length())
    out = np.full((len(rows), width), fill, dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
