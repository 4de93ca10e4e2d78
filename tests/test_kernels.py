"""kernels_pallas against the pure-jnp reference, in Pallas interpret mode on CPU.

Every case: shuffled block tables, unused pages (and the table's tail entries) pointing at NaN pages,
lengths 1, page boundaries, boundary + 1 and multi-page contexts. Interpret mode is slow on CPU, so the
shapes are small and the ragged cases use small tiles (the tile sizes are static arguments only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas import reference
from kernels_pallas._decode import paged_decode_attention_kernel
from kernels_pallas._ragged import ragged_paged_attention_kernel, tile_plan
from kernels_pallas._splitk import choose_splits, combine_splits
from kernels_pallas._write import write_kv_kernel

TOL = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 4e-3, jnp.dtype(jnp.float32): 1e-4}


def make_cache(rng, K, H, S, lens, *, M=None, dtype=jnp.bfloat16, kv_dtype=None, spare=5):
    """Pages of every sequence shuffled over the cache; every page no sequence uses holds NaN."""
    B = len(lens)
    need = [max(1, -(-n // S)) for n in lens]
    M = M or max(need) + 1
    P = sum(need) + spare
    perm = rng.permutation(P)
    bt = np.empty((B, M), np.int32)
    used, at = set(), 0
    for b in range(B):
        n = -(-lens[b] // S)
        bt[b, :n] = perm[at : at + n]
        used.update(bt[b, :n].tolist())
        at += n
        bt[b, n:] = rng.integers(0, P, M - n)  # garbage tail: the kernel must never use it
    k = rng.standard_normal((K, P, S, H)).astype(np.float32)
    v = rng.standard_normal((K, P, S, H)).astype(np.float32)
    unused = np.array([p not in used for p in range(P)])
    k[:, unused] = np.nan
    v[:, unused] = np.nan
    # NaN also in the unused slots of each sequence's last page
    for b in range(B):
        if lens[b] % S:
            last = bt[b, lens[b] // S]
            k[:, last, lens[b] % S :] = np.nan
            v[:, last, lens[b] % S :] = np.nan
    kv_dtype = kv_dtype or dtype
    return jnp.asarray(k).astype(kv_dtype), jnp.asarray(v).astype(kv_dtype), jnp.asarray(bt)


def check(out, ref, dtype):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "NaN/inf leaked from unused pages"
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < TOL[jnp.dtype(dtype)], err


DECODE_CASES = [
    # N, K, H, S, dtype, lens, extra
    (8, 2, 64, 16, jnp.bfloat16, [1, 16, 17, 100], {}),
    (4, 4, 128, 32, jnp.float16, [32, 33, 5], {}),
    (8, 1, 64, 64, jnp.bfloat16, [64, 65, 1], {}),
    (6, 2, 64, 16, jnp.float32, [300, 47], dict(num_splits=3, block_k=32)),
    (4, 2, 64, 16, jnp.bfloat16, [200, 9, 31], dict(sliding_window=20, alibi_slopes=True, num_splits=2, block_k=32)),
    (16, 1, 64, 16, jnp.bfloat16, [70, 5], dict(num_splits=2, block_k=32)),  # G = 16: no stacked copies
    (4, 2, 128, 16, jnp.bfloat16, [90, 3], dict(alibi_slopes=True, num_splits=2, block_k=32)),  # 8 copies of G=2
    # prefetch modes (2, the default, loads block-table entries two blocks ahead; 1 only the next block's
    # KV; 0 none): first/last block, one-block and empty splits, masked tail, window
    (8, 2, 64, 16, jnp.bfloat16, [1, 16, 17, 100], dict(prefetch=1, block_k=32)),
    (4, 2, 64, 16, jnp.float32, [300, 47, 0], dict(prefetch=1, num_splits=3, block_k=32)),
    (4, 2, 64, 16, jnp.bfloat16, [200, 9], dict(prefetch=1, sliding_window=20, num_splits=2, block_k=32)),
    (4, 2, 64, 16, jnp.bfloat16, [200, 9, 33], dict(prefetch=0, sliding_window=20, num_splits=2, block_k=32)),
    (4, 2, 64, 16, jnp.bfloat16, [300, 17, 48, 0], dict(num_splits=5, block_k=16)),  # 1-2 blocks per split
    (4, 2, 64, 16, jnp.bfloat16, [300, 17, 48, 0], dict(num_splits=5, block_k=16, prefetch=3)),
    (4, 2, 64, 16, jnp.bfloat16, [200, 9, 33], dict(prefetch=3, sliding_window=20, num_splits=2, block_k=32)),
    (4, 2, 64, 16, jnp.bfloat16, [70, 200, 1], dict(min_split_tokens=32, block_k=16)),  # short splits
    (4, 2, 64, 16, jnp.bfloat16, [40, 0, 70, 0, 5], dict(num_splits=2, block_k=32)),  # padding between live ones
    # tables exactly as wide as the longest sequence: 7 pages (padded to whole 2-page blocks), 6 pages (no pad)
    (8, 2, 64, 16, jnp.bfloat16, [100, 7, 0], dict(table_pages=7, num_splits=2, block_k=32)),
    (8, 2, 64, 16, jnp.bfloat16, [96, 3, 40], dict(table_pages=6, num_splits=3, block_k=32)),
    # Gemma 2's soft-capped scores (a cap of 1.5 on scores of ~N(0, 2): most are capped), with and without a window
    (4, 2, 64, 16, jnp.bfloat16, [200, 9, 31], dict(soft_cap=1.5, num_splits=2, block_k=32)),
    (8, 4, 256, 16, jnp.float32, [70, 17], dict(soft_cap=1.5, sliding_window=20, num_splits=2, block_k=32)),
]


@pytest.mark.parametrize("N,K,H,S,dtype,lens,extra", DECODE_CASES)
def test_decode_matches_reference(N, K, H, S, dtype, lens, extra):
    rng = np.random.default_rng(len(lens) * 100 + N + S)
    extra = dict(extra)
    k, v, bt = make_cache(rng, K, H, S, lens, M=extra.pop("table_pages", None), dtype=dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), N, H)), dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    kw = dict(scale=H**-0.5)
    if extra.pop("alibi_slopes", False):
        kw["alibi_slopes"] = jnp.asarray(2.0 ** -np.arange(1, N + 1) * 4, jnp.float32)
    for name in ("sliding_window", "soft_cap"):
        if name in extra:
            kw[name] = extra.pop(name)
    out = paged_decode_attention_kernel(q, k, v, seq_lens, bt, interpret=True, **kw, **extra)
    ref = reference.paged_decode_attention_ref(q, k, v, seq_lens, bt, **kw)
    check(out, ref, dtype)
    if "soft_cap" in kw:  # the cap matters at these scores: without it the kernel would fail the check
        with pytest.raises(AssertionError):
            check(out, reference.paged_decode_attention_ref(q, k, v, seq_lens, bt, **(kw | {"soft_cap": None})), dtype)


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_decode_fp8(kv_dtype):
    rng = np.random.default_rng(7)
    lens = [40, 1, 16]
    k, v, bt = make_cache(rng, 2, 64, 16, lens, kv_dtype=kv_dtype)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.bfloat16)
    kw = dict(scale=0.125, k_scale=0.5, v_scale=2.0)
    out = kp.paged_decode_attention(q, k, v, jnp.asarray(lens, jnp.int32), bt, interpret=True, **kw)
    ref = reference.paged_decode_attention_ref(q, k, v, jnp.asarray(lens, jnp.int32), bt, **kw)
    check(out, ref, jnp.bfloat16)


@pytest.mark.parametrize("lens", [[33, 1, 0], [33, 1, 0, 0]])  # T > B: gathers; T == B: the engine's layout
def test_ragged_decode_only_dispatch(lens):
    """decode_only: live sequences have one token; a padding sequence and padding tokens give zeros."""
    rng = np.random.default_rng(3)
    k, v, bt = make_cache(rng, 2, 64, 16, lens)
    T = 4
    q = jnp.asarray(rng.standard_normal((T, 8, 64)), jnp.bfloat16)
    qsl = jnp.asarray([0, 1] + [2] * (len(lens) - 1), jnp.int32)
    args = (q, k, v, jnp.asarray(lens, jnp.int32), qsl, bt)
    out = kp.ragged_paged_attention(*args, scale=0.125, decode_only=True, interpret=True)
    ref = reference.ragged_paged_attention_ref(*args, scale=0.125)
    check(out, ref, jnp.bfloat16)
    assert not np.asarray(out[2:], np.float32).any()


RAGGED_CASES = [
    # N, K, H, S, dtype, q_lens, seq_lens, extra
    (8, 2, 64, 16, jnp.bfloat16, [5, 1, 40, 0], [5, 30, 170, 0], dict(block_m=32, block_k=32)),
    (4, 4, 64, 32, jnp.float16, [33, 16, 1], [33, 48, 64], dict(block_m=16, block_k=32)),
    (16, 2, 64, 16, jnp.bfloat16, [20, 3], [52, 3], dict(block_m=32, block_k=16, sliding_window=7, alibi_slopes=True)),
    (3, 1, 128, 16, jnp.float32, [17, 2], [17, 65], dict(block_m=16, block_k=64)),
    (8, 2, 64, 16, jnp.bfloat16, [5, 1, 40, 0], [5, 30, 170, 0], dict(block_m=32, block_k=32, prefetch=1)),
    (16, 2, 64, 16, jnp.bfloat16, [20, 3], [52, 3], dict(block_m=32, block_k=16, sliding_window=7, prefetch=1)),
    (8, 2, 64, 16, jnp.bfloat16, [5, 1, 40, 0], [5, 30, 170, 0], dict(block_m=32, block_k=16, prefetch=0)),
    (8, 2, 64, 16, jnp.bfloat16, [5, 1, 40, 0], [5, 30, 170, 0], dict(block_m=32, block_k=16, prefetch=2)),
    (16, 2, 64, 16, jnp.bfloat16, [20, 3], [52, 3], dict(block_m=32, block_k=16, sliding_window=7, prefetch=3)),
    (8, 2, 64, 16, jnp.bfloat16, [5, 1, 40, 0], [5, 30, 170, 0], dict(block_m=32, block_k=32, soft_cap=1.5)),
    (16, 2, 64, 16, jnp.float32, [20, 3], [52, 3], dict(block_m=32, block_k=16, sliding_window=7, soft_cap=1.5)),
]


def _ragged_args(rng, N, K, H, S, dtype, q_lens, seq_lens, kv_dtype=None, pad_tokens=3):
    k, v, bt = make_cache(rng, K, H, S, seq_lens, dtype=dtype, kv_dtype=kv_dtype)
    T = sum(q_lens) + pad_tokens
    q = jnp.asarray(rng.standard_normal((T, N, H)), dtype)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, k, v, jnp.asarray(seq_lens, jnp.int32), qsl, bt


@pytest.mark.parametrize("N,K,H,S,dtype,q_lens,seq_lens,extra", RAGGED_CASES)
def test_ragged_matches_reference(N, K, H, S, dtype, q_lens, seq_lens, extra):
    rng = np.random.default_rng(sum(q_lens) + N)
    args = _ragged_args(rng, N, K, H, S, dtype, q_lens, seq_lens)
    kw = dict(scale=H**-0.5)
    extra = dict(extra)
    if extra.pop("alibi_slopes", False):
        kw["alibi_slopes"] = jnp.asarray(2.0 ** -np.arange(1, N + 1) * 4, jnp.float32)
    for name in ("sliding_window", "soft_cap"):
        if name in extra:
            kw[name] = extra.pop(name)
    out = ragged_paged_attention_kernel(*args, interpret=True, **kw, **extra)
    ref = reference.ragged_paged_attention_ref(*args, **kw)
    check(out, ref, dtype)
    if "soft_cap" in kw:  # the cap matters at these scores: without it the kernel would fail the check
        with pytest.raises(AssertionError):
            check(out, reference.ragged_paged_attention_ref(*args, **(kw | {"soft_cap": None})), dtype)
    assert not np.asarray(out[sum(q_lens) :], np.float32).any(), "padding tokens must be zero"


@pytest.mark.parametrize("split_decode", [True, False])
def test_ragged_entry_point_mixed_batch(split_decode):
    """A mixed batch through the entry point: one-token sequences (decode steps; with split_decode they go
    to the decode kernel), chunks over cached prefixes, a padding sequence and padding tokens."""
    rng = np.random.default_rng(21)
    q_lens, seq_lens = [1, 40, 1, 5, 1, 0], [70, 40, 17, 90, 1, 0]
    q, k, v, lens, qsl, bt = _ragged_args(rng, 8, 2, 64, 16, jnp.bfloat16, q_lens, seq_lens)
    kw = dict(scale=0.125, sliding_window=33)
    out = kp.ragged_paged_attention(q, k, v, lens, qsl, bt, split_decode=split_decode, interpret=True, **kw)
    ref = reference.ragged_paged_attention_ref(q, k, v, lens, qsl, bt, **kw)
    check(out, ref, jnp.bfloat16)
    assert not np.asarray(out[int(qsl[-1]) :], np.float32).any()  # padding tokens: zeros


def test_ragged_entry_point_fp8_default_tiles():
    rng = np.random.default_rng(11)
    args = _ragged_args(rng, 8, 2, 64, 16, jnp.bfloat16, [9, 1], [40, 17], kv_dtype=jnp.float8_e4m3fn)
    kw = dict(scale=0.125, k_scale=0.25, v_scale=1.5)
    out = kp.ragged_paged_attention(*args, interpret=True, **kw)
    ref = reference.ragged_paged_attention_ref(*args, **kw)
    check(out, ref, jnp.bfloat16)


def test_cpu_path_is_the_reference():
    rng = np.random.default_rng(5)
    args = _ragged_args(rng, 4, 2, 64, 16, jnp.bfloat16, [3, 1], [20, 5])
    if jax.default_backend() == "gpu":
        pytest.skip("GPU backend: entry point runs the kernel")
    out = kp.ragged_paged_attention(*args, scale=0.125)
    ref = reference.ragged_paged_attention_ref(*args, scale=0.125)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_tile_plan_covers_every_token_once():
    """Live tiles cover every token of the batch once; the rest cover the padding tokens after it."""
    qsl = jnp.asarray([0, 5, 5, 6, 40], jnp.int32)
    lens = jnp.asarray([10, 0, 1, 100], jnp.int32)
    tseq, tpos, ttok, trows = tile_plan(qsl, lens, 45, 8)
    covered, padding = [], set()
    for s, p, t, r in zip(*(np.asarray(x) for x in (tseq, tpos, ttok, trows)), strict=True):
        covered += list(range(t, t + r))
        if r:
            assert p == np.asarray(lens)[s] - (np.asarray(qsl)[s + 1] - np.asarray(qsl)[s]) + (t - np.asarray(qsl)[s])
        else:
            assert t >= 40
            padding |= set(range(t, t + 8))
    assert sorted(covered) == list(range(40))
    assert padding >= set(range(40, 45))


def test_split_plan():
    # many programs already: no split; one long sequence: split so ~2 programs per SM exist
    assert choose_splits(64, 8, 128, 8, 16) in ((1, 128), (2, 64))
    n, pps = choose_splits(1, 8, 2048, 8, 16)
    assert n * pps >= 2048 and n >= 32 and pps % 8 == 0


@pytest.mark.parametrize("block_h", [32, 64, 128])  # column programs per q head: 2, 1, and block_h > H (1)
def test_combine_splits_ignores_unwritten_slots(block_h):
    """The split-K combine: 3 live splits in 4 slots (the 4th never written: NaN here), a split that saw
    no key (l = 0, m = -inf) and a (sequence, head) whose splits all saw none (zeros out)."""
    rng = np.random.default_rng(5)
    B, K, SP, G, H, live = 2, 2, 4, 4, 64, 3
    o = rng.standard_normal((B, K, SP, G, H)).astype(np.float32)
    m = rng.standard_normal((B, K, SP, G)).astype(np.float32) * 4
    l = rng.uniform(0.5, 3, (B, K, SP, G)).astype(np.float32)
    o[:, :, live:], m[:, :, live:], l[:, :, live:] = np.nan, np.nan, np.nan
    m[0, 1, 1], l[0, 1, 1] = -np.inf, 0.0
    m[1, 0, :live], l[1, 0, :live] = -np.inf, 0.0
    out = np.asarray(
        combine_splits(
            jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), live, jnp.float32, interpret=True, block_h=block_h
        )
    )
    with np.errstate(invalid="ignore"):  # a row whose splits are all empty: -inf - -inf, masked out by l > 0
        w = np.where(l[:, :, :live] > 0, np.exp2(m[:, :, :live] - m[:, :, :live].max(2, keepdims=True)), 0.0)
    w = np.nan_to_num(w) * l[:, :, :live]
    den = w.sum(2)
    want = (w[..., None] * o[:, :, :live]).sum(2) / np.where(den > 0, den, 1.0)[..., None]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert not out[1, 0].any()


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_write_kv_kernel_matches_scatter(kv_dtype):
    """Every written slot equals the reference scatter bit for bit; padding (-1) and all other slots keep
    what they held (NaN here, so a stray write or a lost row shows)."""
    rng = np.random.default_rng(11)
    K, P, S, H, T = 3, 9, 16, 64, 12  # K not a power of two (MHA models after tp may have any K)
    pages = np.full((K, P, S, H), np.nan, np.float32)
    kp_, vp_ = jnp.asarray(pages).astype(kv_dtype), jnp.asarray(pages).astype(kv_dtype)
    k = jnp.asarray(rng.standard_normal((T, K, H)) * 3, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((T, K, H)) * 3, jnp.bfloat16)
    slots = rng.permutation(P * S)[:T].astype(np.int32)
    slots[[2, 7]] = -1
    kw = dict(k_scale=0.37, v_scale=2.9)
    rk, rv = reference.write_kv(kp_, vp_, k, v, jnp.asarray(slots), **kw)
    ok, ov = write_kv_kernel(kp_, vp_, k, v, jnp.asarray(slots), interpret=True, **kw)
    for got, want in ((ok, rk), (ov, rv)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    assert np.isfinite(np.asarray(ok.astype(jnp.float32))).sum() == (T - 2) * K * H


@pytest.mark.parametrize(
    "G,K,H,kv_dtype,rope",
    [
        (4, 2, 64, jnp.bfloat16, True),
        (3, 3, 128, jnp.bfloat16, True),  # G and K not powers of two (Qwen2.5-7B has G = 7)
        (1, 2, 64, jnp.float8_e4m3fn, True),
        (2, 2, 64, jnp.float32, False),  # ALiBi models: split and write only
    ],
)
def test_qkv_write_kv_kernel_matches_reference(G, K, H, kv_dtype, rope):
    """q (RoPE'd) and every written slot equal the reference (split, apply_rope, scatter) bit for bit;
    padding slots (-1) write nothing (the NaN pages show a stray write)."""
    rng = np.random.default_rng(13)
    P, S, T = 7, 16, 10
    dt = jnp.float32 if kv_dtype == jnp.float32 else jnp.bfloat16
    pages = jnp.asarray(np.full((K, P, S, H), np.nan, np.float32)).astype(kv_dtype)
    qkv = jnp.asarray(rng.standard_normal((T, K, G + 2, H)) * 3, dt)
    pos = jnp.asarray(rng.integers(0, 5000, T), jnp.int32)
    inv_freq = jnp.asarray(500000.0 ** -(np.arange(0, H, 2) / H), jnp.float32) if rope else None
    slots = rng.permutation(P * S)[:T].astype(np.int32)
    slots[[1, 6]] = -1
    kw = dict(k_scale=0.37, v_scale=2.9)
    want = reference.qkv_write_kv(qkv, pos, inv_freq, pages, pages, jnp.asarray(slots), **kw)
    got = kp.qkv_write_kv(qkv, pos, inv_freq, pages, pages, jnp.asarray(slots), interpret=True, **kw)
    assert got[0].shape == (T, K * G, H)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        g, w = np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
        if kv_dtype == jnp.float8_e4m3fn and g.shape == pages.shape:
            # XLA:CPU (interpret mode) may drop the bf16 rounding of the rotated k before the fp8 cast (it
            # removes f32 -> bf16 -> f32 pairs), so a value on an fp8 rounding boundary can go one step
            # either way; one e4m3 step is 2^-3 relative.
            np.testing.assert_allclose(g, w, rtol=0.126)
        else:
            np.testing.assert_array_equal(g, w)
    assert np.isfinite(np.asarray(got[1].astype(jnp.float32))).sum() == (T - 2) * K * H
    if rope:  # the rotation happened (not a copy)
        assert not np.array_equal(
            np.asarray(got[0], np.float32), np.asarray(qkv[:, :, :G].reshape(T, K * G, H), np.float32)
        )


def test_qkv_write_kv_kernel_sums_split_k_partials():
    """qkv given as split-K partials [S, T, ...] (float32): the kernel sums them and rounds to the model dtype,
    bit for bit what the reference does (sum, round, then the plain path)."""
    rng = np.random.default_rng(14)
    K, G, H, P, S, T = 2, 4, 64, 7, 16, 6
    pages = jnp.asarray(np.full((K, P, S, H), np.nan, np.float32)).astype(jnp.bfloat16)
    parts = jnp.asarray(rng.standard_normal((4, T, K, G + 2, H)) * 3, jnp.float32)
    pos = jnp.asarray(rng.integers(0, 5000, T), jnp.int32)
    inv_freq = jnp.asarray(500000.0 ** -(np.arange(0, H, 2) / H), jnp.float32)
    slots = jnp.asarray([3, 17, -1, 40, 41, 99], jnp.int32)
    kw = dict(k_scale=1.0, v_scale=1.0, dtype=jnp.bfloat16)
    want = reference.qkv_write_kv(parts, pos, inv_freq, pages, pages, slots, **kw)
    got = kp.qkv_write_kv(parts, pos, inv_freq, pages, pages, slots, interpret=True, **kw)
    assert got[0].dtype == jnp.bfloat16 and got[0].shape == (T, K * G, H)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    plain = reference.qkv_write_kv(parts.sum(0).astype(jnp.bfloat16), pos, inv_freq, pages, pages, slots)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(plain[0], np.float32))


FUSED_DECODE_CASES = [
    # G, K, H, S, kv_dtype, lens, parts (split-K partials; 0: plain qkv in the model dtype), rope, extra
    (4, 2, 64, 16, jnp.bfloat16, [1, 16, 17, 100, 0], 4, True, {}),  # 1: only the new token; 17: q_pos opens a page
    (4, 2, 64, 16, jnp.bfloat16, [300, 33, 48, 0], 4, True, dict(num_splits=5, block_k=16)),  # 1-2 blocks a split
    (4, 2, 64, 16, jnp.bfloat16, [70, 200, 2], 0, True, dict(num_splits=1, block_k=32)),  # one split: final output
    (7, 1, 128, 16, jnp.bfloat16, [31, 32, 90], 2, True, dict(num_splits=2, block_k=32)),  # G = 7: padded q rows
    (2, 2, 64, 16, jnp.float8_e4m3fn, [40, 1, 16], 0, True, dict(prefetch=1)),  # quantized on the way in
    # two rows planned as one sequence (the engine's smallest bucket): one live, then both live
    (4, 2, 64, 16, jnp.bfloat16, [300, 0], 0, True, dict(plan_seqs=1, block_k=16)),
    (4, 2, 64, 16, jnp.bfloat16, [300, 170], 0, True, dict(plan_seqs=1, block_k=16)),
    (
        4,
        2,
        64,
        16,
        jnp.bfloat16,
        [200, 9, 33],
        0,
        False,
        dict(sliding_window=20, alibi_slopes=True, num_splits=2, block_k=32, prefetch=3),
    ),
    (
        4,
        2,
        64,
        16,
        jnp.bfloat16,
        [200, 9, 1],
        0,
        True,
        dict(soft_cap=1.5, sliding_window=20, num_splits=2, block_k=32),
    ),  # the new token's score is capped too
]


@pytest.mark.parametrize("G,K,H,S,kv_dtype,lens,parts,rope,extra", FUSED_DECODE_CASES)
def test_fused_decode_matches_qkv_write_then_decode(G, K, H, S, kv_dtype, lens, parts, rope, extra):
    """fused_decode_attention (RoPE, KV write, attention over the cache plus the new token, one launch) gives
    what the reference's qkv_write_kv followed by its decode attention gives, and writes the same slots bit
    for bit. The new token's slot holds NaN before the call: the kernel must take that token's k / v from
    registers, never from the cache it is writing. Padding sequences (seq_len 0, slot -1) give zeros and
    write nothing."""
    rng = np.random.default_rng(sum(lens) + G)
    B = len(lens)
    k, v, bt = make_cache(rng, K, H, S, lens, kv_dtype=kv_dtype)
    slots = np.array([int(bt[b, (n - 1) // S]) * S + (n - 1) % S if n else -1 for b, n in enumerate(lens)], np.int32)
    k, v = (np.array(x.astype(jnp.float32)) for x in (k, v))
    for slot in slots[slots >= 0]:
        k[:, slot // S, slot % S] = v[:, slot // S, slot % S] = np.nan
    k, v = jnp.asarray(k).astype(kv_dtype), jnp.asarray(v).astype(kv_dtype)
    shape = (parts, B, K, G + 2, H) if parts else (B, K, G + 2, H)
    qkv = jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32 if parts else jnp.bfloat16)
    pos = jnp.asarray([max(n - 1, 0) for n in lens], jnp.int32)
    inv_freq = jnp.asarray(500000.0 ** -(np.arange(0, H, 2) / H), jnp.float32) if rope else None
    kw = dict(scale=H**-0.5, k_scale=0.5, v_scale=2.0) if kv_dtype == jnp.float8_e4m3fn else dict(scale=H**-0.5)
    extra = dict(extra)
    if extra.pop("alibi_slopes", False):
        kw["alibi_slopes"] = jnp.asarray(2.0 ** -np.arange(1, G * K + 1) * 4, jnp.float32)
    for name in ("sliding_window", "soft_cap"):
        if name in extra:
            kw[name] = extra.pop(name)
    lens_a, slots_a = jnp.asarray(lens, jnp.int32), jnp.asarray(slots)
    scales = {k_: kw[k_] for k_ in ("k_scale", "v_scale") if k_ in kw}
    q, k_ref, v_ref = reference.qkv_write_kv(qkv, pos, inv_freq, k, v, slots_a, dtype=jnp.bfloat16, **scales)
    want = reference.paged_decode_attention_ref(q, k_ref, v_ref, lens_a, bt, **kw)
    out, k_out, v_out = kp.fused_decode_attention(
        qkv, pos, inv_freq, k, v, slots_a, lens_a, bt, dtype=jnp.bfloat16, interpret=True, **kw, **extra
    )
    live = np.asarray(lens) > 0
    check(out[live], want[live], jnp.bfloat16)
    assert not np.asarray(out[~live], np.float32).any()
    for got, ref in ((k_out, k_ref), (v_out, v_ref)):
        got, ref = np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
        if kv_dtype == jnp.float8_e4m3fn:  # one e4m3 step either way (see the qkv_write_kv test)
            np.testing.assert_allclose(got, ref, rtol=0.126)
        else:
            np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("lens,parts,plan", [([200, 0], 0, 1), ([40, 9, 33], 2, None)])
def test_fused_decode_mosaic_backend(lens, parts, plan):
    """decode_backend="mosaic" (JAXLLM_DECODE_BACKEND=mosaic; "auto" keeps the fused Triton launch): the decode
    step's attention as the qkv/RoPE/write launch then the Mosaic GPU decode kernel, same results as the
    reference's; plan_seqs plans the splits for the live sequences (the engine's batch-1 step: one live row and a
    padding row, which gives zeros)."""
    G, K, H, S = 4, 2, 64, 16
    rng = np.random.default_rng(sum(lens))
    B = len(lens)
    k, v, bt = make_cache(rng, K, H, S, lens, M=16)
    slots = jnp.asarray(
        [int(bt[b, (n - 1) // S]) * S + (n - 1) % S if n else -1 for b, n in enumerate(lens)], jnp.int32
    )
    shape = (parts, B, K, G + 2, H) if parts else (B, K, G + 2, H)
    qkv = jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32 if parts else jnp.bfloat16)
    pos = jnp.asarray([max(n - 1, 0) for n in lens], jnp.int32)
    inv_freq = jnp.asarray(500000.0 ** -(np.arange(0, H, 2) / H), jnp.float32)
    lens_a = jnp.asarray(lens, jnp.int32)
    q, k_ref, v_ref = reference.qkv_write_kv(qkv, pos, inv_freq, k, v, slots, dtype=jnp.bfloat16)
    want = reference.paged_decode_attention_ref(q, k_ref, v_ref, lens_a, bt, scale=H**-0.5)
    tuning = {} if plan is None else dict(plan_seqs=plan)
    out, k_out, v_out = kp.fused_decode_attention(
        qkv,
        pos,
        inv_freq,
        k,
        v,
        slots,
        lens_a,
        bt,
        scale=H**-0.5,
        dtype=jnp.bfloat16,
        decode_backend="mosaic",
        interpret=True,
        **tuning,
    )
    live = np.asarray(lens) > 0
    check(out[live], want[live], jnp.bfloat16)
    assert not np.asarray(out[~live], np.float32).any()
    for got, ref in ((k_out, k_ref), (v_out, v_ref)):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))


def test_fused_decode_backend_routing(monkeypatch):
    """The decode-only steps' backend: the fused Triton launch by default ("auto") and for "triton";
    the write then the Mosaic GPU kernel for "mosaic", given as an argument or as $JAXLLM_DECODE_BACKEND (which
    before a2a5b98 reached only the mixed steps' decode tokens); plan_seqs goes with it."""
    seen = []
    monkeypatch.setattr(kp, "fused_decode_attention_kernel", lambda qkv, *a, **k: seen.append("triton") or (qkv, 0, 0))
    monkeypatch.setattr(kp._decode_mgpu, "paged_decode_mgpu", lambda q, *a, **k: seen.append(k["plan_seqs"]) or q)
    rng = np.random.default_rng(0)
    k, v, bt = make_cache(rng, 2, 64, 16, [5, 0])
    args = (jnp.zeros((2, 2, 6, 64), jnp.bfloat16), jnp.asarray([4, 0]), None, k, v, jnp.asarray([3, -1]))
    call = lambda **kw: kp.fused_decode_attention(*args, jnp.asarray([5, 0]), bt, scale=0.1, interpret=True, **kw)  # noqa: E731
    monkeypatch.delenv("JAXLLM_DECODE_BACKEND", raising=False)
    call(), call(decode_backend="auto"), call(decode_backend="triton"), call(decode_backend="mosaic", plan_seqs=1)
    monkeypatch.setenv("JAXLLM_DECODE_BACKEND", "mosaic")
    call()
    assert seen == ["triton", "triton", "triton", 1, None]
    with pytest.raises(ValueError, match="decode_backend='flash'"):
        call(decode_backend="flash")


def test_fused_decode_long_context_takes_the_mosaic_kernel_on_hopper(monkeypatch):
    """long_context (the engine's long decode steps, AttentionMetadata.long_context) makes "auto" take the write
    then the Mosaic GPU kernel where _decode_backend picks it (Hopper, inputs it supports), and nothing else:
    the fused launch without it, off Hopper, for inputs Mosaic does not take (ALiBi) and for "triton"."""
    seen = []
    monkeypatch.setattr(kp, "fused_decode_attention_kernel", lambda qkv, *a, **k: seen.append("fused") or (qkv, 0, 0))
    monkeypatch.setattr(kp, "qkv_write_kv", lambda qkv, pos, f, k, v, *a, **kw: (qkv[:, :, :2].reshape(2, 4, 64), k, v))
    monkeypatch.setattr(kp._decode_mgpu, "paged_decode_mgpu", lambda q, *a, **k: seen.append("mosaic") or q)
    monkeypatch.setattr(kp, "paged_decode_attention_kernel", lambda q, *a, **k: seen.append("triton") or q)
    monkeypatch.setattr(kp, "_use_kernel", lambda *a: True)
    monkeypatch.setattr(kp, "_use_write_kernel", lambda *a: True)
    monkeypatch.delenv("JAXLLM_DECODE_BACKEND", raising=False)
    rng = np.random.default_rng(0)
    k, v, bt = make_cache(rng, 2, 64, 16, [5, 0])
    args = (jnp.zeros((2, 2, 6, 64), jnp.bfloat16), jnp.asarray([4, 0]), None, k, v, jnp.asarray([3, -1]))
    call = lambda **kw: kp.fused_decode_attention(*args, jnp.asarray([5, 0]), bt, scale=0.1, **kw)  # noqa: E731
    call(long_context=True)  # not on Hopper
    monkeypatch.setattr(kp, "on_hopper", lambda: True)
    call(), call(long_context=True), call(long_context=True, decode_backend="triton")
    call(long_context=True, alibi_slopes=jnp.ones(4, jnp.float32))
    assert seen == ["fused", "fused", "mosaic", "fused", "fused"]


def test_fused_decode_and_qkv_write_refuse_bad_inputs():
    rng = np.random.default_rng(0)
    k, v, bt = make_cache(rng, 2, 64, 16, [5, 7])
    qkv = jnp.zeros((3, 2, 6, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="one token per sequence: 3 tokens, 2 sequences"):
        kp.fused_decode_attention(
            qkv,
            jnp.zeros(3, jnp.int32),
            None,
            k,
            v,
            jnp.zeros(3, jnp.int32),
            jnp.asarray([5, 7], jnp.int32),
            bt,
            scale=0.125,
            interpret=True,
        )
    parts = jnp.zeros((4, 2, 2, 6, 64), jnp.float32)
    with pytest.raises(ValueError, match="split-K partials .* needs dtype="):
        kp.fused_decode_attention(
            parts,
            jnp.zeros(2, jnp.int32),
            None,
            k,
            v,
            jnp.zeros(2, jnp.int32),
            jnp.asarray([5, 7], jnp.int32),
            bt,
            scale=0.125,
            interpret=True,
        )
    with pytest.raises(ValueError, match="split-K partials .* needs dtype="):
        kp.qkv_write_kv(parts, jnp.zeros(2, jnp.int32), None, k, v, jnp.zeros(2, jnp.int32), interpret=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_model_through_pallas_kernels_matches_reference(tmp_path, tp):
    """The decoder with backend "pallas" (fused qkv/RoPE/write kernel, ragged kernel, the decode kernel for the
    one-token sequences of a mixed step; interpret mode) gives the reference backend's logits over a
    shuffled NaN-filled cache with a cached-prefix step; with tp = 2 the kernels run inside shard_map on
    each shard's kv heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxllm.config import ModelConfig
    from jaxllm.models.attention import AttentionConfig
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import ParallelConfig
    from tests.model_harness import ragged_logits

    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=96,
        hidden_size=64 * 2 * tp,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2 * tp,
        num_key_value_heads=tp,
        max_position_embeddings=128,
    )  # H = 64
    LlamaForCausalLM(hf).save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(str(tmp_path), dtype="float32")
    mesh = ParallelConfig(tp, 1).make_mesh()
    params = load_params(str(tmp_path), cfg, mesh)
    seqs, cached = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89], [11, 7], [8] * 9], [8, 1, 0]
    ref = ragged_logits(params, cfg, seqs, cached, block_size=8, attn=AttentionConfig(mesh=mesh))
    out = ragged_logits(
        params, cfg, seqs, cached, block_size=8, attn=AttentionConfig(backend="pallas", interpret=True, mesh=mesh)
    )
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())


@pytest.mark.parametrize("cached,split_tokens", [([8, 1, 0], 9 + 5), ([10, 1, 8], 3 + 5)])
def test_model_split_k_qkv_path_matches_reference(tmp_path, monkeypatch, cached, split_tokens):
    """Token batches of <= decoder.QKV_SPLIT_MAX_TOKENS on the Pallas backend compute the qkv projection as
    split-K partials, summed in the qkv/RoPE/write kernel: logits equal the reference backend's. [8, 1, 0]: the
    first step (9 cached tokens + 5 padding) takes it and the prefix it writes is read by the plain second
    step; [10, 1, 8]: the second, decode-only step takes it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxllm.config import ModelConfig
    from jaxllm.models import decoder
    from jaxllm.models.attention import AttentionConfig
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import ParallelConfig
    from tests.model_harness import ragged_logits

    torch.manual_seed(1)
    hf = LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )  # H = 32
    LlamaForCausalLM(hf).save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(str(tmp_path), dtype="float32")
    mesh = ParallelConfig(1, 1).make_mesh()
    params = load_params(str(tmp_path), cfg, mesh)
    seqs = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89], [11, 7], [8] * 9]
    pallas = AttentionConfig(backend="pallas", interpret=True, mesh=mesh)
    assert decoder.qkv_splits(split_tokens, params["layers"][0], cfg, pallas) == 4
    assert decoder.qkv_splits(17, params["layers"][0], cfg, pallas) == 0
    assert decoder.qkv_splits(8, dict(params["layers"][0], b_qkv=None), cfg, pallas) == 0
    seen = []
    real = kp.qkv_write_kv
    monkeypatch.setattr(kp, "qkv_write_kv", lambda qkv, *a, **k: seen.append(qkv.shape) or real(qkv, *a, **k))
    jax.clear_caches()  # the harness's step and the layer are jitted: trace them again with the spy
    out = ragged_logits(params, cfg, seqs, cached, block_size=8, attn=pallas)
    assert (4, split_tokens, 2, 4, 32) in seen  # [splits, T, K, G + 2, H] partials
    ref = ragged_logits(params, cfg, seqs, cached, block_size=8, attn=AttentionConfig(mesh=mesh))
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())


