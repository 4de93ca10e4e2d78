"""The sampler against a plain reference: the raw log-softmax materialized, min_p through softmax
probabilities, ranks and top-k over the log-probabilities (what sample() avoids computing on the device)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.engine.sampler import SAMPLE_CHUNK, SamplerFlags, SamplingMetadata, categorical, inverse_cdf, sample


def reference(logits, md: SamplingMetadata, k: int):
    raw = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, -1)
    y = logits / jnp.where(md.temperature > 0, md.temperature, 1.0)[:, None]
    probs = jax.nn.softmax(y, axis=-1)
    y = jnp.where(probs < md.min_p[:, None] * probs.max(-1, keepdims=True), -jnp.inf, y)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(md.seeds, md.steps)
    tokens = jnp.where(md.temperature > 0, categorical_reference(y, keys), greedy)
    token_lp = jnp.take_along_axis(raw, tokens[:, None], -1)[:, 0]
    ranks = (raw > token_lp[:, None]).sum(-1) + 1
    top_lp, top_ids = jax.lax.top_k(raw, k)
    return tokens, token_lp, ranks, top_ids, top_lp


def categorical_reference(y, keys):
    """The draw in float64 numpy: two uniforms of the row's key; the chunk of SAMPLE_CHUNK tokens whose cumulative
    mass first exceeds u0 * total, then the token of that chunk the same way with u1 (searchsorted on the sums)."""
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys), np.float64)
    p = np.exp(np.asarray(y, np.float64) - np.asarray(y, np.float64).max(-1, keepdims=True))
    C = min(SAMPLE_CHUNK, p.shape[1])
    tokens = []
    for row, (u0, u1) in zip(p, u, strict=True):
        chunks = [row[i : i + C] for i in range(0, len(row), C)]
        masses = np.cumsum([c.sum() for c in chunks])
        c = int(np.searchsorted(masses, u0 * masses[-1], side="right"))
        within = np.cumsum(chunks[c])
        tokens.append(c * C + int(np.searchsorted(within, u1 * within[-1], side="right")))
    return jnp.asarray(tokens)


def metadata(B, temperature, min_p, seed=0):
    z = lambda dt=jnp.float32: jnp.zeros((B,), dt)  # noqa: E731
    return SamplingMetadata(
        temperature=jnp.asarray(temperature, jnp.float32),
        top_p=jnp.ones((B,)),
        top_k=z(jnp.int32),
        min_p=jnp.asarray(min_p, jnp.float32),
        presence=z(),
        frequency=z(),
        repetition=jnp.ones((B,)),
        seeds=jnp.arange(seed, seed + B, dtype=jnp.uint32),
        steps=jnp.arange(B, dtype=jnp.int32) * 3,
        penalty_tokens=-jnp.ones((B, 1), jnp.int32),
        penalty_is_output=jnp.zeros((B, 1), bool),
        bias_ids=-jnp.ones((B, 1), jnp.int32),
        bias_values=z()[:, None],
        allowed_ids=-jnp.ones((B, 1), jnp.int32),
        token_bitmask=-jnp.ones((1, 1), jnp.int32),
        bitmask_slot=-jnp.ones((B,), jnp.int32),
    )


@pytest.mark.parametrize("num_logprobs,V", [(0, 1000), (3, 1000), (0, 2 * SAMPLE_CHUNK + 300)])
def test_sample_matches_reference(num_logprobs, V):
    B = 8
    logits = jax.random.normal(jax.random.key(1), (B, V), jnp.float32) * 4
    md = metadata(B, [0.0, 1.0, 0.7, 1.3, 0.0, 1.0, 2.0, 0.5], [0.0, 0.0, 0.1, 0.05, 0.3, 0.9, 0.0, 0.2])
    got = sample(logits, md, SamplerFlags(num_logprobs=num_logprobs))
    want = reference(logits, md, max(num_logprobs, 1))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[2], want[2] if num_logprobs else 0)  # ranks only come with logprobs
    np.testing.assert_array_equal(got[3], want[3])
    np.testing.assert_allclose(got[4], want[4], rtol=1e-5, atol=1e-5)
    assert got[3].shape == (B, max(num_logprobs, 1))


def test_min_p_keeps_only_tokens_near_the_top():
    B, V = 64, 50
    logits = jnp.tile(jnp.linspace(0.0, -6.0, V)[None], (B, 1))  # p_i / p_max = exp(-6 i / 49)
    md = metadata(B, [1.0] * B, [0.1] * B, seed=5)
    tokens = np.asarray(sample(logits, md, SamplerFlags())[0])
    # exp(-6 i / 49) >= 0.1  <=>  i <= 18.8: tokens 0..18 are possible, none beyond
    assert tokens.max() <= 18 and len(set(tokens.tolist())) > 5


def test_top_p_below_float32_keeps_the_best_token():
    """top_p is validated as (0, 1] in double precision; 1e-300 is 0 in float32, where no token would pass
    `mass of better tokens < top_p`: the best token always stays, so top_p that small is greedy."""
    B, V = 4, 300
    logits = jax.random.normal(jax.random.key(3), (B, V), jnp.float32) * 3
    md = metadata(B, [1.0] * B, [0.0] * B, seed=9)
    md = md.__class__(**{**md.__dict__, "top_p": jnp.asarray([1e-300, 1e-30, 1e-3, 1e-300], jnp.float32)})
    tokens = np.asarray(sample(logits, md, SamplerFlags(filtering=True))[0])
    np.testing.assert_array_equal(tokens, np.asarray(jnp.argmax(logits, -1)))


def test_token_bitmask_allows_only_its_tokens():
    """Structured outputs' mask: bit t % 32 of word t // 32 allows token t (V not a multiple of 32); greedy
    and sampled rows pick allowed tokens only, logprobs, ranks and the top-k are those of the masked distribution
    (vLLM applies the bitmask to the logits before its sampler), and a row with no mask (slot -1) is sampled and
    scored as without masks."""
    import dataclasses

    B, V = 6, 1000
    rng = np.random.default_rng(0)
    logits = jax.random.normal(jax.random.key(2), (B, V), jnp.float32) * 4
    allowed = rng.random((B, V)) < 0.05
    allowed[:, 7] = True
    allowed[5] = True  # an unconstrained row (no mask)
    bits = np.zeros((B, (V + 31) // 32 * 32), bool)
    bits[:, :V] = allowed
    words = np.packbits(bits.reshape(B, -1, 32), axis=-1, bitorder="little").view(np.int32)[..., 0]
    order = [3, 0, 4, 2, 1]  # masks in any order, one slot unused (all bits clear: it would allow nothing)
    table = np.zeros((8, words.shape[1]), np.int32)
    table[: len(order)] = words[order]
    slot = np.full(B, -1, np.int32)
    slot[order] = np.arange(len(order))
    md = dataclasses.replace(
        metadata(B, [0.0, 1.0, 0.0, 2.0, 0.7, 0.0], [0.0] * B),
        token_bitmask=jnp.asarray(table),
        bitmask_slot=jnp.asarray(slot),
    )
    tokens, token_lp, ranks, top_ids, top_lp = sample(logits, md, SamplerFlags(grammar=True, num_logprobs=3))
    tokens = np.asarray(tokens)
    assert all(allowed[i, tokens[i]] for i in range(B))
    raw = np.asarray(logits)
    masked = np.where(allowed, raw, -np.inf)
    for i in (0, 2, 5):  # greedy rows: the best allowed token
        assert tokens[i] == np.argmax(masked[i])
    lse = np.asarray(jax.nn.logsumexp(jnp.asarray(masked), -1))
    np.testing.assert_allclose(token_lp, masked[np.arange(B), tokens] - lse, rtol=1e-5, atol=1e-5)  # lse by chunks
    np.testing.assert_array_equal(ranks, (masked > masked[np.arange(B), tokens][:, None]).sum(-1) + 1)
    np.testing.assert_array_equal(top_ids, np.argsort(-masked, -1, kind="stable")[:, :3])
    np.testing.assert_allclose(top_lp, np.sort(masked, -1)[:, ::-1][:, :3] - lse[:, None], rtol=1e-5, atol=1e-5)
    assert all(allowed[i, top_ids[i]].all() for i in range(B))  # every row allows >= 3 tokens
    plain = sample(logits, metadata(B, [0.0, 1.0, 0.0, 2.0, 0.7, 0.0], [0.0] * B), SamplerFlags(num_logprobs=3))
    assert tokens[5] == plain[0][5] and np.allclose(token_lp[5], plain[1][5]) and (top_ids[5] == plain[3][5]).all()


def test_categorical_draws_softmax_over_chunks():
    """20,000 draws (a key each) from one row of V = 2.5 chunks: mass on 12 tokens spread over all three chunks (one
    in the last, partial chunk; two adjacent at a chunk boundary), every other token -inf or 30 below: the empirical
    distribution is softmax(y) (total variation under 0.02; its expected value here is ~0.01) and no -inf token is
    ever drawn."""
    V, N = 2 * SAMPLE_CHUNK + SAMPLE_CHUNK // 2, 20_000
    rng = np.random.default_rng(7)
    hot = np.array(
        [3, 17, 400, SAMPLE_CHUNK - 1, SAMPLE_CHUNK, 1500, 1501, 2 * SAMPLE_CHUNK - 1, 2 * SAMPLE_CHUNK, V - 1]
    )
    hot = np.concatenate([hot, [900, 1800]])
    y = np.where(rng.random(V) < 0.5, -np.inf, -30.0)
    y[hot] = rng.normal(size=len(hot))
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(11), i))(jnp.arange(N))
    draws = np.asarray(jax.jit(categorical)(jnp.broadcast_to(jnp.asarray(y, jnp.float32), (N, V)), keys))
    assert np.isfinite(y[draws]).all()
    p = np.exp(y - y.max()) / np.exp(y - y.max()).sum()
    freq = np.bincount(draws, minlength=V) / N
    assert 0.5 * np.abs(freq - p).sum() < 0.02


def test_inverse_cdf_never_picks_a_zero_weight():
    """u at the top of [0, 1) where trailing weights are 0, leading zeros with u 0, one positive weight, and a row
    of zeros (the index 0, no NaN)."""
    w = jnp.asarray([[1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 3.0, 1.0], [0.0, 5.0, 0.0, 0.0], [0.0] * 4])
    u = jnp.asarray([np.nextafter(np.float32(1), np.float32(0)), 0.0, 0.5, 0.3], jnp.float32)
    np.testing.assert_array_equal(inverse_cdf(w, u), [1, 2, 1, 0])
    np.testing.assert_array_equal(inverse_cdf(w, jnp.zeros(4)), [0, 2, 1, 0])


@pytest.mark.parametrize("flags", [SamplerFlags(), SamplerFlags(filtering=True, num_logprobs=2)])
def test_sampler_program_under_tp2_gathers_the_logits_once(flags):
    """The sampler-only program (step_fns._sample_rows_fn) with the lm_head split over the vocabulary (tp 2): its
    compiled program moves the logits between the devices once, as one all-gather of [B, V / 2] float32 shards,
    and nothing else (no all-gather of the weight, no collective-permute: XLA partitioned the chunked draw's pad,
    reshape, cumsum and reverse over V as collectives around each op, and a tp 2 decode step took twice tp 1's
    time on two H200s); the tokens and logprobs are tp 1's."""
    from jaxllm.config import ModelConfig
    from jaxllm.engine.step_fns import _sample_rows_fn
    from jaxllm.sharding import ParallelConfig

    B, D, V = 8, 64, 2 * SAMPLE_CHUNK + 512
    cfg = ModelConfig("llama", vocab_size=V, hidden_size=D, intermediate_size=96, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, dtype="float32")  # fmt: skip
    k = jax.random.split(jax.random.key(3), 2)
    head = {"final_norm": jnp.ones((D,), jnp.float32), "lm_head": jax.random.normal(k[0], (V, D), jnp.float32)}
    rows = jax.random.normal(k[1], (B, D), jnp.float32)
    md = metadata(B, [0.0, 1.0, 0.7, 1.3, 0.0, 1.0, 2.0, 0.5], [0.0, 0.0, 0.1, 0.05, 0.3, 0.0, 0.0, 0.2])
    prev = jnp.zeros((B,), jnp.int32)
    fn = jax.jit(functools.partial(_sample_rows_fn, cfg=cfg, flags=flags), static_argnames=("mesh",))
    want = fn(head, rows, prev, md)

    mesh = ParallelConfig(2).make_mesh()
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp", None))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = (dict(head, lm_head=jax.device_put(head["lm_head"], split)), *jax.device_put((rows, prev, md), rep))
    compiled = fn.lower(*args, mesh=mesh).compile()
    collectives = re.findall(r"= (\S+) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)\(",
                             compiled.as_text())  # fmt: skip
    assert [(re.sub(r"\{.*\}", "", t), op) for t, op in collectives] == [(f"f32[{B},{V}]", "all-gather")]
    got = compiled(*args)
    np.testing.assert_array_equal(got[1][0], want[1][0])  # tokens
    np.testing.assert_allclose(got[1][1], want[1][1], rtol=1e-5, atol=1e-5)  # logprobs
    np.testing.assert_array_equal(got[1][3], want[1][3])  # top ids


