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


def test_split_plan_for_decode_rows():
    """_qmatmul.plan: int4 GEMMs of 1-2 rows split K into ~8 programs an SM (a power of two, at most 16, whole
    tiles each; the H100 sweep behind it is in _qmatmul.py), other sizes ~2 an SM (8B shapes, 64-row planes)."""
    from kernels_pallas._qmatmul import plan

    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
    got = {(name, m): plan(m, k, n, 4, 64, fma=True)[1] for name, (k, n) in shapes.items() for m in (1, 2, 3)}
    assert {k: v for k, v in got.items() if k[1] < 3} == {
        **{(name, m): s for name, s in (("qkv", 8), ("o", 8), ("gate_up", 4), ("down", 14)) for m in (1, 2)}
    }  # qkv / o: all 8 tiles of K; down: 16 splits of 28 tiles are 14 of 2
    assert got[("gate_up", 3)] == 1 and got[("o", 3)] == 4 and got[("down", 3)] == 5
    assert plan(1, 4096, 28672, 8, 64, fma=True)[1] == 1  # int8: ~2 an SM


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


# dequant="asm" (kernels_pallas/_qdequant.py), interpret mode: the jnp twins of the PTX, the same M + q values and the
# zero point folded out of the MMA through x's row sums. (K, N, M, bits, group_size, sym, x dtype, tuning)
ASM_CASES = [
    (1024, 64, 1, 4, 128, True, jnp.bfloat16, dict(fma=False)),  # one row, 16 copies loaded by row index
    (1024, 64, 1, 4, 128, False, jnp.bfloat16, {}),  # the FMA variant (M = 1's default)
    (576, 48, 3, 4, 64, False, jnp.bfloat16, {}),  # K padded to whole tiles, 3 rows run as 4
    (512, 32, 2, 4, 32, True, jnp.float16, dict(plane_loop=False, splits=2)),  # float16: 64 + q, static PRMT
    (1024, 32, 5, 4, -1, False, jnp.bfloat16, {}),  # per channel
    (1024, 32, 2, 4, -1, True, jnp.float16, dict(fma=True, plane_loop=True)),
    (512, 64, 16, 4, 128, False, jnp.float16, dict(plane_loop=True)),  # the pair loop's traced PRMT control
    (256, 16, 33, 4, 64, True, jnp.bfloat16, {}),
    (256, 32, 64, 4, 128, False, jnp.bfloat16, dict(block_n=16)),
    (512, 64, 8, 8, -1, True, jnp.bfloat16, dict(plane_loop=False)),  # int8: PRMT under the 2^23 magic
    (512, 32, 1, 8, 128, False, jnp.float16, {}),
    (256, 32, 4, 8, 32, False, jnp.bfloat16, dict(fma=True, plane_loop=True)),
    # dequant="asm_sub": the int4 MMA's zero point subtracted in x's dtype, no row sums
    (1024, 64, 1, 4, 128, False, jnp.bfloat16, dict(fma=False, dequant="asm_sub")),
    (576, 48, 16, 4, 64, True, jnp.float16, dict(dequant="asm_sub", plane_loop=False)),
    (1024, 32, 64, 4, -1, False, jnp.bfloat16, dict(dequant="asm_sub")),
    (256, 32, 256, 4, 128, False, jnp.bfloat16, dict(block_m=128)),  # two row blocks of 128
]


@pytest.mark.parametrize("K,N,M,bits,G,sym,dtype,tuning", ASM_CASES)
def test_asm_dequant_matches_reference(K, N, M, bits, G, sym, dtype, tuning):
    rng = np.random.default_rng(K + N + M + bits)
    _, q, s, z, w = packed(rng, K, N, bits, G, sym, dtype=dtype)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    tuning = {"dequant": "asm", **tuning}
    got = quantized_matmul(x, w, backend="kernel", interpret=True, **tuning)
    assert got.shape == (M, N) and got.dtype == dtype
    assert rel(got, quantized_matmul_ref(x, w)) < 1e-2
    exact = numpy_product(np.asarray(x, np.float32), q, np.asarray(w.scales, np.float32)[: s.shape[0]], z, bits, G)
    assert rel(got, exact) < (4e-3 if dtype == jnp.bfloat16 else 1e-3)  # the output's rounding only
    float_path = quantized_matmul(x, w, backend="kernel", interpret=True, **{**tuning, "dequant": "float"})
    assert rel(got, float_path) < 4e-3


@pytest.mark.parametrize(
    "fma,dtype,dequant",
    [
        (False, jnp.bfloat16, "asm"),
        (False, jnp.float16, "asm"),
        (True, jnp.bfloat16, "asm"),
        (False, jnp.bfloat16, "asm_sub"),
    ],
)
def test_asm_dequant_float32_partials_are_exact(fma, dtype, dequant):
    """Split-K partials (float32, before any rounding to x's dtype) of the asm path against the float64 product:
    the zero point folded out of the MMA through x's row sums, (M + z) * rowsum subtracted per plane, costs only
    float32 rounding (~1e-6 here, the float path ~1e-7); a fold that used another plane's row sums or group's zero
    would be off by ~1."""
    from kernels_pallas._qmatmul import qmatmul_kernel

    rng = np.random.default_rng(12)
    K, N, M, G = 2048, 32, 4, 64
    _, q, s, z, w = packed(rng, K, N, 4, G, False, dtype=dtype)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    kw = dict(bits=4, group_size=G, plane=w.plane, splits=2, fma=fma, dequant=dequant, interpret=True)
    parts = qmatmul_kernel(x, w.qweight, w.scales, w.zeros, **kw)
    assert parts.shape == (2, M, N) and parts.dtype == jnp.float32
    exact = numpy_product(np.asarray(x, np.float32), q, np.asarray(w.scales, np.float32), z, 4, G)
    assert rel(np.asarray(parts, np.float64).sum(0), exact) < 5e-6


@pytest.mark.parametrize("fma,plane_loop", [(True, False), (True, True), (False, True)])
def test_prefetch_partials_equal_the_plain_loop(fma, plane_loop):
    """prefetch=True (tile t + 1's words loaded before tile t is dequantized) gives bitwise the plain loop's float32
    split-K partials: 5 tiles in splits of 3 and 2, so the carried words cross tiles and each split's last tile
    reloads itself; a carry off by one tile would change every partial."""
    from kernels_pallas._qmatmul import qmatmul_kernel

    rng = np.random.default_rng(14)
    K, N, M, G = 2560, 32, 1 if fma else 4, 64
    _, q, s, z, w = packed(rng, K, N, 4, G, False)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    kw = dict(bits=4, group_size=G, plane=w.plane, splits=2, fma=fma, plane_loop=plane_loop, interpret=True)
    plain = qmatmul_kernel(x, w.qweight, w.scales, w.zeros, **kw)
    got = qmatmul_kernel(x, w.qweight, w.scales, w.zeros, prefetch=True, **kw)
    assert got.shape == (2, M, N) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    exact = numpy_product(np.asarray(x, np.float32), q, np.asarray(w.scales, np.float32)[: s.shape[0]], z, 4, G)
    assert rel(np.asarray(got, np.float64).sum(0), exact) < 5e-6
    with pytest.raises(ValueError, match="prefetch"):
        qmatmul_kernel(x, w.qweight, w.scales, w.zeros, prefetch=True, dequant="asm", **kw)