@pytest.mark.parametrize("tp", [1, 2])
def test_model_fused_decode_step_matches_reference(tmp_path, monkeypatch, tp):
    """A decode-only step in the engine's layout (token b is sequence b's; padding tokens meet padding
    sequences) goes through kernels_pallas.fused_decode_attention and gives the reference backend's logits:
    at tp 1 from the split-K qkv partials (with 2 splits set through attention.FUSED_DECODE_TUNING), at tp 2
    inside shard_map from each shard's plain qkv."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxllm.config import ModelConfig
    from jaxllm.models import attention
    from jaxllm.models.attention import AttentionConfig
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import ParallelConfig
    from tests.model_harness import ragged_logits

    torch.manual_seed(2)
    hf = LlamaConfig(
        vocab_size=96,
        hidden_size=64 * 2 * tp,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4 * tp,
        num_key_value_heads=2 * tp,
        max_position_embeddings=128,
    )  # H = 32
    LlamaForCausalLM(hf).save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(str(tmp_path), dtype="float32")
    mesh = ParallelConfig(tp, 1).make_mesh()
    params = load_params(str(tmp_path), cfg, mesh)
    seqs, cached = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89], [11, 7], [8] * 9], [10, 1, 8]
    seen, tuning = [], []
    real = kp.fused_decode_attention

    def spy(qkv, *a, **k):
        seen.append(qkv.shape)
        tuning.append(k.get("num_splits"))
        return real(qkv, *a, **k)

    monkeypatch.setattr(kp, "fused_decode_attention", spy)
    if tp == 1:  # attention.FUSED_DECODE_TUNING reaches the kernel (bench/probes/step_probe.py's variants set it)
        monkeypatch.setattr(attention, "FUSED_DECODE_TUNING", {"num_splits": 2})
    jax.clear_caches()  # the harness's step and the layer are jitted: trace them again with the spy
    pallas = AttentionConfig(backend="pallas", interpret=True, mesh=mesh)
    out = ragged_logits(params, cfg, seqs, cached, block_size=8, attn=pallas, pad_tokens=2, pad_seqs=2)
    assert seen == [(4, 5, 2, 4, 32)] if tp == 1 else seen == [(5, 2, 4, 32)]  # [S,] T = B = 5, K per shard 2
    assert tuning == [2 if tp == 1 else None]
    ref = ragged_logits(
        params, cfg, seqs, cached, block_size=8, attn=AttentionConfig(mesh=mesh), pad_tokens=2, pad_seqs=2
    )
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())


@pytest.mark.parametrize("smallest", [2, 1])
def test_two_row_decode_plans_one_sequence_only_where_it_is_the_smallest_bucket(tmp_path, monkeypatch, smallest):
    """attention.ONE_SEQ_DECODE_ROWS: a 2-row decode step plans the kernel's split-K for one live sequence where 2 rows
    is the engine's smallest bucket (AttentionConfig.smallest_decode_rows 2: one sequence and a padding row); with
    a 1-row bucket (int-weight models, runner.smallest_seq_bucket) a 2-row step holds two live sequences and plans
    for both. Logits equal the reference backend's either way."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxllm.config import ModelConfig
    from jaxllm.models.attention import AttentionConfig
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import ParallelConfig
    from tests.model_harness import ragged_logits

    torch.manual_seed(3)
    hf = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(hf).save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(str(tmp_path), dtype="float32")
    mesh = ParallelConfig(1, 1).make_mesh()
    params = load_params(str(tmp_path), cfg, mesh)
    seqs, cached = [[5, 9, 2, 7, 3, 14], [11, 7, 30]], [5, 2]  # step 2: two live one-token sequences
    plans = []
    real = kp.fused_decode_attention
    monkeypatch.setattr(kp, "fused_decode_attention", lambda *a, **k: plans.append(k.get("plan_seqs")) or real(*a, **k))
    jax.clear_caches()
    pallas = AttentionConfig(backend="pallas", interpret=True, mesh=mesh, smallest_decode_rows=smallest)
    out = ragged_logits(params, cfg, seqs, cached, block_size=8, attn=pallas, pad_tokens=0, pad_seqs=0)
    assert plans == [1 if smallest == 2 else None]
    ref = ragged_logits(
        params, cfg, seqs, cached, block_size=8, attn=AttentionConfig(mesh=mesh), pad_tokens=0, pad_seqs=0
    )
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())


