"""Quantized weights in the model's device layout (jaxllm/models/quant.py) and the decoder's quantized projections
through the GPU kernels (kernels_pallas.quantized_matmul in interpret mode, fp8_matmul) against the CPU reference
and against the dense model on the dequantized weights, at tp 1 and 2 (shard_map over 2 simulated devices)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.quant import QuantLayout, QuantScheme, Relayout, pack_int
from jaxllm.models.quant_matmul import qmatmul
from kernels_pallas import _fp8_gemv, _qmatmul, qlayout

SEQS = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89], [11, 7], [8] * 9]


def _relayout(field, bits, G, I, O, shards, act_order=False, dtype="float32"):
    k = I // shards
    group = -1 if G == -1 else np.gcd(G, k)
    plane = qlayout.choose_plane(k, bits, group) or qlayout.PLANES[-1]
    lay = QuantLayout("ffn", ("embed",), k, shards, plane, group)
    return Relayout(field, QuantScheme("int", bits, G, None), lay, (), (), dtype)


@pytest.mark.parametrize("I,G,shards", [(192, 32, 2), (1024, 128, 1), (96, 32, 2)])
def test_device_layout_is_one_plane_layout_per_row_shard(I, G, shards):
    """Each tp shard's rows of the device layout are qlayout.pack_quantized of that shard's integers (numpy on the
    host and jax on the devices alike); shards holding parts of groups (96 rows in groups of 32 over 2 shards,
    allowed for act-order) get groups of gcd(32, 48) = 16 with their checkpoint group's scale."""
    rng = np.random.default_rng(I)
    O, bits = 48, 4
    q = rng.integers(0, 16, (I, O))
    s = rng.uniform(0.5, 1.5, (I // G, O)).astype(np.float32)
    z = rng.integers(0, 16, (I // G, O)).astype(np.float32)
    words = pack_int(q, bits)
    got = {f: _relayout(f, bits, G, I, O, shards)(x) for f, x in (("packed", words), ("scales", s), ("zeros", z))}
    on_device = {
        f: _relayout(f, bits, G, I, O, shards)(jnp.asarray(x))
        for f, x in (("packed", words), ("scales", s), ("zeros", z))
    }
    k, lay = I // shards, _relayout("packed", bits, G, I, O, shards).layout
    dense = (q - np.repeat(z, G, 0)) * np.repeat(s, G, 0)
    rows = {f: got[f].shape[0] // shards for f in got}
    for i in range(shards):
        part = {f: got[f][i * rows[f] : (i + 1) * rows[f]] for f in got}
        w = qlayout.QuantizedWeight(
            jnp.asarray(part["packed"]),
            jnp.asarray(part["scales"]),
            jnp.asarray(part["zeros"]),
            None,
            bits=bits,
            group_size=lay.group_size,
            k=k,
            plane=lay.plane,
        )
        assert (qlayout.unpack_quantized(w) == q[i * k : (i + 1) * k]).all()
        np.testing.assert_allclose(
            np.asarray(qlayout.dequantize(w, jnp.float32)), dense[i * k : (i + 1) * k], rtol=1e-6
        )
        if lay.group_size == G:
            want = qlayout.pack_quantized(
                q[i * k : (i + 1) * k],
                s[i * k // G : (i + 1) * k // G],
                z[i * k // G : (i + 1) * k // G],
                bits=bits,
                group_size=G,
                plane=lay.plane,
            )
            np.testing.assert_array_equal(part["packed"], np.asarray(want.qweight))
            np.testing.assert_array_equal(part["scales"], np.asarray(want.scales))
    assert (lay.group_size == 16) == (I == 96)
    for f in got:
        np.testing.assert_array_equal(got[f], np.asarray(on_device[f]))


# --- the model -----------------------------------------------------------------------------------------------------
def _quantize_linear(w: np.ndarray, G: int, g_idx: np.ndarray):
    """A torch Linear weight [O, I] -> GPTQ v1 tensors (asymmetric int4, row i in group g_idx[i]) and the dense
    weight they stand for."""
    O, I = w.shape
    wt = w.T.astype(np.float32)  # [I, O]
    lo = np.stack([wt[g_idx == g].min(0) for g in range(I // G)])
    hi = np.stack([wt[g_idx == g].max(0) for g in range(I // G)])
    scale = np.maximum((hi - lo) / 15, 1e-6).astype(np.float16).astype(np.float32)
    zero = np.clip(np.rint(-lo / scale), 1, 15)  # v1 stores zero - 1: keep it >= 0
    q = np.clip(np.rint(wt / scale[g_idx]) + zero[g_idx], 0, 15).astype(np.int64)
    dense = ((q - zero[g_idx]) * scale[g_idx]).T
    tensors = {
        "qweight": pack_int(q, 4),
        "qzeros": pack_int((zero - 1).T.astype(np.int64), 4).T.copy(),
        "scales": scale.astype(np.float16),
        "g_idx": g_idx.astype(np.int32),
    }
    return tensors, dense


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A small Llama (bf16) as GPTQ v1 int4 act-order asym (groups of 32) and as the dense model of its dequantized
    weights. Every projection has >= 512 input rows (N * H = F = 512), so a tp = 2 shard of wo / w_down still holds
    a whole kernel tile (256 rows); smaller shards take the dequantize path (quant.py)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=96,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=128,
    )
    root = tmp_path_factory.mktemp("quant_model")
    dense_dir, gptq_dir = root / "dense", root / "gptq"
    model = LlamaForCausalLM(hf).to(torch.bfloat16)
    rng = np.random.default_rng(0)
    quant, dense, orders = {}, {}, {}
    for name, w in model.state_dict().items():
        if name.endswith("_proj.weight") and ".layers." in name:
            # act-order: one random order per input (q / k / v share theirs, gate / up theirs), as GPTQ's are
            layer, proj = name.rsplit(".", 3)[0], name.split(".")[-2]
            shared = (layer, {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj))
            g_idx = orders.setdefault(shared, rng.permutation(np.arange(w.shape[1]) // 32))
            tensors, d = _quantize_linear(w.float().numpy(), 32, g_idx)
            dense[name] = torch.from_numpy(np.ascontiguousarray(d)).to(torch.bfloat16)
            quant.update(
                {name[: -len("weight")] + k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
            )
        else:
            quant[name] = dense[name] = w.contiguous()
    for folder, tensors in ((dense_dir, dense), (gptq_dir, quant)):
        model.save_pretrained(folder)
        save_file(tensors, str(folder / "model.safetensors"))
    cfg = json.loads((gptq_dir / "config.json").read_text())
    cfg["quantization_config"] = dict(
        quant_method="gptq", bits=4, group_size=32, desc_act=True, sym=False, checkpoint_format="gptq"
    )
    (gptq_dir / "config.json").write_text(json.dumps(cfg))
    return str(dense_dir), str(gptq_dir)


def _load(path, tp, **kw):
    from jaxllm.config import ModelConfig
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import ParallelConfig

    cfg = ModelConfig.from_hf(path, dtype="bfloat16", **kw)
    mesh = ParallelConfig(tp, 1).make_mesh()
    return cfg, mesh, load_params(path, cfg, mesh)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_decoder_runs_quantized_projections_through_the_kernel(checkpoints, monkeypatch):
    """The decoder on the "pallas" backend (interpret mode): each of the 4 quantized projections runs the Pallas
    GEMM, and the logits equal the reference path's to bf16 rounding (the reference path against the dense
    weights: the tp = 2 test below, and tests/test_quant.py against HF). Fails if qmatmul ignores the backend (no
    kernel call) or the kernel reads the layout wrongly."""
    from jaxllm.models.attention import AttentionConfig
    from tests.model_harness import ragged_logits

    _, gptq_dir = checkpoints
    calls = []
    real = _qmatmul.qmatmul_kernel
    monkeypatch.setattr(_qmatmul, "qmatmul_kernel", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    jax.clear_caches()  # the layer is jitted: trace it again with the spy
    cfg, mesh, params = _load(gptq_dir, 1)
    seqs, cached = SEQS, [0] * len(SEQS)  # one step of 27 token rows (22 + 5 padding)

    def logits(params, cfg, backend):
        attn = AttentionConfig(backend=backend, interpret=backend == "pallas", mesh=mesh)
        return [np.asarray(x, np.float32) for x in ragged_logits(params, cfg, seqs, cached, block_size=8, attn=attn)]

    kernel = logits(params, cfg, "pallas")
    assert len(calls) == 4 and all(shape[0] == 32 for shape in calls), calls  # 27 rows padded to the kernel's 32
    calls.clear()
    ref = logits(params, cfg, "reference")
    assert not calls
    for k, r in zip(kernel, ref, strict=True):
        assert _rel(k, r) < 2e-2


def test_decoder_gives_int_qkv_partials_to_the_attention_kernel(checkpoints, monkeypatch):
    """GPTQ on the "pallas" backend (interpret mode), a decode-only step of 1 row (the int models' batch-1 bucket):
    the qkv projection reaches the fused qkv/RoPE/write + decode kernel as the int kernel's float32 split-K
    partials (quant_matmul.split_k), which it sums; the logits equal the reference backend's to bf16 rounding.
    Without kernels (the reference backend) and for more rows split_k gives None."""
    from jaxllm.models import quant_matmul
    from tests.model_harness import one_row_decode_logits, spy_add_rms_norm

    _, gptq_dir = checkpoints
    cfg, mesh, params = _load(gptq_dir, 1)
    norms = spy_add_rms_norm(monkeypatch)
    seen, got, ref = one_row_decode_logits(params, cfg, mesh, monkeypatch)
    # [S, T, K, G + 2, H] partials (S = 1 at these widths), once a layer trace: layer 0's, and the later layers' (they
    # take the previous layer's down partials unsummed)
    assert len(seen) == 2 and all(len(s) == 5 for s in seen), seen
    # o's partials summed with the residual and the MLP norm in one pass (both traces), down's with the next attention
    # norm (the second trace)
    assert norms == [(1, cfg.hidden_size)] * 3, norms
    for k, r in zip(got, ref, strict=True):
        assert _rel(k, r) < 2e-2
    w = params["layers"][0]["w_qkv"]
    h = jnp.asarray(np.random.default_rng(6).standard_normal((1, w.layout.k)), jnp.bfloat16)
    parts = quant_matmul.split_k(h, w, interpret=True)
    whole = qmatmul(h, w, kernels=True, interpret=True)
    assert parts.dtype == jnp.float32 and parts.shape[1:] == whole.shape
    assert _rel(parts.sum(0), whole) < 1e-2
    assert quant_matmul.split_k(jnp.concatenate([h] * 3), w, interpret=True) is None  # 3 rows: a plain projection


def test_decoder_runs_fp8_decode_rows_through_the_gemv_kernel(checkpoints, monkeypatch):
    """quantization="fp8" on the "pallas" backend (interpret mode), a step of 2 token rows (the engine's batch-1
    bucket): each layer's four projections run kernels_pallas' fp8 GEMV kernel (qkv's split-K partials summed by
    the attention kernel, o / down's summed with the residual and the norm after it: quant.add_rms_norm), the step
    before it (7 rows) fp8_matmul's dot.
    With the kernel replaced by the reference product as one partial, the logits equal the reference path's
    exactly (the plumbing: partials, shapes, scales); with the kernel itself they differ by its float32 sums'
    order, which the next projection's e4m3 rounding of x amplifies (2.2-2.4% here; the kernel against the
    reference product: test_quant_kernels.py)."""
    from jaxllm.models import quant_matmul
    from jaxllm.models.attention import AttentionConfig
    from kernels_pallas import quant
    from kernels_pallas.quant import fp8_matmul_ref
    from tests.model_harness import ragged_logits, spy_add_rms_norm

    dense_dir, _ = checkpoints
    cfg, mesh, params = _load(dense_dir, 1, quantization="fp8")
    seqs, cached = [[5, 9, 2, 77, 3], [11, 7, 40]], [4, 2]  # a second step of one new token each
    real = _fp8_gemv.fp8_gemv_kernel
    # the 7-row step's dot with a float32 output and XLA's silu * up, so that its product is the reference's exactly
    # (the bfloat16 dot output and fp8_silu_mlp: test_decoder_runs_fp8_mlp_rows_through_silu_mul_fp8)
    monkeypatch.setattr(quant, "FP8_DOT_BF16", False)
    monkeypatch.setattr(quant_matmul, "FP8_SILU_MLP", False)
    monkeypatch.setattr(quant_matmul, "FP8_NORM", False)  # XLA's norm: the reference's float32 sums' order

    def logits(backend):
        attn = AttentionConfig(backend=backend, interpret=backend == "pallas", mesh=mesh)
        out = ragged_logits(params, cfg, seqs, cached, block_size=4, attn=attn, pad_tokens=0, pad_seqs=0)
        return [np.asarray(x, np.float32) for x in out]

    ref = logits("reference")
    ref_kernel = lambda x, w, s, **k: fp8_matmul_ref(x, w, s, out_dtype=jnp.float32)[None]  # noqa: E731
    # add_norm off first: XLA's residual add and norm, the reference's float32 sums' order; on: o / down's partials
    # summed with the residual and the next norm in one Pallas pass (quant.add_rms_norm), within the kernel's tol
    for kernel, tol, add_norm in ((ref_kernel, 0.0, False), (real, 5e-2, False), (real, 5e-2, True)):
        monkeypatch.setattr(quant_matmul, "ADD_NORM", add_norm)
        calls: list = []
        monkeypatch.setattr(
            _fp8_gemv, "fp8_gemv_kernel", lambda x, *a, f=kernel, c=calls, **k: c.append(x.shape) or f(x, *a, **k)
        )
        norms = spy_add_rms_norm(monkeypatch)
        jax.clear_caches()  # the layer is jitted: trace it again with the spy
        got = logits("pallas")
        # qkv, o, gate_up, down in one layer trace; with add_norm in two (layer 0, and the later layers, which take
        # the previous layer's down partials unsummed: decoder_layer)
        assert calls == [(2, 256), (2, 512), (2, 256), (2, 512)] * (1 + add_norm), calls
        assert norms == [(2, cfg.hidden_size)] * 3 * add_norm, norms
        for k, r in zip(got, ref, strict=True):
            assert _rel(k, r) <= tol


def test_fp8_decode_rows_take_e4m3_norms_and_the_gemv_silu_kernel(checkpoints, monkeypatch):
    """quantization="fp8", "pallas" backend (interpret mode), the 2-row step after a 7-row one, with
    FP8_ADD_NORM_E4M3 and FP8_GEMV_SILU on: the add + norm pass in front of qkv and gate / up writes e4m3 rows with
    their token scales, which qkv's GEMV and gate / up's silu kernel take as they are (x_mode "e4m3"); the silu
    kernel writes silu(gate) * up with its programs' maxima of |a|, from which down's GEMV takes its token scales
    (x_mode "amax"). The logits match the switches-off step's and the reference path's within the e4m3 rounding the
    other fp8 tests allow: the kernels' tests hold the e4m3 x, token scales and products bit for bit, but silu * up is
    rounded as HF's ops round it (silu, then the product), which XLA's CPU fusion does not, and down's e4m3 rounding
    of its input amplifies the difference."""
    from jaxllm.models import quant_matmul
    from jaxllm.models.attention import AttentionConfig
    from kernels_pallas import quant
    from tests.model_harness import ragged_logits

    dense_dir, _ = checkpoints
    cfg, mesh, params = _load(dense_dir, 1, quantization="fp8")
    seqs, cached = [[5, 9, 2, 77, 3], [11, 7, 40]], [4, 2]
    monkeypatch.setattr(quant, "FP8_DOT_BF16", False)
    monkeypatch.setattr(quant_matmul, "FP8_SILU_MLP", False)
    monkeypatch.setattr(quant_matmul, "FP8_NORM", False)
    modes: list = []
    for name in ("fp8_gemv_kernel", "fp8_gemv_silu_kernel"):
        real = getattr(_fp8_gemv, name)
        spy = lambda x, *a, f=real, n=name, **k: modes.append((n[9:-7] or "gemv", k.get("x_mode"))) or f(x, *a, **k)  # noqa: E731
        monkeypatch.setattr(_fp8_gemv, name, spy)

    def logits(backend, fused):
        monkeypatch.setattr(quant_matmul, "FP8_ADD_NORM_E4M3", fused)
        monkeypatch.setattr(quant_matmul, "FP8_GEMV_SILU", fused)
        jax.clear_caches()  # the layer is jitted: trace it again with the switches and the spies
        attn = AttentionConfig(backend=backend, interpret=backend == "pallas", mesh=mesh)
        out = ragged_logits(params, cfg, seqs, cached, block_size=4, attn=attn, pad_tokens=0, pad_seqs=0)
        return [np.asarray(x, np.float32) for x in out]

    ref, off = logits("reference", False), logits("pallas", False)
    modes.clear()
    got = logits("pallas", True)
    # layer 0 (its first norm is XLA's), then the later layers (the previous layer's down partials into the add +
    # norm pass): qkv, o, gate / up + silu, down
    first = [("gemv", "row"), ("gemv", "row"), ("silu", "e4m3"), ("gemv", "amax")]
    assert modes == first + [("gemv", "e4m3"), ("gemv", "row"), ("silu", "e4m3"), ("gemv", "amax")], modes
    for g, o, r in zip(got, off, ref, strict=True):
        assert _rel(g, o) < 4e-2 and _rel(g, r) < 4e-2  # here 2.7% and 2.0%; off from the reference: 2.6%
    # either switch alone: gate / up's GEMV takes the norm's e4m3 rows; the silu kernel takes XLA's 16-bit norm
    for e4m3, silu, want in ((True, False, ("gemv", "e4m3")), (False, True, ("silu", "row"))):
        monkeypatch.setattr(quant_matmul, "FP8_ADD_NORM_E4M3", e4m3)
        monkeypatch.setattr(quant_matmul, "FP8_GEMV_SILU", silu)
        jax.clear_caches()
        modes.clear()
        attn = AttentionConfig(backend="pallas", interpret=True, mesh=mesh)
        out = ragged_logits(params, cfg, seqs, cached, block_size=4, attn=attn, pad_tokens=0, pad_seqs=0)
        assert modes[2] == want, modes
        assert _rel(np.asarray(out[-1], np.float32), off[-1]) < 4e-2


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_mlp_of_more_than_two_rows_runs_silu_mul_fp8(checkpoints, monkeypatch, tp):
    """quantization="fp8" on the "pallas" backend (interpret mode), 7 rows: decoder.mlp runs quant_matmul.silu_mlp
    (kernels_pallas.fp8_silu_mlp: the Pallas silu * up + e4m3 pass between the two fp8 GEMMs; under tp = 2 each
    shard's gate / up and down slices, then psum), and its output matches the unfused MLP (FP8_SILU_MLP off:
    fp8_matmul, silu * up, fp8_matmul) and the reference path within the e4m3 rounding of down's input. 2 rows
    (fp8_gemv's bucket) and the reference backend keep the unfused MLP."""
    from jaxllm.models import decoder, quant_matmul
    from jaxllm.models.attention import AttentionConfig
    from kernels_pallas import _silu_mul_fp8

    dense_dir, _ = checkpoints
    _, mesh, params = _load(dense_dir, tp, quantization="fp8")
    lp = params["layers"][1]
    calls: list = []
    real = _silu_mul_fp8.silu_mul_fp8_kernel
    monkeypatch.setattr(
        _silu_mul_fp8, "silu_mul_fp8_kernel", lambda gu, *a, **k: calls.append(gu.shape) or real(gu, *a, **k)
    )
    jax.clear_caches()  # the spies count traces: none may come from an earlier test's cache
    rng = np.random.default_rng(6)
    D = lp["w_down"].packed.shape[0]

    def run(h, backend, fused):
        monkeypatch.setattr(quant_matmul, "FP8_SILU_MLP", fused)
        attn = AttentionConfig(backend=backend, interpret=backend == "pallas", mesh=mesh)
        mlp = jax.jit(lambda h: decoder.mlp(h, lp["w_gate_up"], lp["w_down"], "silu", attn))
        return np.asarray(mlp(h), np.float32)

    h = jnp.asarray(rng.standard_normal((7, D)), jnp.bfloat16)
    F = lp["w_gate_up"].packed.shape[1]
    got = run(h, "pallas", True)
    assert calls == [(7, 2, F // tp)], calls  # one trace of the (shard_map) body
    unfused, ref = run(h, "pallas", False), run(h, "reference", True)
    assert len(calls) == 1 and got.shape == (7, D)
    assert _rel(got, unfused) < 4e-2 and _rel(got, ref) < 4e-2  # e4m3 boundaries of down's input (2^-3 steps)
    run(h[:2], "pallas", True)
    assert len(calls) == 1


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_norms_of_more_than_two_rows_run_rms_norm_fp8(checkpoints, monkeypatch, tp):
    """quantization="fp8" on the "pallas" backend (interpret mode): a 27-row step (22 tokens + 5 padding) takes each
    layer's two norms (attention, MLP) straight to e4m3 through kernels_pallas' rms_norm_fp8 pass (Fp8Rows into the
    qkv projection and fp8_silu_mlp; under tp = 2 both column-parallel, the rows replicated), and its logits match
    FP8_NORM off (XLA's norm, then the token quantization inside each projection) and the reference backend within
    e4m3 rounding; a step of 2 rows (fp8_gemv's) keeps XLA's norm."""
    from jaxllm.models import quant_matmul
    from jaxllm.models.attention import AttentionConfig
    from kernels_pallas import _rms_norm_fp8
    from tests.model_harness import ragged_logits

    dense_dir, _ = checkpoints
    cfg, mesh, params = _load(dense_dir, tp, quantization="fp8")
    calls: list = []
    real = _rms_norm_fp8.rms_norm_fp8_kernel
    monkeypatch.setattr(
        _rms_norm_fp8, "rms_norm_fp8_kernel", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k)
    )

    def logits(backend, fused, seqs=SEQS, cached=(0, 0, 0), **pad):
        monkeypatch.setattr(quant_matmul, "FP8_NORM", fused)
        jax.clear_caches()  # the layer is jitted: trace it again with the switch and the spy
        attn = AttentionConfig(backend=backend, interpret=backend == "pallas", mesh=mesh)
        out = ragged_logits(params, cfg, seqs, list(cached), block_size=8, attn=attn, **pad)
        return [np.asarray(x, np.float32) for x in out]

    got = logits("pallas", True)
    D = cfg.hidden_size
    assert calls == [(27, D), (27, D)], calls  # one layer trace: the attention norm, the MLP norm
    off, ref = logits("pallas", False), logits("reference", True)
    assert len(calls) == 2
    for g, o, r in zip(got, off, ref, strict=True):
        # e4m3 rounding boundaries that move (FP8_NORM off is 4.6% from the reference here; test_quant_kernels.py
        # holds the pass to the reference's values)
        assert _rel(g, o) < 6e-2 and _rel(g, r) < 6e-2
    calls.clear()
    logits("pallas", True, seqs=[[5, 9, 2, 77, 3], [11, 7, 40]], cached=(4, 2), pad_tokens=0, pad_seqs=0)
    assert calls == [(6, D), (6, D)], calls  # the 6-row first step; the 2-row second one keeps XLA's norm
    if tp == 2:  # a row-parallel weight takes per-shard token scales: one over all of I is refused
        w_down = params["layers"][0]["w_down"]
        F = w_down.packed.shape[-1]  # its input (the global array; each tp shard holds half)
        x = jnp.asarray(np.random.default_rng(2).standard_normal((5, F)), jnp.bfloat16)
        rows = quant_matmul.norm_fp8(x, jnp.ones(F, jnp.bfloat16), 1e-5, interpret=True, mesh=mesh)
        with pytest.raises(ValueError, match="column-parallel"):
            quant_matmul.qmatmul(rows, w_down, kernels=True, interpret=True, mesh=mesh)


@pytest.mark.parametrize("quantization,rows", [(None, 5), (None, 200), ("fp8", 5), ("fp8", 2)])
def test_projections_under_tp2_match_the_dense_weights(checkpoints, monkeypatch, quantization, rows):
    """tp = 2 (shard_map over 2 devices): each projection's kernels path (the Pallas GEMM in interpret mode for
    GPTQ, with wo / w_down row-parallel and their act-order rows taking the gathered x; above MAX_KERNEL_M rows each
    shard's weight written dense by _qunpack's kernel; XLA's fp8 dot for quantization="fp8"; fp8_gemv's kernel for
    2 rows, each shard with its own token scales) against the reference path and against the dense weights."""
    from kernels_pallas import _qunpack

    dense_dir, gptq_dir = checkpoints
    calls = []
    real = _qmatmul.qmatmul_kernel
    monkeypatch.setattr(_qmatmul, "qmatmul_kernel", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    gemv = []
    real_gemv = _fp8_gemv.fp8_gemv_kernel
    monkeypatch.setattr(_fp8_gemv, "fp8_gemv_kernel", lambda x, *a, **k: gemv.append(x.shape) or real_gemv(x, *a, **k))
    unpacked = []
    real_unpack = _qunpack.unpack_kernel
    monkeypatch.setattr(
        _qunpack, "unpack_kernel", lambda q, *a, **k: unpacked.append(q.shape) or real_unpack(q, *a, **k)
    )
    _, _, dense = _load(dense_dir, 1)
    _, mesh, params = _load(gptq_dir if quantization is None else dense_dir, 2, quantization=quantization)
    jax.clear_caches()  # the spies count traces: none may come from an earlier test's cache
    rng = np.random.default_rng(5)
    for key in ("w_qkv", "wo", "w_gate_up", "w_down"):
        w = params["layers"][1][key]
        assert w.layout.shards == (2 if key in ("wo", "w_down") else 1)
        d = dense["layers"][1][key]
        n_in = 2 if key == "wo" else 1
        x = jnp.asarray(rng.standard_normal((rows, int(np.prod(d.shape[:n_in])))), jnp.bfloat16)
        want = np.asarray(x, np.float32) @ np.asarray(d, np.float32).reshape(x.shape[1], -1)
        got = {k: jax.jit(functools.partial(qmatmul, kernels=k, interpret=True, mesh=mesh))(x, w) for k in (0, 1)}
        assert got[1].shape == (rows, *d.shape[n_in:])
        assert _rel(got[1], got[0]) < (2e-2 if quantization else 1e-2), key
        if quantization is None:  # fp8 rounds x too: only the paths are compared
            assert _rel(got[0].reshape(rows, -1), want) < 1e-2 and _rel(got[1].reshape(rows, -1), want) < 1e-2, key
    dequantized = quantization is None and rows > 128
    assert len(calls) == (4 if quantization is None and not dequantized else 0)
    assert len(unpacked) == (4 if dequantized else 0)  # one trace of each projection's shard_map body
    assert len(gemv) == (4 if quantization and rows <= 2 else 0)  # each tp shard's product (its own token scales)


def test_llama3_8b_dummy_gptq_fits_the_kernel_at_every_tp():
    """The benchmarks' dummy GPTQ config (bench/common.py: int4, group 128, sym) on Llama-3-8B's widths: at tp 1 /
    2 / 4 / 8 every quantized weight's shard is whole kernel tiles (no padding) of planes the kernel takes
    (128-row planes at tp 1)."""
    from bench.common import DUMMY_QUANT_CONFIGS, LLAMA3_8B
    from jaxllm.config import ModelConfig
    from jaxllm.models.params import param_specs
    from jaxllm.models.quant import ROW_PARALLEL_AXES, QuantizedWeight

    hf = dict(LLAMA3_8B, num_hidden_layers=1, quantization_config=DUMMY_QUANT_CONFIGS["gptq"])
    cfg = ModelConfig.from_hf(hf, dtype="bfloat16")
    for tp in (1, 2, 4, 8):
        layer = param_specs(cfg, tp)["layers"][0]
        weights = {k: w for k, w in layer.items() if isinstance(w, QuantizedWeight)}
        assert sorted(weights) == ["w_down", "w_gate_up", "w_qkv", "wo"]
        for key, w in weights.items():
            lay = w.layout
            row_parallel = lay.in_axis in ROW_PARALLEL_AXES
            assert lay.shards == (tp if row_parallel else 1) and w.packed.shape[0] == lay.shards * lay.k // 8
            assert qlayout.padded_k(lay.k, 4, lay.plane) == lay.k, (tp, key)
            n_local = int(np.prod(w.packed.shape[1:])) // (1 if row_parallel else tp)
            assert _qmatmul.supported(jnp.bfloat16, n_local, 4, lay.group_size, lay.plane), (tp, key, lay)
            assert lay.plane == 128 or tp > 1


def test_quant_env_switches_parse_when_the_modules_load():
    """The A/B switches read once at import: JAXLLM_INT4_NK (quant.NK_LAYOUT: True / False for "1" / "0", None unset:
    then nk_layout_on() follows the device, off on this CPU),
    JAXLLM_FP8_SILU_MLP (quant_matmul.FP8_SILU_MLP), JAXLLM_FP8_NORM (quant_matmul.FP8_NORM) and JAXLLM_FP8_DOT_BF16
    (kernels_pallas.quant.FP8_DOT_BF16) and JAXLLM_FP8_ADD_NORM_E4M3 (quant_matmul's), on unless "0";
    JAXLLM_FP8_GEMV_SILU (quant_matmul's), off unless "1"; "0" / "1" / unset each."""
    code = (
        "from jaxllm.models import quant, quant_matmul; from kernels_pallas import quant as kq; "
        "print(quant.NK_LAYOUT, quant.nk_layout_on(), quant_matmul.FP8_SILU_MLP, quant_matmul.FP8_NORM, "
        "kq.FP8_DOT_BF16, quant_matmul.FP8_ADD_NORM_E4M3, quant_matmul.FP8_GEMV_SILU)"
    )
    names = ("JAXLLM_INT4_NK", "JAXLLM_FP8_SILU_MLP", "JAXLLM_FP8_NORM", "JAXLLM_FP8_DOT_BF16")
    names += ("JAXLLM_FP8_ADD_NORM_E4M3", "JAXLLM_FP8_GEMV_SILU")  # the last off unless "1"
    unset = ["None", "False", "True", "True", "True", "True", "False"]
    for value, want in (("0", ["False"] * 7), ("1", ["True"] * 7), (None, unset)):
        env = {k: v for k, v in os.environ.items() if k not in names}
        if value is not None:
            env.update(dict.fromkeys(names, value))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.split() == want, out.stderr


def test_fp8_gemv_switch(checkpoints, monkeypatch):
    """JAXLLM_FP8_GEMV=0 (bench A/B runs) sets quant_matmul.FP8_GEMV off when the module loads (default on), and
    with it off a 2-row fp8 projection takes fp8_matmul's dot instead of the GEMV kernel; the qkv partials path
    then gives None (the plain projection)."""
    from jaxllm.models import quant_matmul

    code = "from jaxllm.models import quant_matmul; print(quant_matmul.FP8_GEMV)"
    for value, want in (("0", "False"), ("1", "True"), (None, "True")):
        env = {k: v for k, v in os.environ.items() if k != "JAXLLM_FP8_GEMV"}
        if value is not None:
            env["JAXLLM_FP8_GEMV"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.split() == [want], out.stderr
    dense_dir, _ = checkpoints
    _, mesh, params = _load(dense_dir, 1, quantization="fp8")
    w = params["layers"][0]["wo"]
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 512)), jnp.bfloat16)
    gemv = []
    real = _fp8_gemv.fp8_gemv_kernel
    monkeypatch.setattr(_fp8_gemv, "fp8_gemv_kernel", lambda x, *a, **k: gemv.append(x.shape) or real(x, *a, **k))
    on = qmatmul(x, w, kernels=True, interpret=True)
    assert gemv == [(2, 512)] and quant_matmul.split_k(x, w, interpret=True) is not None
    monkeypatch.setattr(quant_matmul, "FP8_GEMV", False)
    gemv.clear()
    off = qmatmul(x, w, kernels=True, interpret=True)
    assert gemv == [] and quant_matmul.split_k(x, w, interpret=True) is None
    assert _rel(on, off) < 2e-2


def test_int_weight_models_take_a_one_row_decode_bucket():
    """runner.smallest_seq_bucket: int-weight models (GPTQ / AWQ / W4A16 / W8A16 / INT8 W8A8) on the "pallas" backend
    start their sequence buckets at one row (the int kernel's one-row variant); 16-bit and fp8 models, and every
    model on the reference backend, at SMALLEST_SEQ_BUCKET (2)."""
    from types import SimpleNamespace

    from jaxllm.engine import runner
    from jaxllm.quantization import QuantConfig

    base = SimpleNamespace(quantization=None)
    gptq = SimpleNamespace(quantization=QuantConfig(method="gptq", bits=4, group_size=128))
    w8a8 = SimpleNamespace(quantization=QuantConfig(method="compressed-tensors", bits=8, activations="dynamic"))
    fp8 = SimpleNamespace(quantization=QuantConfig(method="fp8", weight_type="float", bits=8, activations="dynamic"))
    assert runner.smallest_seq_bucket(gptq, "pallas") == runner.SMALLEST_SEQ_BUCKET_INT == 1
    assert runner.smallest_seq_bucket(w8a8, "pallas") == 1
    for cfg, backend in ((gptq, "reference"), (base, "pallas"), (fp8, "pallas"), (base, "reference")):
        assert runner.smallest_seq_bucket(cfg, backend) == runner.SMALLEST_SEQ_BUCKET == 2
    assert runner.step_buckets(64, 512, 1) == ((1, 2, 4, 8, 16, 32, 64), (16, 32, 64, 128, 256, 512))
    assert runner.step_buckets(64, 512) == ((2, 4, 8, 16, 32, 64), (16, 32, 64, 128, 256, 512))
    assert runner.step_buckets(1, 16, 2) == ((1,), (16,))

    # a GPTQ model's runner on the "pallas" backend: 1-row decode programs, and attention told the smallest bucket
    from jaxllm.config import ModelConfig
    from jaxllm.models.attention import AttentionConfig
    from jaxllm.models.loader import abstract_weights
    from jaxllm.sharding import ParallelConfig

    hf = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=256,
        torch_dtype="bfloat16",
        quantization_config=dict(quant_method="gptq", bits=4, group_size=128, sym=True, desc_act=False),
    )
    mesh = ParallelConfig(1, 1).make_mesh()
    for quant, backend, want in ((True, "pallas", 1), (True, "reference", 2), (False, "pallas", 2)):
        cfg = ModelConfig.from_hf(hf if quant else {k: v for k, v in hf.items() if k != "quantization_config"})
        r = runner.ModelRunner(
            cfg,
            abstract_weights(cfg, mesh),
            mesh,
            num_blocks=8,
            block_size=16,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            max_model_len=64,
            attn_config=AttentionConfig(backend=backend),
        )
        assert r.seq_buckets[0] == r.attn.smallest_decode_rows == want
        decode_rows = sorted(v.num_seqs for v in r.programs.variants() if v.decode_only)
        assert decode_rows[0] == want