@pytest.mark.parametrize("V,k", [(4096, 5), (64, 64)])
def test_prompt_logprobs_under_tp2_never_gather_the_vocabulary(V, k):
    """Prompt logprobs (step_fns._sample_fn through pipeline_head_fn) with the lm_head split over the vocabulary
    (tp 2): no collective moves the prompt rows' [T, V] logits (XLA gathered them whole for the top-k: 8 GB a device
    for a 16k-token chunk of a 128k vocabulary), only [T] rows and each shard's top-k; the sampled rows' one [B, V]
    all-gather stays. The target's logprob and rank and the top-k are tp 1's, ties across and within the shards in
    id order, and tp 1's are the float64 reference's. k = V: max_logprobs -1 (more than a shard's columns)."""
    from jaxllm.config import ModelConfig
    from jaxllm.engine.step_fns import pipeline_head_fn
    from jaxllm.models.decoder import compute_logits
    from jaxllm.sharding import ParallelConfig

    B, T, D = 4, 64, 64
    cfg = ModelConfig("llama", vocab_size=V, hidden_size=D, intermediate_size=96, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, dtype="float32")  # fmt: skip
    key = jax.random.split(jax.random.key(5), 3)
    u = jax.random.normal(key[0], (D,), jnp.float32)
    # equal rows in both shards and within one: tokens that tie at the top of the rows whose hidden states lean on u
    tied = np.array([V // 2 + 3, 1, 2, V - 1])
    lm_head = jax.random.normal(key[1], (V, D), jnp.float32).at[tied].set(3 * u) / 8  # logits of a few units
    head = {"final_norm": jnp.ones((D,), jnp.float32), "lm_head": lm_head}
    hidden = jax.random.normal(key[2], (T, D), jnp.float32) + (jnp.arange(T) % 2 * 3.0)[:, None] * u
    targets = np.random.default_rng(0).integers(0, V, T).astype(np.int32)
    targets[:8] = np.r_[tied, -1, 0, V // 2, V // 2 - 1]
    md, prev, idx = metadata(B, [0.0] * B, [0.0] * B), jnp.zeros((B,), jnp.int32), jnp.arange(B, dtype=jnp.int32) * 9
    fn = jax.jit(functools.partial(pipeline_head_fn, cfg=cfg, flags=SamplerFlags(), prompt_k=k), static_argnames="mesh")
    want = fn(head, hidden, prev, idx, md, jnp.asarray(targets))[2]

    x = np.asarray(compute_logits(head, hidden, cfg), np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    tgt = np.maximum(targets, 0)  # -1 (no target): token 0's
    t_x = np.take_along_axis(x, tgt[:, None], -1)
    top_ids = np.argsort(-x, axis=-1, kind="stable")[:, :k]  # ties: the lower id first
    assert (np.take_along_axis(x, top_ids[:, 1:2], -1) == x[:, tied[:1]]).all(-1)[1::2].all()  # the ties ran
    np.testing.assert_array_equal(want[1], (x > t_x).sum(-1) + 1)
    np.testing.assert_array_equal(want[2], top_ids)
    np.testing.assert_allclose(want[0], np.take_along_axis(lp, tgt[:, None], -1)[:, 0], rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(want[3], np.take_along_axis(lp, top_ids, -1), rtol=1e-6, atol=1e-5)

    mesh = ParallelConfig(2).make_mesh()
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp", None))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = (dict(head, lm_head=jax.device_put(lm_head, split)), *jax.device_put((hidden, prev, idx, md, targets), rep))
    compiled = fn.lower(*args, mesh=mesh).compile()
    moved = []  # (op, shape) of every collective's result, the parts of a tuple one by one
    for result, op in re.findall(r"= (\(.*?\)|\S+) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
                                 r"(?:-start)?\(", compiled.as_text()):  # fmt: skip
        moved += [(op, tuple(map(int, dims.split(",")))) for dims in re.findall(r"\[([\d,]+)\]", result)]
    assert moved and all(op in ("all-gather", "all-reduce") for op, _ in moved), moved
    assert ("all-gather", (B, V)) in moved, moved
    if 2 * k < V:  # nothing as large as a shard's [T, V / 2] moves (with k = V the top-k is every column)
        assert not [m for m in moved if np.prod(m[1]) >= T * V // 2], moved
    got = compiled(*args)[2]
    np.testing.assert_array_equal(got[1], want[1])  # ranks
    np.testing.assert_array_equal(got[2], want[2])  # top ids
    # the logsumexp's sum is two shards' sums added, and XLA tiles the logits' matmul by the shard's width: their
    # rounding may differ in the last place
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[3], want[3], rtol=1e-6, atol=1e-6)


def test_step_outputs_packed_into_one_array_round_trip_bit_for_bit():
    """step_fns.with_packed appends the step's sampled outputs packed into one int32 array (float32 as their bits),
    the host's one device-to-host copy a step; step_io.unpack_outputs splits it back into arrays equal bit for bit
    to the device ones (-inf / nan / -0.0 logprobs included), plain steps' [B] / [B, k] and speculative steps'
    [B, K + 1] / [B, K + 1, k] shapes alike; other dtypes are refused at trace time."""
    from jaxllm.engine.step_fns import with_packed
    from jaxllm.engine.step_io import unpack_outputs

    rng = np.random.default_rng(0)
    B, K, k = 4, 3, 5
    lp = rng.standard_normal((B, K + 1)).astype(np.float32)
    lp[0, 0], lp[1, 1], lp[2, 2] = -np.inf, np.nan, -0.0
    spec = (
        rng.integers(0, 50_000, (B, K + 1)).astype(np.int32),
        lp,
        rng.integers(1, 9, (B, K + 1)).astype(np.int32),
        rng.integers(0, 50_000, (B, K + 1, k)).astype(np.int32),
        rng.standard_normal((B, K + 1, k)).astype(np.float32),
        rng.integers(1, K + 2, (B,)).astype(np.int32),
    )
    plain = (spec[0][:, 0], lp[:, 0], spec[2][:, 0], spec[3][:, 0, :1], spec[4][:, 0, :1])
    for outputs in (plain, spec):
        device = jax.jit(with_packed)(tuple(map(jnp.asarray, outputs)))
        assert len(device) == len(outputs) + 1 and device[-1].dtype == jnp.int32 and device[-1].shape[0] == B
        got = unpack_outputs(np.asarray(device[-1]), device[:-1])
        for g, want in zip(got, outputs, strict=True):
            assert g.dtype == want.dtype and g.shape == want.shape
            np.testing.assert_array_equal(np.ascontiguousarray(g).view(np.uint32), want.view(np.uint32))  # the bits
    with pytest.raises(TypeError, match="cannot be packed"):
        jax.jit(with_packed)((jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.bfloat16)))


def test_process_logits_follows_vllm_v1_order():
    """vLLM V1's order: allowed ids and logit biases before penalties (a repeated token's biased logit is divided
    by the repetition penalty), and min_p before top-k / top-p (top-p's mass counted on what min_p leaves)."""
    import dataclasses

    from jaxllm.engine.sampler import process_logits

    logits = jnp.asarray([[3.0, 2.6, 2.5, 1.0, 0.9, 0.8, -1.0, -2.0]])
    md = dataclasses.replace(
        metadata(1, [1.0], [0.2]),
        top_p=jnp.asarray([0.8]),
        penalty_tokens=jnp.asarray([[1, 6]], jnp.int32),
        penalty_is_output=jnp.asarray([[False, True]]),
        repetition=jnp.asarray([2.0]),
        bias_ids=jnp.asarray([[1, 6]], jnp.int32),
        bias_values=jnp.asarray([[0.6, 1.0]]),
    )
    x, y, _ = process_logits(logits, md, SamplerFlags(penalties=True, bias=True, filtering=True))
    want_x = np.asarray(logits[0]).copy()
    want_x[1] = (2.6 + 0.6) / 2.0  # biased, then penalized (not 2.6 / 2 + 0.6)
    want_x[6] = 0.0  # (-1 + 1) * 2: a non-positive logit is multiplied
    np.testing.assert_allclose(np.asarray(x[0]), want_x, rtol=1e-6)
    # min_p 0.2 keeps p >= 0.2 p_max; of those, top_p 0.8 of their renormalized mass
    p = np.exp(want_x - want_x.max())
    kept = p >= 0.2 * p.max()
    q = np.where(kept, p, 0) / np.where(kept, p, 0).sum()
    order = np.argsort(-q)
    before = np.cumsum(q[order]) - q[order]
    allowed = set(order[(before < 0.8) & q[order].astype(bool)].tolist()) | {int(order[0])}
    assert set(np.flatnonzero(np.isfinite(np.asarray(y[0]))).tolist()) == allowed == {0, 2}  # top_p first: + 1
