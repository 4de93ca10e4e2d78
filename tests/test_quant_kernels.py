"""Quantized matmuls (kernels_pallas.quant, qlayout, _qmatmul): the packed layout, act-order, the Pallas kernel in
interpret mode against the pure-jnp reference, and FP8 W8A8, on CPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import quant
from kernels_pallas.qlayout import (
    QuantizedWeight,
    act_order_perm,
    choose_plane,
    dequantize,
    pack_quantized,
    quantize_weight,
    unpack_quantized,
)
from kernels_pallas.quant import fp8_matmul, fp8_matmul_ref, quantize_fp8, quantized_matmul, quantized_matmul_ref


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def packed(rng, K, N, bits, G, sym, dtype=jnp.bfloat16, **kw):
    wf = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    q, s, z = quantize_weight(wf, bits=bits, group_size=G, sym=sym)
    return wf, q, s, z, pack_quantized(q, s, z, bits=bits, group_size=G, dtype=dtype, **kw)


def numpy_product(x, q, s, z, bits, G):
    """x @ ((q - z) * s) in float64 from the plain integers (no layout involved)."""
    K = q.shape[0]
    Gs = K if G == -1 else G
    zz = np.repeat(z, Gs, 0) if z is not None else 2 ** (bits - 1)
    w = (q.astype(np.float64) - zz) * np.repeat(s.astype(np.float64), Gs, 0)
    return np.asarray(x, np.float64) @ w


def test_layout_word_fields_are_the_documented_planes():
    """Field j of word row L * t + r holds q[t * L * P + L * j + r] (qlayout's docstring), for int4 and int8."""
    rng = np.random.default_rng(0)
    for bits, K in ((4, 512), (8, 256)):
        P = 32 // bits
        q = rng.integers(0, 1 << bits, (K, 3))
        w = pack_quantized(q, np.ones((K // 64, 3)), bits=bits, group_size=64)
        L = w.plane
        assert L == 64 and w.qweight.shape == (K // P, 3) and w.qweight.dtype == jnp.int32
        words = np.asarray(w.qweight).view(np.uint32)
        for t, j, r, n in ((0, 0, 0, 0), (0, P - 1, L - 1, 2), (K // (L * P) - 1, 1, 5, 1)):
            field = (words[t * L + r, n] >> (bits * j)) & ((1 << bits) - 1)
            assert field == q[t * L * P + L * j + r, n]
        assert (unpack_quantized(w) == q).all()


def test_plane_choice_and_padding():
    assert choose_plane(4096, 4, 128) == 128 and choose_plane(14336, 4, 128) == 128
    assert choose_plane(576, 4, 64) == 64 and choose_plane(576, 4, 32) == 32  # 576 = 18 * 32, not 1024s
    assert choose_plane(4096, 4, -1) == 128 and choose_plane(4096, 4, 48) == 0
    rng = np.random.default_rng(1)
    _, q, s, z, w = packed(rng, 576, 16, 4, 64, False)
    assert w.k == 576 and w.kp == 1024 and w.scales.shape == (16, 16)  # K padded with zero rows / zero scales
    assert (unpack_quantized(w) == q).all()
    assert not np.asarray(w.scales[9:], np.float32).any()


@pytest.mark.parametrize("bits,G,sym", [(4, 128, True), (4, 32, False), (8, -1, True), (8, 64, False)])
def test_dequantize_and_reference_match_numpy(bits, G, sym):
    rng = np.random.default_rng(2)
    K = 256 if G != 128 else 512
    wf, q, s, z, w = packed(rng, K, 24, bits, G, sym, dtype=jnp.float32)
    Gs = K if G == -1 else G
    zz = np.repeat(z, Gs, 0) if z is not None else 2 ** (bits - 1)
    np.testing.assert_allclose(np.asarray(dequantize(w)), (q - zz) * np.repeat(s, Gs, 0), rtol=1e-6, atol=1e-7)
    x = rng.standard_normal((3, K)).astype(np.float32)
    assert rel(quantized_matmul_ref(jnp.asarray(x), w), numpy_product(x, q, s, z, bits, G)) < 1e-5
    assert rel(quantized_matmul_ref(jnp.asarray(x), w), x @ wf) < (0.15 if bits == 4 else 0.02)  # RTN error


def test_dequantize_lowers_to_elementwise_ops():
    """The large-batch path's dequantization is elementwise ops and broadcasts only, which XLA fuses into one loop
    writing the weight; jnp.repeat(total_repeat_length=...) had put a gather (through an index array built by a
    scatter and a cumsum) into it. Also on a weight whose K is padded (576 rows in 1024-row tiles)."""
    rng = np.random.default_rng(4)
    _, q, s, z, w = packed(rng, 576, 16, 4, 64, False, dtype=jnp.float32)
    want = (q - np.repeat(z, 64, 0)) * np.repeat(s, 64, 0)
    np.testing.assert_allclose(np.asarray(dequantize(w)), want, rtol=1e-6, atol=1e-7)
    ops = set(re.findall(r"stablehlo\.(\w+)", jax.jit(dequantize).lower(w).as_text()))
    assert not ops & {"gather", "scatter", "reduce_window", "dynamic_slice"}, ops


def test_act_order_permutation_math():
    """x @ W == x[:, perm] @ W[perm]: a GPTQ desc_act weight (row k in group g_idx[k]) packed with its g_idx gives
    the product of the plain integers, through the reference and the kernel."""
    rng = np.random.default_rng(3)
    K, N, G = 512, 32, 64
    g_idx = rng.permutation(np.arange(K) // G)
    q = rng.integers(0, 16, (K, N))
    s = rng.uniform(0.5, 1.5, (K // G, N)).astype(np.float32) * 0.01
    # what the checkpoint means: row k dequantizes with group g_idx[k]'s scale and zero 8
    w_true = (q - 8.0) * s[g_idx]
    w = pack_quantized(q, s, None, bits=4, group_size=G, g_idx=g_idx, dtype=jnp.float32)
    perm = act_order_perm(g_idx, G)
    assert w.perm is not None and (np.asarray(w.perm) == perm).all()
    assert (np.sort(g_idx[perm]) == g_idx[perm]).all()
    x = rng.standard_normal((2, K)).astype(np.float32)
    want = x.astype(np.float64) @ w_true
    assert rel(quantized_matmul_ref(jnp.asarray(x), w), want) < 1e-5
    xb = jnp.asarray(x, jnp.bfloat16)
    got = quantized_matmul(
        xb,
        pack_quantized(q, s, None, bits=4, group_size=G, g_idx=g_idx, dtype=jnp.bfloat16),
        backend="kernel",
        interpret=True,
    )
    assert rel(got, np.asarray(xb, np.float64) @ w_true) < 1e-2
    assert act_order_perm(np.arange(K) // G, G) is None  # no act-order: no permutation
    with pytest.raises(ValueError, match="exactly group_size"):
        act_order_perm(np.r_[np.zeros(G + 1), np.ones(K - G - 1)].astype(int), G)


# (K, N, M, bits, group_size, sym, tuning): every variant of the kernel (FMA for 1 row, MMA with stacked rows,
# split-K partials, planes unrolled or as a loop, several M blocks), K not a multiple of the tile (padded)
KERNEL_CASES = [
    (1024, 64, 1, 4, 128, True, {}),
    (576, 48, 3, 4, 64, False, {}),
    (512, 32, 5, 4, 32, True, dict(splits=2)),
    (1024, 32, 2, 4, -1, False, dict(fma=True, plane_loop=True)),
    (512, 64, 16, 8, -1, True, dict(plane_loop=False)),
    (512, 32, 64, 8, 128, False, dict(block_n=16)),
    (256, 32, 8, 8, 32, True, dict(splits=3)),
    (256, 16, 70, 4, 64, False, {}),  # two M blocks of 64
    (256, 32, 256, 4, 128, True, dict(block_m=128)),  # the large-M option: two M blocks of 128
]


@pytest.mark.parametrize("K,N,M,bits,G,sym,tuning", KERNEL_CASES)
def test_kernel_matches_reference(K, N, M, bits, G, sym, tuning):
    rng = np.random.default_rng(K + N + M)
    wf, q, s, z, w = packed(rng, K, N, bits, G, sym)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    got = quantized_matmul(x, w, backend="kernel", interpret=True, **tuning)
    assert got.shape == (M, N) and got.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(got, np.float32)).all()
    ref = quantized_matmul_ref(x, w)
    assert rel(got, ref) < 1e-2
    # against the plain integers in float64: the kernel scales the MMA's float32 result (no bf16 weight rounding)
    assert rel(got, numpy_product(np.asarray(x, np.float32), q, s, z, bits, G)) < 1e-2


def test_kernel_detects_a_wrong_plane_mapping():
    """The tests above fail when the kernel reads a plane from the wrong rows of x: rotate each word's fields by
    one (plane j's values read as plane j + 1's)."""
    rng = np.random.default_rng(7)
    _, q, s, z, w = packed(rng, 1024, 32, 4, 128, True)
    rotated = (w.qweight << 4) | jax.lax.shift_right_logical(w.qweight, 28)
    bad = QuantizedWeight(rotated, w.scales, w.zeros, None, bits=4, group_size=128, k=1024, plane=128)
    x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.bfloat16)
    assert rel(quantized_matmul(x, bad, backend="kernel", interpret=True), quantized_matmul_ref(x, w)) > 0.5


def test_fused_parts_and_leading_dims():
    """One weight over concatenated N (qkv / gate_up) split into its parts; x with leading batch dims."""
    rng = np.random.default_rng(8)
    K, parts = 256, (32, 16, 16)
    wf = rng.standard_normal((K, sum(parts))).astype(np.float32)
    q, s, z = quantize_weight(wf, bits=4, group_size=64, sym=True)
    w = pack_quantized(q, s, z, bits=4, group_size=64, parts=parts, dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 3, K)), jnp.bfloat16)
    outs = quantized_matmul(x, w, split=True, interpret=True)
    full = quantized_matmul_ref(x, w)
    assert [o.shape for o in outs] == [(2, 3, p) for p in parts]
    assert rel(jnp.concatenate(outs, -1), full) < 1e-2
    with pytest.raises(ValueError, match="parts"):
        pack_quantized(q, s, z, bits=4, group_size=64, parts=(32, 16))


def test_entry_point_paths_and_errors():
    rng = np.random.default_rng(9)
    _, q, s, z, w = packed(rng, 256, 32, 4, 64, False)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    # on CPU without interpret: the dequantize + dot path, the reference's math in x's dtype
    assert rel(quantized_matmul(x, w), quantized_matmul_ref(x, w)) < 1e-2
    assert rel(quantized_matmul(x, w, max_kernel_m=2, interpret=True), quantized_matmul_ref(x, w)) < 1e-2
    with pytest.raises(ValueError, match="features"):
        quantized_matmul(x[:, :128], w)
    with pytest.raises(ValueError, match="backend"):
        quantized_matmul(x, w, backend="cuda")
    with pytest.raises(ValueError, match="does not take"):  # float32 activations: the kernel would run TF32
        quantized_matmul(x.astype(jnp.float32), w, backend="kernel", interpret=True)
    with pytest.raises(ValueError, match="split=True"):
        quantized_matmul(x, w, split=True)
    for m, bad in ((96, 48), (512, 512)):  # block_m not a power of two; over LARGEST_BLOCK_M (both divide M)
        xm = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
        with pytest.raises(ValueError, match="block_m"):
            quantized_matmul(xm, w, backend="kernel", interpret=True, block_m=bad)
    with pytest.raises(ValueError, match="unsigned"):
        pack_quantized(q - 9, s, z, bits=4, group_size=64)
    with pytest.raises(ValueError, match="divide"):
        pack_quantized(q, s, z, bits=4, group_size=100)
    with pytest.raises(ValueError, match="bits"):
        pack_quantized(q, s, z, bits=3, group_size=64)
    with pytest.raises(ValueError, match="scales"):
        pack_quantized(q, s[:2], z, bits=4, group_size=64)


def test_kernel_lowers_for_cuda():
    """The Triton lowering of both variants runs (jax's cross-platform lowering on CPU; the GPU compile is the
    bench's --check stage)."""
    from kernels_pallas._qmatmul import qmatmul_kernel

    for M, fma, block_m in ((1, True, None), (16, False, None), (256, False, 128)):
        args = (
            jax.ShapeDtypeStruct((M, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, 256), jnp.int32),
            jax.ShapeDtypeStruct((8, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((8, 256), jnp.bfloat16),
        )
        f = jax.jit(
            lambda x, qw, s, z, fma=fma, bm=block_m: qmatmul_kernel(
                x, qw, s, z, bits=4, group_size=128, plane=128, fma=fma, block_m=bm
            )
        )
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "qmatmul_int4_g128_L128" in text and ("BM_128" in text) == (block_m == 128)


# ---- FP8 W8A8 ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_channel,act", [(True, "token"), (False, "tensor"), (True, 0.05)])
def test_fp8_matmul_matches_reference(per_channel, act):
    rng = np.random.default_rng(10)
    K, N = 256, 48
    wf = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    wq, ws = quantize_fp8(wf, per_channel=per_channel)
    assert wq.dtype == jnp.float8_e4m3fn and jnp.shape(ws) == ((N,) if per_channel else ())
    x = jnp.asarray(rng.standard_normal((2, 5, K)), jnp.bfloat16)
    kw = dict(x_scale=act) if isinstance(act, float) else dict(act_scale=act)
    got = jax.jit(lambda x, w, s: fp8_matmul(x, w, s, **kw))(x, wq, ws)
    assert got.shape == (2, 5, N) and got.dtype == jnp.bfloat16
    assert rel(got, fp8_matmul_ref(x, wq, ws, **kw)) < 1e-2
    # and close to the unquantized product (e4m3 keeps 3 mantissa bits: a few percent)
    assert rel(got, np.asarray(x, np.float32) @ wf.T) < 0.08


def test_fp8_dynamic_scales_and_errors():
    rng = np.random.default_rng(11)
    wq, ws = quantize_fp8(rng.standard_normal((16, 64)))
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32).at[1].set(0.0)  # an all-zero row stays finite
    xq, sx = quant.quantize_activations(x)
    assert sx.shape == (3, 1) and float(sx[1, 0]) == np.float32(quant.FP8_MIN_SCALE)
    assert float(jnp.abs(xq.astype(jnp.float32)).max()) <= quant.FP8_MAX
    y = fp8_matmul(x, wq, ws)
    assert np.isfinite(np.asarray(y)).all() and not np.asarray(y[1]).any()
    text = jax.jit(lambda x: fp8_matmul(x, wq, ws)).lower(x).as_text()
    assert "f8E4M3FN" in text and "dot_general" in text  # the dot itself is fp8 x fp8
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul(x, wq.astype(jnp.bfloat16), ws)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        fp8_matmul(x, wq.T, ws)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_matmul(x, wq, jnp.ones((3,)))
    with pytest.raises(ValueError, match="act_scale"):
        fp8_matmul(x, wq, ws, act_scale="row")


def test_entry_point_runs_more_than_64_rows_in_128_row_blocks(monkeypatch):
    """Above 64 rows (up to MAX_KERNEL_M) the entry point pads M to a multiple of 64 and, where that is a multiple
    of 128, runs the kernel with LARGE_M_TILING's 128-row blocks; the result matches the reference."""
    from kernels_pallas import _qmatmul, quant

    seen = []
    kernel = _qmatmul.qmatmul_kernel

    def spy(*args, **kw):
        seen.append((args[0].shape[0], kw.get("block_m"), kw.get("block_n")))
        return kernel(*args, **kw)

    monkeypatch.setattr(_qmatmul, "qmatmul_kernel", spy)
    rng = np.random.default_rng(11)
    _, q, s, z, w = packed(rng, 256, 64, 4, 64, False)
    for m in (200, 150):  # padded to 256 (128-row blocks) and to 192 (64-row blocks)
        x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
        assert rel(quant.quantized_matmul(x, w, interpret=True), quantized_matmul_ref(x, w)) < 1e-2
    assert seen == [(256, 128, 64), (192, None, None)], seen