# ---- Mosaic GPU prefill kernel (_prefill_mgpu.py), in jax's Mosaic GPU interpreter (slow: two cases) ----


def test_mosaic_prefill_matches_reference():
    """Chunks over cached prefixes (one ends mid-page: NaN in the page's tail), padding tokens: zeros; G = 2 over
    K = 2 kv heads (the only Mosaic prefill case where head // G differs from head % K)."""
    from kernels_pallas._prefill_mgpu import ragged_prefill_mgpu

    rng = np.random.default_rng(5)
    q_lens, seq_lens = [70, 5], [100, 40]
    args = _ragged_args(rng, 4, 2, 64, 16, jnp.bfloat16, q_lens, seq_lens)
    out = ragged_prefill_mgpu(*args, scale=0.125, block_kv=64, interpret=True)
    check(out, reference.ragged_paged_attention_ref(*args, scale=0.125), jnp.bfloat16)
    assert not np.asarray(out[sum(q_lens) :], np.float32).any(), "padding tokens must be zero"


def test_mosaic_prefill_through_the_entry_point_mixed_batch():
    """One-token sequences to the decode kernel, the rest to Mosaic tiles (skip_single), fp16, G = 2, the default
    128-key blocks. Two q heads on one kv head: the interpreter's time grows with the grid (N = 4 took ~80 s on
    CPU, N = 2 ~30 s); the head -> kv head mapping with K > 1 is the test above's."""
    rng = np.random.default_rng(8)
    q_lens, seq_lens = [1, 30, 1, 0], [50, 45, 17, 0]
    q, k, v, lens, qsl, bt = _ragged_args(rng, 2, 1, 64, 16, jnp.float16, q_lens, seq_lens)
    out = kp.ragged_paged_attention(q, k, v, lens, qsl, bt, scale=0.125, prefill_backend="mosaic", interpret=True)
    check(out, reference.ragged_paged_attention_ref(q, k, v, lens, qsl, bt, scale=0.125), jnp.float16)
    assert not np.asarray(out[int(qsl[-1]) :], np.float32).any()


