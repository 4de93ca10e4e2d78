"""The rejection sampler: without proposals it is the plain sampler; greedy rows emit exactly the target's
argmax chain; with temperature > 0 the emitted tokens follow the target's processed distributions (a statistical
test with a fixed seed whose bound a wrong acceptance rule fails, shown on two wrong rules)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.engine import rejection_sampler, sampler
from jaxllm.engine.sampler import SamplerFlags, SamplingMetadata

rejection_sample = jax.jit(rejection_sampler.rejection_sample, static_argnums=4)
sample = jax.jit(sampler.sample, static_argnums=2)


def metadata(B, temperature=1.0, top_k=0, presence=0.0, seed=0, steps=0, penalty_tokens=None):
    f = lambda v, dt=jnp.float32: jnp.broadcast_to(jnp.asarray(v, dt), (B,))  # noqa: E731
    pen = -jnp.ones((B, 1), jnp.int32) if penalty_tokens is None else jnp.asarray(penalty_tokens, jnp.int32)
    return SamplingMetadata(
        temperature=f(temperature),
        top_p=f(1.0),
        top_k=f(top_k, jnp.int32),
        min_p=f(0.0),
        presence=f(presence),
        frequency=f(0.0),
        repetition=f(1.0),
        seeds=jnp.arange(seed, seed + B, dtype=jnp.uint32),
        steps=f(steps, jnp.int32),
        penalty_tokens=pen,
        penalty_is_output=pen >= 0,
        bias_ids=-jnp.ones((B, 1), jnp.int32),
        bias_values=jnp.zeros((B, 1)),
        allowed_ids=-jnp.ones((B, 1), jnp.int32),
        token_bitmask=-jnp.ones((1, 1), jnp.int32),
        bitmask_slot=-jnp.ones((B,), jnp.int32),
    )


def test_without_proposals_it_is_the_plain_sampler():
    B, V, K = 6, 300, 3
    logits = jax.random.normal(jax.random.key(3), (B, K + 1, V)) * 3
    md = metadata(
        B,
        temperature=jnp.array([0.0, 1.0, 0.7, 0.0, 1.3, 0.9]),
        top_k=jnp.array([0, 5, 0, 0, 40, 0]),
        presence=0.5,
        steps=7,
        penalty_tokens=[[1, 2, -1]] * B,
    )
    flags = SamplerFlags(filtering=True, penalties=True, num_logprobs=2)
    drafts = jnp.zeros((B, K), jnp.int32)
    got = rejection_sample(logits, drafts, jnp.zeros(B, jnp.int32), md, flags)
    want = sample(logits[:, 0], md, flags)
    np.testing.assert_array_equal(got[0][:, 0], want[0])
    assert (np.asarray(got[0][:, 1:]) == -1).all() and (np.asarray(got[1]) == 1).all()
    for g, w in zip(got[2:], want[1:], strict=True):
        np.testing.assert_allclose(np.asarray(g)[:, 0], w, rtol=1e-6)


def test_greedy_rows_follow_the_argmax_chain():
    V, K = 50, 4
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, K + 1, V)).astype(np.float32)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :K].copy()
    drafts[0, 2] = (drafts[0, 2] + 1) % V  # row 0: two accepted, then the target's token at position 2
    drafts[1, 0] = (drafts[1, 0] + 1) % V  # row 1: none accepted
    num = np.array([K, K, 3])  # row 2: its three proposals accepted, then the bonus token
    tokens, emitted = rejection_sample(
        jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num), metadata(3, temperature=0.0), SamplerFlags()
    )[:2]
    assert np.asarray(emitted).tolist() == [3, 1, 4]
    tokens = np.asarray(tokens)
    assert tokens[0].tolist() == [*argmax[0, :3], -1, -1]
    assert tokens[1].tolist() == [argmax[1, 0], -1, -1, -1, -1]
    assert tokens[2].tolist() == [*argmax[2, :4], -1]


def test_greedy_penalties_count_the_proposals_before_each_position():
    """A presence penalty at position 1 applies to d_1 (an output token once accepted), as without speculation."""
    V = 8
    logits = np.zeros((1, 3, V), np.float32)
    logits[0, :, 3] = 2.0  # token 3 best everywhere, token 5 second
    logits[0, :, 5] = 1.5
    md = metadata(1, temperature=0.0, presence=1.0)
    tokens, emitted = rejection_sample(
        jnp.asarray(logits), jnp.asarray([[3, 3]]), jnp.asarray([2]), md, SamplerFlags(penalties=True)
    )[:2]
    # position 0: 3 wins and d_1 = 3 is accepted; position 1: 3 is penalised to 1.0 < 1.5, so 5, not d_2 = 3
    assert np.asarray(tokens)[0].tolist() == [3, 5, -1] and int(emitted[0]) == 2


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z[np.isfinite(z)].max())
    e[~np.isfinite(z)] = 0
    return e / e.sum()


N = 40_000
TV_BOUND = 0.02  # ~4x the expected total-variation error of N draws over these vocabularies


def _tv(samples, p):
    counts = np.bincount(samples, minlength=len(p)) / len(samples)
    return 0.5 * np.abs(counts - p).sum()


# Target logits at positions 0, 1, 2 (conditional on the proposals before them) and the proposals d_1, d_2.
LOGITS = np.log(
    np.array(
        [[0.05, 0.45, 0.2, 0.1, 0.15, 0.05], [0.3, 0.1, 0.25, 0.05, 0.1, 0.2], [0.1, 0.1, 0.1, 0.4, 0.2, 0.1]],
        np.float32,
    )
)
DRAFTS = [1, 2]
TEMP, TOP_K, PRESENCE = 0.8, 4, 0.7


def expected_distributions():
    """What sampling without speculation draws from at each position: presence penalty on the earlier
    proposals (outputs by then), temperature, then top-k."""
    out = []
    for j, row in enumerate(LOGITS):
        y = row.astype(np.float64) - PRESENCE * np.isin(np.arange(6), DRAFTS[:j])
        y = y / TEMP
        y[np.argsort(-y)[TOP_K:]] = -np.inf
        out.append(_softmax(y))
    return out


def check_emissions(tokens, emitted, p):
    """Total variation of: the first emitted token against p[0]; the second, among steps that accepted d_1,
    against p[1]; the third, among those that accepted d_1 and d_2, against p[2]."""
    first = tokens[:, 0]
    acc1 = emitted >= 2
    acc2 = emitted >= 3
    return [_tv(first, p[0]), _tv(tokens[acc1, 1], p[1]), _tv(tokens[acc2, 2], p[2])], acc1.mean(), acc2.mean()


def test_output_distribution_is_the_targets():
    p = expected_distributions()
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N, 3, 6))
    md = metadata(N, temperature=TEMP, top_k=TOP_K, presence=PRESENCE, seed=1234)
    tokens, emitted = rejection_sample(
        logits, jnp.asarray([DRAFTS] * N), jnp.full(N, 2, jnp.int32), md, SamplerFlags(filtering=True, penalties=True)
    )[:2]
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    tvs, rate1, rate2 = check_emissions(tokens, emitted, p)
    assert max(tvs) < TV_BOUND, tvs
    # acceptance happens with the target's probability of the proposal
    assert rate1 == pytest.approx(p[0][DRAFTS[0]], abs=0.01)
    assert rate2 == pytest.approx(p[0][DRAFTS[0]] * p[1][DRAFTS[1]], abs=0.01)


@pytest.mark.parametrize("rule", ["resample_from_target", "accept_by_ratio_to_max"])
def test_the_bound_fails_wrong_acceptance_rules(rule):
    """The same statistic on samples drawn with a wrong rule exceeds the bound: drawing the replacement from p
    instead of the residual (the proposal comes out too often), or accepting with p(d) / max(p) (too often)."""
    p = expected_distributions()
    rng = np.random.default_rng(1234)
    tokens = np.full((N, 3), -1)
    emitted = np.zeros(N, int)
    for i in range(N):
        for j in range(3):
            pj = p[j]
            d = DRAFTS[j] if j < 2 else None
            if d is not None:
                a = pj[d] if rule == "resample_from_target" else pj[d] / pj.max()
                if rng.random() < a:
                    tokens[i, j] = d
                    continue
                q = pj if rule == "resample_from_target" else np.where(np.arange(6) == d, 0, pj) / (1 - pj[d])
            else:
                q = pj
            tokens[i, j] = rng.choice(6, p=q)
            break
        emitted[i] = j + 1
    tvs, _, _ = check_emissions(tokens, emitted, p)
    assert max(tvs) > TV_BOUND, tvs
