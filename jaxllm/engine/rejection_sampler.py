"""Rejection sampling of speculated tokens: a pure function of the target's logits at every proposed position.

A sequence with n proposed tokens d_1..d_n (n <= K) is verified in one target step whose inputs are its last
token and the proposals, so the step has n + 1 rows of logits: row j holds p_j, the target's distribution of
the token after d_1..d_j. Each row is processed exactly as the plain sampler processes a row (sampler.constrained:
grammar masks; sampler.process_logits: penalties, biases, temperature, top-k / top-p, min_p), with d_1..d_j counted
as output tokens for the penalties, so p_j is what sampling without speculation would draw from.

Proposals are deterministic (n-gram lookup, or a drafter's argmax, as vLLM V1 drafts), so the draft
distribution q is one-hot and the standard rule (Leviathan et al., Chen et al.) reduces to:
- greedy rows: accept d_{j+1} while it is argmax(x_j); then emit argmax(x_a) at the first mismatch a (or the
  bonus row n). The output is exactly the non-speculative greedy output.
- temperature > 0: accept d_{j+1} with probability p_j(d_{j+1}) (u < p, u uniform); at the first rejection a
  emit a token from the residual distribution norm(max(p_a - q_a, 0)), which is p_a without d_{a+1}; after n
  acceptances emit a bonus token from p_n. Then P(emit x at row j) = p_j(x) for every x: the target's
  distribution, whatever the proposals.
Both draws use the row's key, fold_in(key(seed), output index), as the plain sampler does; the uniform uses a
key folded once more.

Shapes: B sequences, K = num_speculative_tokens, V vocabulary; rows flatten [B, K + 1] -> B * (K + 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.engine.sampler import (
    SamplerFlags,
    SamplingMetadata,
    categorical,
    constrained,
    lse_and_masses,
    process_logits,
    row_keys,
    token_logprobs,
)

_UNIFORM_FOLD = 0x5EC  # the acceptance test's uniform: fold_in(row key, this), apart from categorical's two


def expand_metadata(md: SamplingMetadata, drafts, K: int) -> SamplingMetadata:
    """md's B rows -> B * (K + 1) rows (row b * (K + 1) + j: sequence b's position j): the same settings, the
    output index advanced by j, and drafts [B, K] d_1..d_j appended to the penalty history as outputs."""
    B = md.temperature.shape[0]
    rep = lambda a: None if a is None else jnp.repeat(a, K + 1, axis=0)  # noqa: E731  (None: e.g. no LoRA slots)
    j = jnp.tile(jnp.arange(K + 1, dtype=jnp.int32), B)
    # Position j sees proposals i < j: [B * (K + 1), K] of d_{i+1} or -1.
    seen = jnp.arange(K)[None, :] < j[:, None]
    hist = jnp.where(seen, rep(drafts), -1).astype(jnp.int32)
    fields = {f.name: rep(getattr(md, f.name)) for f in dataclasses.fields(md) if f.name != "token_bitmask"}
    fields["steps"] = fields["steps"] + j
    fields["penalty_tokens"] = jnp.concatenate([fields["penalty_tokens"], hist], axis=1)
    fields["penalty_is_output"] = jnp.concatenate([fields["penalty_is_output"], seen], axis=1)
    return SamplingMetadata(**fields, token_bitmask=md.token_bitmask)


def rejection_sample(logits, drafts, num_drafts, md: SamplingMetadata, flags: SamplerFlags):
    """logits [B, K + 1, V] f32 (raw), drafts [B, K] int32 (entries past num_drafts ignored), num_drafts [B]
    int32, md: the B sequences' sampling rows (steps: output index of the first new token).

    Returns (tokens [B, K + 1] int32: the emitted tokens, -1 after the last; num_emitted [B] int32 = accepted
    proposals + 1; logprobs [B, K + 1] of the emitted tokens under the raw distributions; ranks [B, K + 1];
    top ids / top logprobs [B, K + 1, k])."""
    B, K1, V = logits.shape
    K = K1 - 1
    rows = logits.reshape(B * K1, V)
    mdr = expand_metadata(md, drafts, K)
    rows = constrained(rows, mdr, flags)
    raw_max = rows.max(-1)
    x, y, y_max = process_logits(rows, mdr, flags, raw_max)
    lse, y_masses = lse_and_masses(rows, raw_max, y, y_max)
    greedy = jnp.argmax(x, -1).astype(jnp.int32).reshape(B, K1)

    # Draft token at each row (the token row j verifies is d_{j+1}; the bonus row has none: V, out of range).
    pos = jnp.arange(K1)[None, :]
    nxt = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1).astype(jnp.int32)  # [B, K + 1]
    nxt = jnp.where(pos < num_drafts[:, None], nxt, V)
    nxt_flat = nxt.reshape(-1)
    is_next = jnp.arange(V)[None, :] == nxt_flat[:, None]
    resid = categorical(jnp.where(is_next, -jnp.inf, y), row_keys(mdr)).reshape(B, K1)
    y_lse = y_max + jnp.log(y_masses.sum(-1))
    p_next = jnp.exp(jnp.take_along_axis(y, jnp.minimum(nxt_flat, V - 1)[:, None], -1)[:, 0] - y_lse)
    keys = jax.vmap(lambda k: jax.random.fold_in(k, _UNIFORM_FOLD))(row_keys(mdr))
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)

    random_row = (md.temperature > 0)[:, None]
    accept = jnp.where(random_row, (u < p_next).reshape(B, K1), nxt == greedy) & (pos < num_drafts[:, None])
    num_accepted = jnp.cumprod(accept.astype(jnp.int32), axis=1).sum(1)  # leading acceptances, <= num_drafts
    # At the stopping row a: the greedy token, the residual draw after a rejection, the plain draw at the bonus
    # row (its residual is the plain draw: no token is excluded there).
    last = jnp.where(random_row, resid, greedy)
    tokens = jnp.where(pos < num_accepted[:, None], nxt, jnp.where(pos == num_accepted[:, None], last, -1))
    tokens = tokens.astype(jnp.int32)
    lp, ranks, top_ids, top_lp = token_logprobs(rows, jnp.maximum(tokens, 0).reshape(-1), raw_max, lse, flags)
    return (
        tokens,
        num_accepted + 1,
        lp.reshape(B, K1),
        ranks.reshape(B, K1),
        top_ids.reshape(B, K1, -1),
        top_lp.reshape(B, K1, -1),
    )