def test_mosaic_kernels_are_named_for_traces():
    """Each Mosaic GPU kernel's CUDA name (NAME_mosaic_gpu_kernel in XProf traces) says what it is, so that
    bench/profile_summary.kernel_category files it: until stop 58 the attention kernels and the nk int4 GEMM were all
    entry_mosaic_gpu_kernel. Checked in the CUDA lowering, run on CPU."""
    from bench.profile_summary import kernel_category
    from kernels_pallas._decode_mgpu import paged_decode_mgpu
    from kernels_pallas._prefill_mgpu import ragged_prefill_mgpu

    rng = np.random.default_rng(5)
    args = _ragged_args(rng, 4, 2, 64, 16, jnp.bfloat16, [70, 5], [100, 40])
    prefill = jax.jit(functools.partial(ragged_prefill_mgpu, scale=0.125, block_kv=64))
    k, v, bt = make_cache(rng, 1, 64, 16, [100, 1])
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    decode = jax.jit(functools.partial(paged_decode_mgpu, scale=0.125, num_splits=2, slots=4))
    lens = jnp.asarray([100, 1], jnp.int32)
    for f, a, name, category in (
        (prefill, args, "ragged_prefill_mgpu", "prefill_attention"),
        (decode, (q, k, v, lens, bt), "paged_decode_mgpu", "decode_attention"),
    ):
        text = f.trace(*a).lower(lowering_platforms=("cuda",)).as_text()
        assert f"{name}_mosaic_gpu" in text and "entry_mosaic_gpu" not in text
        assert kernel_category(f"{name}_mosaic_gpu_kernel") == category