def test_asm_dequant_detects_a_wrong_zero_fold(monkeypatch):
    """The tests above fail when the zero point is folded wrongly: offsets one too large for the MMA's M + q (as
    if z were z + 1) move the product far past their bounds."""
    from kernels_pallas import _qdequant

    rng = np.random.default_rng(13)
    _, q, s, z, w = packed(rng, 768, 48, 4, 64, False)
    x = jnp.asarray(rng.standard_normal((2, 768)), jnp.bfloat16)
    right = quantized_matmul(x, w, backend="kernel", interpret=True, dequant="asm", fma=False)
    exact = numpy_product(np.asarray(x, np.float32), q, np.asarray(w.scales, np.float32)[: s.shape[0]], z, 4, 64)
    assert rel(right, exact) < 4e-3
    jax.clear_caches()
    monkeypatch.setattr(_qdequant, "pair_offsets", lambda dtype: (129.0, 129.0))
    wrong = quantized_matmul(x, w, backend="kernel", interpret=True, dequant="asm", fma=False)
    assert rel(wrong, exact) > 0.1
    jax.clear_caches()


def run_ptx(asm, *operands):
    """The few PTX instructions of kernels_pallas/_qdequant.py's asm on numpy uint32 registers, as the PTX ISA
    defines them (prmt.b32's generic form, lop3.b32's truth table, logical shifts): operands[k] binds $(k + 1), the
    result is $0. Checks the asm's text (controls, masks, magics, operand numbers), not the hardware."""
    regs = {f"${k + 1}": np.asarray(v, np.uint32) for k, v in enumerate(operands)}

    def val(tok):
        return regs[tok] if tok in regs else np.uint32(int(tok, 0))

    for stmt in asm.replace("{", ";").replace("}", ";").replace("\n", ";").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            a, b, c = (val(x).astype(np.uint64) for x in src)
            both = (b << np.uint64(32)) | a
            out = np.zeros(np.broadcast(a, c).shape, np.uint64)
            for k in range(4):
                ctl = (c >> np.uint64(4 * k)) & np.uint64(0xF)
                byte = (both >> ((ctl & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
                sign = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
                out |= np.where(ctl & np.uint64(8), sign, byte) << np.uint64(8 * k)
            regs[d] = out.astype(np.uint32)
        elif op == "lop3.b32":
            a, b, c, lut = (val(x) for x in src)
            out = np.zeros(np.broadcast(a, b, c).shape, np.uint32)
            for k in range(8):  # bit of the truth table at index (a, b, c) = (k >> 2, k >> 1, k) & 1
                if int(lut) >> k & 1:
                    sel = [x if k >> (2 - n) & 1 else ~x for n, x in enumerate((a, b, c))]
                    out |= sel[0] & sel[1] & sel[2]
            regs[d] = out
        elif op in ("shr.u32", "shl.b32"):
            a, n = val(src[0]), int(src[1])
            regs[d] = (a >> np.uint32(n)) if op == "shr.u32" else (a << np.uint32(n))
        else:
            raise AssertionError(f"unknown instruction {op}")
    return regs["$0"]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_asm_text_computes_the_interpret_twins_bits(dtype):
    """Each PTX statement of the asm path, run by run_ptx on random words, gives the bits of its jnp twin (what
    interpret mode and the tests above compute): the pair dequantization for bytes 0..3 with a static and a register
    PRMT control (two words -> two 16-bit halves, the first word's in the low half), the float32 fields of int4 and
    int8, and the values are M + q exactly."""
    from kernels_pallas import _qdequant as dq

    rng = np.random.default_rng(14)
    words = rng.integers(0, 1 << 32, (64, 2), dtype=np.uint64).astype(np.uint32)
    w0, w1 = words[:, 0], words[:, 1]
    jw = jnp.asarray(words.view(np.int32))
    for i in range(4):
        twins = [np.asarray(v).view(np.uint16) for v in dq.dequant_pair(jw, i, dtype, interpret=True)]
        for t in (
            run_ptx(dq.prmt_asm(dq.pair_selector(i)), w0, w1),
            run_ptx(dq.prmt_asm(), w0, w1, dq.pair_selector(i)),
        ):
            for (magic, _, shift, mask), twin in zip(dq.PAIR_MAGIC[jnp.dtype(dtype)], twins, strict=True):
                got = run_ptx(dq.half_asm(magic, shift, mask), t)
                assert (got & 0xFFFF == twin[:, 0]).all() and (got >> 16 == twin[:, 1]).all()
        for half, twin in enumerate(twins):
            q = (words >> np.uint32(8 * i + 4 * half)) & np.uint32(0xF)
            m = dq.pair_offsets(dtype)[half]
            assert (twin.view(jnp.dtype(dtype)).astype(np.float32) == m + q).all()
    for bits in (4, 8):
        by_shift = {0: jw}
        for j in range(32 // bits):
            w, m = dq.f32_field(by_shift, j, bits, interpret=True)
            q = (words >> np.uint32(bits * j)) & np.uint32((1 << bits) - 1)
            assert (np.asarray(w) == m + q).all()
            if bits == 4:
                shift, p = dq.F32_FIELDS[j]
                src = np.asarray(dq.shifted(jw, shift)).view(np.uint32)
                got = run_ptx(dq.lop3_asm(0xF << p, dq.f32_magic(p)), src)
            else:
                got = run_ptx(dq.prmt_asm(dq.byte_selector(j)), words, dq.F32_BYTE_MAGIC)
            assert (got == np.asarray(w).view(np.uint32)).all()


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
    x5 = jnp.concatenate([x, x[:1]])
    with pytest.raises(ValueError, match="at most 4 rows .*, got 5$"):  # the caller's rows, not the padded 8
        quantized_matmul(x5, w, backend="kernel", interpret=True, fma=True)
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

    for M, fma, block_m, prefetch in (
        (1, True, None, False),
        (16, False, None, False),
        (256, False, 128, False),
        (1, True, None, True),
        (16, False, None, True),
    ):
        args = (
            jax.ShapeDtypeStruct((M, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, 256), jnp.int32),
            jax.ShapeDtypeStruct((8, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((8, 256), jnp.bfloat16),
        )
        f = jax.jit(
            lambda x, qw, s, z, fma=fma, bm=block_m, pf=prefetch: qmatmul_kernel(
                x, qw, s, z, bits=4, group_size=128, plane=128, fma=fma, block_m=bm, prefetch=pf
            )
        )
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "qmatmul_int4_g128_L128" in text and ("BM_128" in text) == (block_m == 128)
        assert ("_pf" in text) == prefetch


@pytest.mark.parametrize(
    "M,bits,G,dtype,tuning,asm",
    [  # asm: PTX statements the Triton IR must carry (the plane loop's PRMT control is a register, $3)
        (1, 4, 128, jnp.bfloat16, dict(fma=False), ["prmt.b32 $0, $1, $2, $3;", "0x43004300", "shr.u32 t, $1, 4;"]),
        (4, 4, 64, jnp.float16, dict(plane_loop=False), ["prmt.b32 $0, $1, $2, 0x6622;", "0x00f000f0, 0x54005400"]),
        (1, 4, -1, jnp.bfloat16, dict(fma=True), ["lop3.b32 $0, $1, 0x000f0000, 0x43000000, 0xea;"]),
        (16, 8, -1, jnp.bfloat16, {}, ["prmt.b32 $0, $1, $2, $3;"]),
        (4, 8, 128, jnp.bfloat16, dict(plane_loop=False, fma=True), ["prmt.b32 $0, $1, $2, 0x7543;"]),
        (64, 4, 128, jnp.bfloat16, {}, ["0x43004300"]),
        (16, 4, 128, jnp.bfloat16, dict(dequant="asm_sub"), ["prmt.b32 $0, $1, $2, $3;"]),
    ],
)
def test_asm_dequant_lowers_for_cuda(M, bits, G, dtype, tuning, asm):
    """dequant="asm" lowers to Triton IR for CUDA (on CPU) with its inline PTX in it. Whether ptxas takes that PTX
    is checked by bench/probes/qmatmul_sass.py (needs the triton wheel) and the GPU's --check stage."""
    from kernels_pallas._qmatmul import qmatmul_kernel

    tuning = {"dequant": "asm", **tuning}
    K, N, P, plane = 1024, 256, 32 // bits, 128 if G in (-1, 128) else G
    ng = 1 if G == -1 else K // G
    args = (
        jax.ShapeDtypeStruct((M, K), dtype),
        jax.ShapeDtypeStruct((K // P, N), jnp.int32),
        jax.ShapeDtypeStruct((ng, N), dtype),
        jax.ShapeDtypeStruct((ng, N), dtype),
    )
    f = jax.jit(lambda x, qw, s, z: qmatmul_kernel(x, qw, s, z, bits=bits, group_size=G, plane=plane, **tuning))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert f"qmatmul_int{bits}_g{G}_L{plane}" in text and "_" + tuning["dequant"] in text
    for a in asm:
        assert a in text, a


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
    text = jax.jit(lambda x: fp8_matmul(x, wq, ws, widen=False)).lower(x).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and dots[0].count("f8E4M3FN") == 2  # the dot itself is fp8 x fp8
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul(x, wq.astype(jnp.bfloat16), ws)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        fp8_matmul(x, wq.T, ws)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_matmul(x, wq, jnp.ones((3,)))
    with pytest.raises(ValueError, match="act_scale"):
        fp8_matmul(x, wq, ws, act_scale="row")


@pytest.mark.parametrize("rows", [1, 2, 3, 65])
def test_fp8_matmul_widens_small_batches_to_the_same_function(rows):
    """Up to FP8_WIDEN_MAX_ROWS rows the fp8 operands are widened to bfloat16 for the dot (a faster GEMV on the
    GPU); every e4m3 value is a bfloat16 and their products are exact in float32, so both dots are one function."""
    rng = np.random.default_rng(12)
    wq, ws = quantize_fp8(rng.standard_normal((48, 256)) * 0.05)
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    text = jax.jit(lambda x: fp8_matmul(x, wq, ws)).lower(x).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    widened = rows <= quant.FP8_WIDEN_MAX_ROWS
    operands, out = dots[0].split("->")
    assert len(dots) == 1 and operands.count("f8E4M3FN") == (0 if widened else 2) and ("bf16" in operands) == widened
    # the fp8 x fp8 dot returns bfloat16 for a 16-bit result (FP8_DOT_BF16); the widened dot float32
    assert ("bf16" in out) == (not widened)
    # the widened x passes a barrier, or XLA's GPU GEMM rewriter turns the widened dot back into the fp8 GEMM
    assert ("optimization_barrier" in text) == widened
    f32 = dict(out_dtype=jnp.float32)
    wide, narrow = (np.asarray(fp8_matmul(x, wq, ws, widen=w, **f32)) for w in (True, False))
    np.testing.assert_allclose(wide, narrow, rtol=1e-5, atol=1e-6 * np.abs(narrow).max())
    assert rel(wide, fp8_matmul_ref(x, wq, ws, **f32)) < 1e-6


@pytest.mark.parametrize(
    "T,F,scaled,tuning",
    [
        (3, 384, False, {}),  # 3 tiles of 128, looped twice (amax, then the e4m3 stores)
        (5, 640, True, dict(resident=True)),  # 5 tiles held in registers
        (4, 1024, True, dict(block=256, num_warps=8)),
        (2, 4096, True, dict(resident=True, num_warps=16)),
    ],
)
def test_silu_mul_fp8_kernel_matches_reference(T, F, scaled, tuning):
    """_silu_mul_fp8's Pallas pass (interpret mode) against silu_mul_fp8_ref: the same e4m3 values and token scales
    bit for bit (both compute in float32 in the same order), with and without the GEMM's token / channel scales;
    an all-zero row gets the floor scale and zeros."""
    from kernels_pallas import _silu_mul_fp8

    rng = np.random.default_rng(13)
    gu = jnp.asarray(rng.standard_normal((T, 2, F)) * 4, jnp.bfloat16).at[0].set(0.0)
    scales = ()
    if scaled:
        scales = (
            jnp.asarray(rng.uniform(0.2, 2.0, (T, 1)), jnp.float32),
            jnp.asarray(rng.uniform(0.2, 2.0, (2, F)), jnp.float32),
        )
    xq, sx = _silu_mul_fp8.silu_mul_fp8_kernel(gu, *scales, min_scale=quant.FP8_MIN_SCALE, interpret=True, **tuning)
    want_q, want_s = quant.silu_mul_fp8_ref(gu, *scales)
    assert xq.dtype == jnp.float8_e4m3fn and xq.shape == (T, F) and sx.shape == (T, 1)
    np.testing.assert_array_equal(np.asarray(sx), np.asarray(want_s))
    np.testing.assert_array_equal(np.asarray(xq, np.float32), np.asarray(want_q, np.float32))
    assert float(sx[0, 0]) == np.float32(quant.FP8_MIN_SCALE) and not np.asarray(xq[0], np.float32).any()
    assert float(jnp.abs(xq.astype(jnp.float32)).max()) == quant.FP8_MAX  # each row's amax maps to 448


def test_silu_mul_fp8_refuses_what_it_does_not_take():
    from kernels_pallas import _silu_mul_fp8

    kw = dict(min_scale=quant.FP8_MIN_SCALE, interpret=True)
    with pytest.raises(ValueError, match=r"\[T, 2, F\]"):
        _silu_mul_fp8.silu_mul_fp8_kernel(jnp.zeros((2, 3, 256), jnp.bfloat16), **kw)
    with pytest.raises(ValueError, match="multiple of 128"):
        _silu_mul_fp8.silu_mul_fp8_kernel(jnp.zeros((2, 2, 200), jnp.bfloat16), **kw)
    with pytest.raises(ValueError, match="come together"):
        _silu_mul_fp8.silu_mul_fp8_kernel(jnp.zeros((2, 2, 256), jnp.bfloat16), jnp.ones((2, 1)), **kw)
    # quant.silu_mul_fp8 takes what the kernel refuses through the reference (F = 200, float32)
    for gu in (jnp.ones((2, 2, 200), jnp.bfloat16), jnp.ones((2, 2, 256), jnp.float32)):
        assert not quant.silu_mul_fp8_supported(gu)
        np.testing.assert_array_equal(
            np.asarray(quant.silu_mul_fp8(gu, interpret=True)[0], np.float32),
            np.asarray(quant.silu_mul_fp8_ref(gu)[0], np.float32),
        )


@pytest.mark.parametrize(
    "T,D,dtype,w_dtype,plus_one,tuning",
    [
        (3, 512, jnp.bfloat16, jnp.bfloat16, False, {}),  # one tile
        (5, 640, jnp.bfloat16, jnp.bfloat16, False, dict(num_warps=4)),  # 5 tiles of 128
        (4, 1024, jnp.float16, jnp.float32, False, dict(block=256)),  # a float32 weight: h in float32
        (2, 768, jnp.bfloat16, jnp.float32, True, {}),  # Gemma's 1 + w
    ],
)
def test_rms_norm_fp8_kernel_matches_reference(T, D, dtype, w_dtype, plus_one, tuning):
    """_rms_norm_fp8's Pallas pass (interpret mode) against rms_norm_fp8_ref (the decoder's norm, then
    quantize_activations, op by op): the same token scales and e4m3 values to the norm's 16-bit rounding, which XLA's
    CPU compiler may leave out of the jitted interpreter (xla_allow_excess_precision; the Triton lowering rounds): a
    scale within 2^-7, a value within one e4m3 step where that moves it across a rounding boundary; an all-zero row
    gets the floor scale and zeros."""
    from kernels_pallas import _rms_norm_fp8

    rng = np.random.default_rng(15)
    x = jnp.asarray(rng.standard_normal((T, D)) * 3, dtype).at[0].set(0.0)
    w = jnp.asarray(rng.uniform(-1.5, 1.5, D), w_dtype)
    xq, sx = _rms_norm_fp8.rms_norm_fp8_kernel(
        x, w, eps=1e-6, min_scale=quant.FP8_MIN_SCALE, plus_one=plus_one, interpret=True, **tuning
    )
    want_q, want_s = quant.rms_norm_fp8_ref(x, w, 1e-6, plus_one=plus_one)
    assert xq.dtype == jnp.float8_e4m3fn and xq.shape == (T, D) and sx.shape == (T, 1)
    np.testing.assert_allclose(np.asarray(sx), np.asarray(want_s), rtol=2**-7)
    got, want = np.asarray(xq, np.float32), np.asarray(want_q, np.float32)
    assert (got != want).mean() < 0.05 and np.all(np.abs(got - want) <= np.abs(want) / 8 + 2**-9)
    assert float(sx[0, 0]) == np.float32(quant.FP8_MIN_SCALE) and not got[0].any()
    assert np.abs(got[1:]).max(-1).min() == quant.FP8_MAX  # each row's amax maps to 448


def test_rms_norm_fp8_refuses_what_it_does_not_take():
    from kernels_pallas import _rms_norm_fp8

    kw = dict(eps=1e-6, min_scale=quant.FP8_MIN_SCALE, interpret=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        _rms_norm_fp8.rms_norm_fp8_kernel(jnp.zeros((2, 200), jnp.bfloat16), jnp.ones(200), **kw)
    with pytest.raises(ValueError, match="weight"):
        _rms_norm_fp8.rms_norm_fp8_kernel(jnp.zeros((2, 256), jnp.bfloat16), jnp.ones(128), **kw)
    # quant.rms_norm_fp8 takes what the kernel refuses through the reference (D = 200; float32 x)
    for x in (jnp.ones((2, 200), jnp.bfloat16), jnp.ones((2, 256), jnp.float32)):
        assert not quant.rms_norm_fp8_supported(x)
        w = jnp.full(x.shape[1], 0.5, jnp.bfloat16)
        np.testing.assert_array_equal(
            np.asarray(quant.rms_norm_fp8(x, w, 1e-6, interpret=True)[0], np.float32),
            np.asarray(quant.rms_norm_fp8_ref(x, w, 1e-6)[0], np.float32),
        )


@pytest.mark.parametrize(
    "S,T,D,dtype,w_dtype,plus_one,tuning",
    [
        (8, 1, 4096, jnp.bfloat16, jnp.bfloat16, False, {}),  # the 8B shape's o at batch 1 (8 partials)
        (7, 2, 4096, jnp.bfloat16, jnp.bfloat16, False, dict(num_warps=8)),  # down's 7 partials, 2 rows
        (1, 3, 640, jnp.float16, jnp.float32, False, dict(block=128)),  # one partial; a float32 weight: h in float32
        (4, 2, 768, jnp.bfloat16, jnp.float32, True, {}),  # Gemma's 1 + w
    ],
)
def test_add_rms_norm_kernel_matches_reference(S, T, D, dtype, w_dtype, plus_one, tuning):
    """_add_rms_norm's Pallas pass (interpret mode) against add_rms_norm_ref (the partials' sum rounded to x's dtype,
    the residual add, the decoder's norm): the new residual stream and the norm's output to the 16-bit rounding, which
    XLA's CPU compiler may leave out of the jitted interpreter (xla_allow_excess_precision; the Triton lowering
    rounds): equal but for a few values one 16-bit step apart."""
    from kernels_pallas import _add_rms_norm

    rng = np.random.default_rng(17)
    x = jnp.asarray(rng.standard_normal((T, D)) * 2, dtype)
    parts = jnp.asarray(rng.standard_normal((S, T, D)), jnp.float32)
    w = jnp.asarray(rng.uniform(-1.5, 1.5, D), w_dtype)
    r, h = _add_rms_norm.add_rms_norm_kernel(x, parts, w, eps=1e-6, plus_one=plus_one, interpret=True, **tuning)
    want_r, want_h = quant.add_rms_norm_ref(x, parts, w, 1e-6, plus_one=plus_one)
    assert r.dtype == x.dtype and h.dtype == want_h.dtype and r.shape == h.shape == (T, D)
    for got, want in ((r, want_r), (h, want_h)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert (got != want).mean() < 0.02
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)
    # min_scale: the same pass writes h in e4m3 with its token scales, quantize_activations' values of the
    # reference's h (to h's 16-bit rounding, as test_rms_norm_fp8_kernel_matches_reference holds rms_norm_fp8)
    r8, hq, sh = _add_rms_norm.add_rms_norm_kernel(
        x, parts, w, eps=1e-6, plus_one=plus_one, min_scale=quant.FP8_MIN_SCALE, interpret=True, **tuning
    )
    want_q, want_s = quant.quantize_activations(want_h)
    assert hq.dtype == jnp.float8_e4m3fn and hq.shape == (T, D) and sh.shape == (T, 1)
    np.testing.assert_array_equal(np.asarray(r8, np.float32), np.asarray(r, np.float32))
    np.testing.assert_allclose(np.asarray(sh), np.asarray(want_s), rtol=2**-7)
    got, want = np.asarray(hq, np.float32), np.asarray(want_q, np.float32)
    assert (got != want).mean() < 0.05 and np.all(np.abs(got - want) <= np.abs(want) / 8 + 2**-9)
    assert np.abs(got).max(-1).min() == quant.FP8_MAX  # each row's amax maps to 448
    rows = quant.add_rms_norm(x, parts, w, 1e-6, plus_one=plus_one, fp8=True, interpret=True, **tuning)[1]
    assert isinstance(rows, quant.Fp8Rows) and rows.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(rows.q, np.float32), got)


def test_add_rms_norm_refuses_what_it_does_not_take():
    from kernels_pallas import _add_rms_norm

    kw = dict(eps=1e-6, interpret=True)
    x, parts, w = jnp.zeros((2, 256), jnp.bfloat16), jnp.zeros((3, 2, 256)), jnp.ones(256)
    with pytest.raises(ValueError, match="multiple of 128"):
        _add_rms_norm.add_rms_norm_kernel(
            jnp.zeros((2, 200), jnp.bfloat16), jnp.zeros((3, 2, 200)), jnp.ones(200), **kw
        )
    with pytest.raises(ValueError, match="parts"):
        _add_rms_norm.add_rms_norm_kernel(x, jnp.zeros((3, 1, 256)), w, **kw)
    with pytest.raises(ValueError, match="weight"):
        _add_rms_norm.add_rms_norm_kernel(x, parts, jnp.ones(128), **kw)
    with pytest.raises(ValueError, match="S <= 32"):
        _add_rms_norm.add_rms_norm_kernel(x, jnp.zeros((33, 2, 256)), w, **kw)
    # quant.add_rms_norm takes what the kernel refuses through the reference (D = 200; float32 x)
    for x, p in ((jnp.ones((2, 200), jnp.bfloat16), jnp.ones((3, 2, 200))), (jnp.ones((2, 256)), parts)):
        assert not quant.add_rms_norm_supported(x, p)
        w = jnp.full(x.shape[1], 0.5, jnp.bfloat16)
        for got, want in zip(
            quant.add_rms_norm(x, p, w, 1e-6, interpret=True),
            quant.add_rms_norm_ref(x, p, w, 1e-6),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("S,min_scale", [(1, None), (7, None), (8, None), (8, 1e-5)])
def test_add_rms_norm_lowers_for_cuda(S, min_scale):
    """The pass lowers to Triton IR for CUDA (on CPU) at the 8B shape's partial counts (o 8, down 7, gate_up 1), and
    with h in e4m3."""
    from kernels_pallas import _add_rms_norm

    args = (
        jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((S, 1, 4096), jnp.float32),
        jax.ShapeDtypeStruct((4096,), jnp.bfloat16),
    )
    f = jax.jit(lambda x, p, w: _add_rms_norm.add_rms_norm_kernel(x, p, w, eps=1e-5, min_scale=min_scale))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    suffix = "" if min_scale is None else "_e4m3"
    assert f"add_rms_norm_S{S}_b2048{suffix}" in text and "__gpu$xla.gpu.triton" in text


def test_fp8_silu_mlp_takes_rows_already_in_e4m3():
    """fp8_silu_mlp of Fp8Rows (rms_norm_fp8's output) equals it of the normed h, which it rounds the same way."""
    rng = np.random.default_rng(16)
    D, F, T = 256, 384, 5
    (wgu, sgu), (wd, sd) = (
        quantize_fp8(rng.standard_normal(s).astype(np.float32) * 0.06) for s in ((2 * F, D), (D, F))
    )
    x, nw = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16), jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.bfloat16)
    rows = quant.Fp8Rows(*quant.rms_norm_fp8_ref(x, nw, 1e-5), jnp.bfloat16)
    x32 = x.astype(jnp.float32)
    h = nw * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(jnp.bfloat16)
    mlp = jax.jit(lambda h: quant.fp8_silu_mlp(h, wgu, sgu, wd, sd, interpret=True))
    np.testing.assert_array_equal(np.asarray(mlp(rows), np.float32), np.asarray(mlp(h), np.float32))


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_silu_mlp_matches_the_unfused_mlp(per_channel):
    """fp8_silu_mlp (h rounded to e4m3, the gate / up GEMM's product in bfloat16 unscaled, the Pallas silu * up +
    e4m3 pass with the scales, the down GEMM) against fp8_matmul -> silu * up in bfloat16 -> fp8_matmul: the same
    function but for where gate / up are rounded (here: never between the GEMM and silu * up) and the e4m3 rounding
    boundaries that moves; and against the float32 MLP of the dequantized weights (e4m3's few percent, as close as
    the unfused MLP is)."""
    rng = np.random.default_rng(14)
    D, F, T = 256, 384, 9
    wgu_f = rng.standard_normal((2 * F, D)).astype(np.float32) * 0.06
    wd_f = rng.standard_normal((D, F)).astype(np.float32) * 0.05
    (wgu, sgu), (wd, sd) = quantize_fp8(wgu_f, per_channel=per_channel), quantize_fp8(wd_f, per_channel=per_channel)
    h = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    got = jax.jit(lambda h: quant.fp8_silu_mlp(h, wgu, sgu, wd, sd, interpret=True))(h)
    assert got.shape == (T, D) and got.dtype == jnp.bfloat16
    gu = fp8_matmul(h, wgu, sgu)
    unfused = fp8_matmul(jax.nn.silu(gu[:, :F]) * gu[:, F:], wd, sd)
    assert rel(got, unfused) < 4e-2  # e4m3 steps are 2^-3 relative: a few rounding boundaries move (1.7-2.5% here)
    g = np.asarray(h, np.float32) @ (np.asarray(wgu.astype(jnp.float32)) * np.reshape(sgu, (-1, 1))).T
    a = g[:, :F] / (1 + np.exp(-g[:, :F])) * g[:, F:]
    dense = a @ (np.asarray(wd.astype(jnp.float32)) * np.reshape(sd, (-1, 1))).T
    assert rel(got, dense) < 0.08 and rel(got, dense) < 1.1 * rel(unfused, dense)  # no further from the function


def test_entry_point_runs_more_than_64_rows_in_128_row_blocks(monkeypatch):
    """Above 64 rows (up to max_kernel_m) the entry point pads M to a multiple of 64 and, where that is a multiple
    of 128, runs the kernel with LARGE_M_TILING's 128-row blocks; above MAX_KERNEL_M (128) rows the dense weight +
    XLA's dot runs instead. Each result matches the reference."""
    from kernels_pallas import _qmatmul, quant

    seen = []
    kernel = _qmatmul.qmatmul_kernel

    def spy(*args, **kw):
        seen.append((args[0].shape[0], kw.get("block_m"), kw.get("block_n")))
        return kernel(*args, **kw)

    monkeypatch.setattr(_qmatmul, "qmatmul_kernel", spy)
    rng = np.random.default_rng(11)
    _, q, s, z, w = packed(rng, 256, 64, 4, 64, False)
    # padded to 128 (one 128-row block); 200 rows: over MAX_KERNEL_M, no kernel; padded to 192 (64-row blocks)
    for m, most in ((100, quant.MAX_KERNEL_M), (200, quant.MAX_KERNEL_M), (150, 256)):
        x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
        got = quant.quantized_matmul(x, w, interpret=True, max_kernel_m=most)
        assert rel(got, quantized_matmul_ref(x, w)) < 1e-2
    assert seen == [(128, 128, 64), (192, None, None)], seen


@pytest.mark.parametrize(
    "rows,N,K,per_channel,residual,tuning",
    [
        (1, 64, 512, True, False, dict(block_n=16, block_k=128)),
        (2, 96, 640, True, True, dict(block_n=32, block_k=128, splits=2)),  # 5 tiles over 2 splits: 3 + 2
        (2, 48, 384, False, True, dict(block_n=16, block_k=128, splits=3)),
        (2, 128, 1024, True, False, {}),  # the default plan
    ],
)
def test_fp8_gemv_is_fp8_matmul_with_the_quantization_in_the_kernel(rows, N, K, per_channel, residual, tuning):
    """fp8_gemv (the token scales and x's e4m3 rounding inside the split-K GEMV kernel, interpret mode) computes
    residual + fp8_matmul's function: the same rounded x and products, float32 sums in another order. Rows with
    very different ranges each get their own scale; one all-zero row stays zero."""
    from kernels_pallas._fp8_gemv import plan

    rng = np.random.default_rng(rows * N + K)
    wq, ws = quantize_fp8(rng.standard_normal((N, K)).astype(np.float32) * 0.05, per_channel=per_channel)
    x = rng.standard_normal((rows, K)).astype(np.float32) * np.array([[30.0], [0.01]])[:rows]
    x = jnp.asarray(x, jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((rows, N)), jnp.bfloat16) if residual else None
    got = quant.fp8_gemv(x, wq, ws, residual=r, interpret=True, **tuning)
    want = quant.fp8_gemv_ref(x, wq, ws, residual=r)
    assert got.shape == (rows, N) and got.dtype == jnp.bfloat16
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    for m in range(rows):  # per row: the rows' magnitudes differ by 3000x
        np.testing.assert_allclose(g[m], w[m], rtol=1e-2, atol=1e-2 * np.abs(w[m]).max())
    parts = quant.fp8_gemv_partials(x, wq, ws, interpret=True, **tuning)
    assert parts.shape == (plan(N, K, **tuning)[2], rows, N) and parts.dtype == jnp.float32
    # x with partial maxima of |x| (RowsWithMax): the same partials bit for bit, the kernel skipping its pass over
    # the row; x already in e4m3 with its token scales (Fp8Rows, here XLA's: their float32 division may round the
    # scale an ulp away from the interpreted kernel's)
    amax = jnp.abs(x.astype(jnp.float32)).reshape(rows, K // 128, 128).max(-1)
    for given in (quant.RowsWithMax(x, amax), quant.Fp8Rows(*quant.quantize_activations(x), x.dtype)):
        assert quant.fp8_gemv_supported(given, wq)
        same = np.asarray(quant.fp8_gemv_partials(given, wq, ws, interpret=True, **tuning))
        if isinstance(given, quant.RowsWithMax):
            np.testing.assert_array_equal(same, np.asarray(parts))
        np.testing.assert_allclose(same, np.asarray(parts), rtol=1e-6, atol=1e-6 * np.abs(np.asarray(parts)).max())
    zero = quant.fp8_gemv(jnp.zeros((rows, K), jnp.bfloat16), wq, ws, interpret=True, **tuning)
    assert not np.asarray(zero, np.float32).any()


def test_fp8_gemv_takes_the_decode_bucket_only():
    rng = np.random.default_rng(13)
    wq, ws = quantize_fp8(rng.standard_normal((48, 256)) * 0.05)
    x = jnp.zeros((2, 256), jnp.bfloat16)
    assert quant.fp8_gemv_supported(x, wq)
    assert not quant.fp8_gemv_supported(jnp.zeros((3, 256), jnp.bfloat16), wq)  # more rows: fp8_matmul's dot
    assert not quant.fp8_gemv_supported(x, wq, x_scale=0.1)  # static activation scales
    assert not quant.fp8_gemv_supported(x.astype(jnp.float32), wq)
    assert not quant.fp8_gemv_supported(jnp.zeros((2, 200), jnp.bfloat16), quantize_fp8(np.ones((48, 200)))[0])
    with pytest.raises(ValueError, match="fp8_gemv does not take"):
        quant.fp8_gemv(jnp.zeros((3, 256), jnp.bfloat16), wq, ws)


@pytest.mark.parametrize(
    "rows,N,K,x_mode",
    [(2, 4096, 14336, "row"), (1, 28672, 4096, "row"), (2, 6144, 4096, "row"), (1, 6144, 4096, "e4m3")]
    + [(2, 4096, 14336, "amax")],
)
def test_fp8_gemv_lowers_for_cuda(rows, N, K, x_mode):
    """The kernel lowers to Triton IR for CUDA on CPU at the 8B shapes with its default plan (what the GPU
    compiles; the H100 runs are in bench/results/quant_kernels_h100_*_fp8_gemv*.json), for each form of x (down's
    maxima: the silu kernel's 896 pieces a row)."""
    from kernels_pallas._fp8_gemv import fp8_gemv_kernel, plan

    x_dtype = jnp.float8_e4m3fn if x_mode == "e4m3" else jnp.bfloat16
    xs = {"row": None, "e4m3": (rows, 1), "amax": (rows, 896)}[x_mode]
    args = (
        jax.ShapeDtypeStruct((rows, K), x_dtype),
        jax.ShapeDtypeStruct((N, K), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((N,), jnp.float32),
        None if xs is None else jax.ShapeDtypeStruct(xs, jnp.float32),
    )
    f = jax.jit(lambda x, w, s, xs: fp8_gemv_kernel(x, w, s, xs, min_scale=quant.FP8_MIN_SCALE, x_mode=x_mode))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    bn, bk, splits, _ = plan(N, K)
    suffix = "" if x_mode == "row" else f"_{x_mode}"
    assert f"fp8_gemv_BN_{bn}_BK_{bk}_S_{splits}{suffix}" in text


@pytest.mark.parametrize(
    "rows,F,K,per_channel,x_mode,tuning",
    [
        (1, 128, 512, True, "row", {}),
        (2, 384, 384, False, "row", dict(block_k=128)),  # per tensor, 3 K tiles; 24 maxima a row
        (2, 128, 256, True, "e4m3", dict(block_n=32)),
        (2, 256, 1024, True, "row", dict(block_n=32, block_k=256)),
    ],
)
def test_fp8_gemv_silu_is_the_gemv_then_silu_times_up(rows, F, K, per_channel, x_mode, tuning):
    """fp8_gemv_silu (interpret mode): gate's and up's columns of one program from the one [2F, K] weight, each
    rounded to x's dtype as fp8_gemv rounds its output (bit for bit: the same e4m3 x, products and float32 sums of
    one split), then silu(gate) rounded, times up rounded (fp8_gemv_silu_ref's HF ops, to a 16-bit step); its maxima
    of |a| are each program's columns', and down's fp8_gemv given them equals it given a itself."""
    from kernels_pallas._fp8_gemv import silu_plan

    rng = np.random.default_rng(rows * F + K)
    wq, ws = quantize_fp8(rng.standard_normal((2 * F, K)).astype(np.float32) * 0.05, per_channel=per_channel)
    x = jnp.asarray(rng.standard_normal((rows, K)) * np.array([[30.0], [0.01]])[:rows], jnp.bfloat16)
    h = quant.Fp8Rows(*quant.quantize_activations(x), x.dtype) if x_mode == "e4m3" else x
    out = quant.fp8_gemv_silu(h, wq, ws, interpret=True, **tuning)
    bn = silu_plan(F, K, **{k: v for k, v in tuning.items() if k in ("block_n", "block_k")})[0]
    assert isinstance(out, quant.RowsWithMax) and out.x.shape == (rows, F) and out.x.dtype == jnp.bfloat16
    assert out.amax.shape == (rows, F // bn)
    a = np.asarray(out.x, np.float32)
    np.testing.assert_array_equal(np.asarray(out.amax), np.abs(a).reshape(rows, F // bn, bn).max(-1))
    gu = np.asarray(quant.fp8_gemv(x, wq, ws, interpret=True), np.float32)
    g = gu[:, :F].astype(np.float64)
    silu = np.asarray(jnp.asarray(g * np.exp(-np.logaddexp(0, -g)), jnp.bfloat16), np.float32)  # g * sigmoid(g)
    want = np.asarray(jnp.asarray(silu * gu[:, F:], jnp.bfloat16), np.float32)
    assert (a != want).mean() < 0.05  # the kernel's float32 sigmoid against numpy's: a 16-bit step at most
    np.testing.assert_allclose(a, want, rtol=2**-7, atol=1e-30)
    ref = quant.fp8_gemv_silu_ref(h, wq, ws)
    np.testing.assert_allclose(a, np.asarray(ref.x, np.float32), rtol=2**-7, atol=1e-30)
    w_down, s_down = quantize_fp8(rng.standard_normal((48, F)).astype(np.float32) * 0.05)
    np.testing.assert_array_equal(
        np.asarray(quant.fp8_gemv_partials(out, w_down, s_down, interpret=True)),
        np.asarray(quant.fp8_gemv_partials(out.x, w_down, s_down, interpret=True)),
    )


@pytest.mark.parametrize("rows,per_channel,x_mode,block_n", [(1, True, "row", 16), (2, False, "e4m3", 32)])
def test_fp8_gemv_silu_on_the_interleaved_weight_is_the_split_form(rows, per_channel, x_mode, block_n):
    """fp8_gemv_silu_kernel(layout="interleaved") on interleave_gate_up's weight and scales (one [2 block_n, K] block
    and one MMA a K step), and layout="paired" on the weight as it is (gate's and up's rows as one [2, block_n, BK]
    tile), give the split form's a and maxima bit for bit: the same products summed in the same order."""
    from kernels_pallas._fp8_gemv import fp8_gemv_silu_kernel, interleave_gate_up

    F, K = 128, 512
    rng = np.random.default_rng(rows + block_n)
    wq, ws = quantize_fp8(rng.standard_normal((2 * F, K)).astype(np.float32) * 0.05, per_channel=per_channel)
    x = jnp.asarray(rng.standard_normal((rows, K)) * np.array([[30.0], [0.01]])[:rows], jnp.bfloat16)
    if x_mode == "e4m3":
        q, xs = quant.quantize_activations(x)
        args = (q, xs)
    else:
        args = (x, None)
    kw = dict(min_scale=quant.FP8_MIN_SCALE, x_mode=x_mode, out_dtype=jnp.bfloat16, block_n=block_n, interpret=True)
    want = fp8_gemv_silu_kernel(args[0], wq, ws, args[1], block_k=256, **kw)
    wi, si = interleave_gate_up(wq, ws, block_n)
    assert wi.shape == wq.shape and si.shape == jnp.asarray(ws).shape
    np.testing.assert_array_equal(
        np.asarray(wi[block_n : 2 * block_n], np.float32), np.asarray(wq[F : F + block_n], np.float32)
    )
    got = fp8_gemv_silu_kernel(args[0], wi, si, args[1], layout="interleaved", **kw)
    paired = fp8_gemv_silu_kernel(args[0], wq, ws, args[1], layout="paired", **kw)  # the weight as it is
    for g, p, w in zip(got, paired, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(w, np.float32))
    with pytest.raises(ValueError, match="multiple of block_n"):
        interleave_gate_up(wq, ws, 48)


def test_fp8_gemv_silu_refuses_what_it_does_not_take():
    from kernels_pallas._fp8_gemv import fp8_gemv_silu_kernel

    wq, ws = quantize_fp8(np.ones((64, 256)) * 0.05)
    x = jnp.zeros((2, 256), jnp.bfloat16)
    assert quant.fp8_gemv_silu_supported(x, wq)
    assert not quant.fp8_gemv_silu_supported(jnp.zeros((3, 256), jnp.bfloat16), wq)  # more rows than the GEMV's
    assert not quant.fp8_gemv_silu_supported(quant.RowsWithMax(x, jnp.zeros((2, 1))), wq)
    assert not quant.fp8_gemv_silu_supported(x, quantize_fp8(np.ones((48, 256)))[0])  # F = 24: not whole programs
    with pytest.raises(ValueError, match="fp8_gemv_silu does not take"):
        quant.fp8_gemv_silu(jnp.zeros((3, 256), jnp.bfloat16), wq, ws)
    kw = dict(min_scale=quant.FP8_MIN_SCALE, interpret=True)
    with pytest.raises(ValueError, match="out_dtype=None"):
        fp8_gemv_silu_kernel(x.astype(jnp.float8_e4m3fn), wq, ws, jnp.ones((2, 1)), x_mode="e4m3", **kw)
    with pytest.raises(ValueError, match="x_mode"):
        fp8_gemv_silu_kernel(x, wq, ws, x_mode="e4m3", **kw)  # 16-bit x, no scales
    with pytest.raises(ValueError, match="X_MODES|x_mode must"):
        fp8_gemv_silu_kernel(x, wq, ws, jnp.ones((2, 1)), x_mode="scaled", **kw)


@pytest.mark.parametrize("rows,x_mode,layout", [(1, "row", "paired"), (2, "e4m3", "paired"), (2, "e4m3", "split")])
def test_fp8_gemv_silu_lowers_for_cuda(rows, x_mode, layout):
    """The silu kernel lowers to Triton IR for CUDA on CPU at the 8B gate / up shape (F 14336: 896 programs of
    16 + 16 columns; K tiles of 256 in the paired layout, its default, 128 in the split one)."""
    from kernels_pallas._fp8_gemv import fp8_gemv_silu_kernel

    e4m3 = x_mode == "e4m3"
    args = (
        jax.ShapeDtypeStruct((rows, 4096), jnp.float8_e4m3fn if e4m3 else jnp.bfloat16),
        jax.ShapeDtypeStruct((28672, 4096), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((28672,), jnp.float32),
        jax.ShapeDtypeStruct((rows, 1), jnp.float32) if e4m3 else None,
    )
    f = jax.jit(
        lambda x, w, s, xs: fp8_gemv_silu_kernel(
            x, w, s, xs, min_scale=quant.FP8_MIN_SCALE, x_mode=x_mode, out_dtype=jnp.bfloat16, layout=layout
        )
    )
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    name = "fp8_gemv_silu_BN_16_BK_256_pair" if layout == "paired" else "fp8_gemv_silu_BN_16_BK_128"
    assert name in text and "__gpu$xla.gpu.triton" in text


def test_quantized_matmul_partials():
    """partials=True returns the kernel's float32 split-K partials unsummed ([S, ..., N]; S = 1 as one partial where
    the plan does not split K): their sum rounded to x's dtype is the summed call's output; the dequantize path has
    no partials (ValueError)."""
    rng = np.random.default_rng(12)
    _, q, s, z, w = packed(rng, 2048, 64, 4, 128, False)
    x = jnp.asarray(rng.standard_normal((1, 2048)), jnp.bfloat16)
    for splits, S in ((4, 2), (1, 1)):  # 2 tiles of 1024 rows: at most 2 splits
        parts = quantized_matmul(x, w, backend="kernel", interpret=True, partials=True, splits=splits)
        assert parts.shape == (S, 1, 64) and parts.dtype == jnp.float32
        whole = quantized_matmul(x, w, backend="kernel", interpret=True, splits=splits)
        assert (np.asarray(parts.sum(0).astype(jnp.bfloat16), np.float32) == np.asarray(whole, np.float32)).all()
    x2 = jnp.asarray(rng.standard_normal((2, 3, 2048)), jnp.bfloat16)  # leading axes and 6 rows padded to 8
    parts = quantized_matmul(x2, w, backend="kernel", interpret=True, partials=True)
    assert parts.shape[1:] == (2, 3, 64)
    assert rel(parts.sum(0), quantized_matmul(x2, w, backend="kernel", interpret=True)) < 1e-2
    with pytest.raises(ValueError, match="partials"):
        quantized_matmul(x, w, backend="dequant", partials=True)


@pytest.mark.parametrize(
    "K,N,bits,G,sym,dtype",
    [
        (2048, 128, 4, 128, True, jnp.bfloat16),  # the 8B shapes' layout: a plane per group
        (512, 64, 4, 32, False, jnp.float16),  # 32-row planes
        (960, 64, 4, 64, False, jnp.float32),  # K padded to a whole tile (1024 rows)
        (2048, 64, 4, 256, True, jnp.bfloat16),  # two planes a group
        (3072, 64, 4, -1, False, jnp.bfloat16),  # per channel, asymmetric
        (1024, 128, 8, -1, True, jnp.bfloat16),
        (512, 64, 8, 128, False, jnp.bfloat16),
    ],
)
def test_unpack_kernel_writes_the_dequantized_weight(K, N, bits, G, sym, dtype):
    """_qunpack's kernel (interpret mode) writes qlayout.dequantize's values bit for bit, zeros in the padded rows."""
    from kernels_pallas import _qunpack

    _, _, _, _, w = packed(np.random.default_rng(K + N + bits), K, N, bits, G, sym, dtype)
    assert _qunpack.supported(w.n, w.group_size, w.plane, w.kp, w.bits)
    got = _qunpack.unpack_kernel(
        w.qweight, w.scales, w.zeros, bits=bits, group_size=G, plane=w.plane, dtype=jnp.dtype(dtype), interpret=True
    )
    assert got.shape == (w.kp, N) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got[:K], np.float32), np.asarray(dequantize(w, dtype), np.float32))
    assert not np.any(np.asarray(got[K:], np.float32))
    assert not _qunpack.supported(96, w.group_size, w.plane, w.kp, w.bits)  # N not a multiple of BLOCK_N


def test_entry_point_dequantizes_large_batches_with_the_unpack_kernel(monkeypatch):
    """quantized_matmul above max_kernel_m rows: the weight through _qunpack's kernel (act-order and a padded K
    included), then XLA's dot; UNPACK_KERNEL False takes XLA's fusion of qlayout.dequantize. Both give the reference."""
    from kernels_pallas import _qunpack, quant

    rng = np.random.default_rng(3)
    K, N, G = 960, 64, 64
    wf = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    q, s, z = quantize_weight(wf, bits=4, group_size=G, sym=False)
    g_idx = rng.permutation(np.arange(K) // G)
    w = pack_quantized(q, s, z, bits=4, group_size=G, g_idx=g_idx, dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((300, K)), jnp.bfloat16)
    calls = []
    real = _qunpack.unpack_kernel
    monkeypatch.setattr(_qunpack, "unpack_kernel", lambda *a, **k: calls.append(k["plane"]) or real(*a, **k))
    ref = quantized_matmul_ref(x, w)
    assert rel(quantized_matmul(x, w, interpret=True), ref) < 1e-2 and calls == [w.plane]
    monkeypatch.setattr(quant, "UNPACK_KERNEL", False)
    assert rel(quantized_matmul(x, w, interpret=True), ref) < 1e-2 and len(calls) == 1
    assert rel(quantized_matmul(x, w), ref) < 1e-2 and len(calls) == 1  # CPU without interpret: XLA's fusion


def test_unpack_kernel_lowers_for_cuda():
    from kernels_pallas._qunpack import unpack_kernel

    args = (
        jax.ShapeDtypeStruct((512, 28672), jnp.int32),
        jax.ShapeDtypeStruct((32, 28672), jnp.bfloat16),
        jax.ShapeDtypeStruct((32, 28672), jnp.bfloat16),
    )
    f = jax.jit(
        lambda qw, s, z: unpack_kernel(qw, s, z, bits=4, group_size=128, plane=128, dtype=jnp.dtype(jnp.bfloat16))
    )
    assert "qunpack_int4_L128" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