# ---- Mosaic GPU decode kernel (_decode_mgpu.py), in the interpreter (slow: small grids) ----


@pytest.mark.parametrize(
    "N,K,dtype,lens,table_pages,splits,slots",
    [
        # split-K: empty / one-token / page-boundary / padding sequences, NaN in unused pages and page tails; one
        # kv head (the interpreter's time grows with the grid: B x K x splits CTAs)
        (4, 1, jnp.bfloat16, [100, 1, 17, 0], None, 2, 4),
        # one split (the output written in q's dtype, no combine); G = 8 over K = 2 kv heads; 4 blocks through a
        # 2-slot ring; a table exactly as wide as the longest sequence and not a whole number of 4-page blocks
        (16, 2, jnp.float16, [200, 16, 33], 13, 1, 2),
    ],
)
def test_mosaic_decode_matches_reference(N, K, dtype, lens, table_pages, splits, slots):
    from kernels_pallas._decode_mgpu import paged_decode_mgpu

    rng = np.random.default_rng(11)
    k, v, bt = make_cache(rng, K, 64, 16, lens, M=table_pages, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), N, 64)), dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out = paged_decode_mgpu(q, k, v, seq_lens, bt, scale=0.125, num_splits=splits, slots=slots, interpret=True)
    check(out, reference.paged_decode_attention_ref(q, k, v, seq_lens, bt, scale=0.125), dtype)
    assert not np.asarray(out[np.asarray(lens) == 0], np.float32).any(), "a padding sequence must give zeros"


def test_decode_backend_choice(monkeypatch):
    q = jnp.zeros((2, 8, 64), jnp.bfloat16)
    pages = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
    choose = kp._decode_backend
    assert choose(q, pages, dict(scale=1.0), "auto", interpret=True) == "triton"  # CPU / interpreter
    assert choose(q, pages, dict(scale=1.0), "mosaic", interpret=True) == "mosaic"
    with pytest.raises(ValueError, match="Mosaic GPU decode kernel does not take"):
        choose(q, pages, dict(scale=1.0, alibi_slopes=jnp.ones(8)), "mosaic", interpret=True)
    with pytest.raises(ValueError, match="decode_backend"):
        choose(q, pages, dict(scale=1.0), "cuda", interpret=True)
    for bad in (dict(sliding_window=8), dict(k_scale=0.5)):
        assert not kp._decode_mgpu.supported(q, pages, **bad)
    assert not kp._decode_mgpu.supported(q, pages.astype(jnp.float8_e4m3fn))
    assert not kp._decode_mgpu.supported(jnp.zeros((2, 40, 64), jnp.bfloat16), pages)  # G = 20 > 16 rows
    assert choose(q, pages, dict(scale=1.0), None, interpret=True) == "triton"  # None: the environment, else auto
    monkeypatch.setenv("JAXLLM_DECODE_BACKEND", "mosaic")
    assert choose(q, pages, dict(scale=1.0), None, interpret=True) == "mosaic"
    monkeypatch.setenv("JAXLLM_DECODE_BACKEND", "flash")
    with pytest.raises(ValueError, match="^JAXLLM_DECODE_BACKEND='flash' is not one of"):  # the variable is named
        choose(q, pages, dict(scale=1.0), None, interpret=True)


def test_prefill_backend_choice():
    q = jnp.zeros((8, 8, 64), jnp.bfloat16)
    pages = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
    choose = kp._prefill_backend
    assert choose(q, pages, dict(scale=1.0), "auto", interpret=True) == "triton"  # CPU / interpreter
    assert choose(q, pages, dict(scale=1.0), "mosaic", interpret=True) == "mosaic"
    with pytest.raises(ValueError, match="Mosaic GPU prefill kernel does not take"):
        choose(q, pages, dict(scale=1.0, sliding_window=8), "mosaic", interpret=True)
    with pytest.raises(ValueError, match="prefill_backend"):
        choose(q, pages, dict(scale=1.0), "cuda", interpret=True)
    assert not kp._prefill_mgpu.supported(q, pages.astype(jnp.float8_e4m3fn))
