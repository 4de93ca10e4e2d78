"""The nk layout of int4 weights and its Mosaic GPU kernel (kernels_pallas/_qmatmul_mgpu.py; jaxllm/models/quant.py
NK_LAYOUT): the kernel in Mosaic GPU's interpreter against the reference on every layout it takes, its CUDA lowering,
the device layout made from a checkpoint, and the decoder with NK_LAYOUT on against the planes layout and the dense
weights."""

from __future__ import annotations

import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import _qmatmul_mgpu, qlayout
from kernels_pallas.quant import quantized_matmul_ref


def _weight(K, N, group, sym, seed=0):
    rng = np.random.default_rng(seed)
    q, s, z = qlayout.quantize_weight(rng.standard_normal((K, N)) * 0.02, bits=4, group_size=group, sym=sym)
    return qlayout.pack_quantized(q, s, z, bits=4, group_size=group, dtype=jnp.bfloat16)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize(
    "K,N,M,group,sym,splits",
    [
        (256, 128, 1, 128, True, 2),
        (512, 192, 3, 128, False, 2),
        (256, 64, 9, -1, True, 2),
        (512, 128, 16, 256, False, 1),
    ],
)
def test_kernel_matches_the_reference(K, N, M, group, sym, splits):
    """qmatmul_mgpu's split-K partials (interpreter) sum to x @ W: symmetric and asymmetric, per channel, a group of
    two K blocks, rows padded to 8 and to 16; against quantized_matmul_ref on the planes layout of the same integers
    (bf16 output rounding apart)."""
    w = _weight(K, N, group, sym, seed=K + M)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.bfloat16)
    wt, s, z = _qmatmul_mgpu.nk_layout(w.qweight, w.scales, w.zeros, plane=w.plane, dtype=jnp.bfloat16)
    assert wt.shape == (N, K) and wt.dtype == jnp.int4 and (z is None) == sym
    parts = _qmatmul_mgpu.qmatmul_mgpu(x, wt, s, z, group_size=group, splits=splits, interpret=True)
    assert parts.shape == (splits, N, -(-M // 8) * 8)
    ref = quantized_matmul_ref(x, w)
    assert _rel(parts.sum(0).T[:M], ref) < 5e-3
    rows = _qmatmul_mgpu.qmatmul_mgpu(x, wt, s, z, group_size=group, splits=splits, rows_first=True, interpret=True)
    assert rows.shape == (splits, M, N)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(parts[:, :, :M].transpose(0, 2, 1)))
    assert _rel(_qmatmul_mgpu.matmul(x, wt, s, z, group_size=group, interpret=True), ref) < 5e-3


@pytest.mark.parametrize(
    "K,N,M,group,sym,splits,stages", [(512, 192, 3, 128, False, 1, 2), (256, 64, 9, -1, True, 1, None)]
)
def test_kernel_without_a_memory_warpgroup(K, N, M, group, sym, splits, stages):
    """inline_copies: the compute warpgroup issues the ring's copies itself (each slot refilled after its block's
    product; 2 slots over 4 K blocks reuse each twice). Same partials as the memory warpgroup's, bit for bit; and
    where it is the default."""
    w = _weight(K, N, group, sym, seed=K + M)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.bfloat16)
    wt, s, z = _qmatmul_mgpu.nk_layout(w.qweight, w.scales, w.zeros, plane=w.plane, dtype=jnp.bfloat16)
    kw = dict(group_size=group, splits=splits, stages=stages, interpret=True)
    want = _qmatmul_mgpu.qmatmul_mgpu(x, wt, s, z, inline_copies=False, **kw)
    np.testing.assert_array_equal(np.asarray(_qmatmul_mgpu.qmatmul_mgpu(x, wt, s, z, inline_copies=True, **kw)), want)
    # by default where it measured faster: qkv and o up to 16 rows (mma.sync), gate_up up to 8 rows, never down
    assert [_qmatmul_mgpu.default_inline(mp, n, k) for mp, n, k in ((8, 6144, 4096), (16, 4096, 4096))] == [True] * 2
    assert not _qmatmul_mgpu.default_inline(24, 4096, 4096)
    assert not _qmatmul_mgpu.default_inline(8, 6144, 4096, sync_rows=0)  # wgmma at every row count: not measured
    assert [_qmatmul_mgpu.default_inline(mp, 28672, 4096) for mp in (8, 16)] == [True, False]
    assert not _qmatmul_mgpu.default_inline(8, 4096, 14336)
    with pytest.raises(ValueError, match="nw=1"):
        wide = jnp.zeros((128, K), jnp.int4), jnp.ones((s.shape[0], 128), jnp.bfloat16)
        _qmatmul_mgpu.qmatmul_mgpu(x, *wide, inline_copies=True, nw=2, **kw)


@pytest.mark.parametrize(
    "K,N,M,group,sym,tile_m,block_k",
    [
        (256, 128, 20, 128, True, 16, 128),  # two row tiles, the last padded
        (512, 256, 40, -1, False, 24, 64),  # per channel, asymmetric, 8 K blocks
        (512, 128, 8, 256, False, 8, 128),  # a group of two K blocks
    ],
)
def test_wide_kernel_matches_the_reference(K, N, M, group, sym, tile_m, block_k):
    """qmatmul_mgpu_wide (interpreter): x's rows tiled, all of K in one program, the scale on the weight block; y^T
    equals x @ W (quantized_matmul_ref on the planes layout of the same integers) up to bf16 rounding, and matmul
    takes it above MAX_ROWS rows or when asked."""
    w = _weight(K, N, group, sym, seed=K + M)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.bfloat16)
    wt, s, z = _qmatmul_mgpu.nk_layout(w.qweight, w.scales, w.zeros, plane=w.plane, dtype=jnp.bfloat16)
    yt = _qmatmul_mgpu.qmatmul_mgpu_wide(x, wt, s, z, group_size=group, tile_m=tile_m, block_k=block_k, interpret=True)
    assert yt.shape == (N, -(-M // tile_m) * tile_m) and yt.dtype == x.dtype
    ref = quantized_matmul_ref(x, w)
    assert _rel(yt[:, :M].T, ref) < 5e-3
    y = _qmatmul_mgpu.matmul(x, wt, s, z, group_size=group, wide=True, tile_m=tile_m, block_k=block_k, interpret=True)
    assert y.shape == (M, N) and _rel(y, ref) < 5e-3


def test_default_ring_slots():
    """qmatmul_mgpu's default ring: 8 slots (fewer when the split has fewer blocks or ~96 KB holds fewer); 4 up to 8
    rows on the mma.sync path with K up to SHORT_K (measured faster for the 8B qkv and gate_up at one row)."""
    stages = _qmatmul_mgpu.default_stages
    assert stages(8, 4096, 16) == stages(8, 4096, 8) == 4  # gate_up, qkv at 1-8 rows
    assert stages(8, 14336, 8) == 8 and stages(8, 4096, 4) == 4  # down (long K), o (4 blocks a split)
    assert stages(16, 4096, 16) == 8  # 9-16 rows
    assert stages(24, 4096, 16) == 8 and stages(8, 4096, 16, sync_rows=0) == 8  # wgmma rows
    assert stages(256, 4096, 32) == 2  # 256 rows: 68 KB a slot


def test_plan_and_refusals():
    """plan: splits that divide K's blocks into whole groups and give ~2 programs an SM (8B shapes); supported /
    qmatmul_mgpu refuse what the kernel does not take."""
    assert _qmatmul_mgpu.plan(28672, 4096, 128, ctas_per_sm=4) == 2  # 448 column blocks x 2 >= 4 x 132
    assert _qmatmul_mgpu.plan(4096, 14336, 128, ctas_per_sm=4) == 14  # 64 x 14 >= 528 (112 blocks)
    assert _qmatmul_mgpu.plan(4096, 4096, -1) == 8
    splits = _qmatmul_mgpu.plan(4096, 4096, 512)  # groups of 4 K blocks: each split holds whole groups
    assert splits > 1 and (32 // splits) % 4 == 0
    tiles = lambda m, n, k: _qmatmul_mgpu.wide_tiling(m, n, k, 128)["tile_m"]  # noqa: E731
    assert (tiles(512, 6144, 4096), tiles(512, 28672, 4096)) == (256, 256)  # qkv, gate_up: enough column blocks
    assert (tiles(512, 4096, 4096), tiles(512, 4096, 14336)) == (128, 128)  # o, down: 32 column blocks
    assert tiles(300, 28672, 4096) == 128  # 256-row tiles would pad 300 rows to 512
    assert not _qmatmul_mgpu.supported(jnp.float32, 128, 256, 4, 128)
    assert not _qmatmul_mgpu.supported(jnp.bfloat16, 96, 256, 4, 128)  # N not whole 64-column blocks
    assert not _qmatmul_mgpu.supported(jnp.bfloat16, 128, 256, 4, 64)  # groups smaller than a K block
    assert not _qmatmul_mgpu.supported(jnp.bfloat16, 128, 256, 8, 128)
    w = _weight(256, 128, 128, True)
    wt, s, _ = _qmatmul_mgpu.nk_layout(w.qweight, w.scales, None, plane=w.plane, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="at most 256 rows"):
        _qmatmul_mgpu.qmatmul_mgpu(jnp.zeros((300, 256), jnp.bfloat16), wt, s, group_size=128, interpret=True)
    with pytest.raises(ValueError, match="splits=3"):
        _qmatmul_mgpu.qmatmul_mgpu(jnp.zeros((1, 256), jnp.bfloat16), wt, s, group_size=128, splits=3, interpret=True)


@pytest.mark.parametrize("M,sym,K,N", [(512, True, 4096, 28672), (300, False, 14336, 4096)])
def test_wide_kernel_lowers_for_cuda(M, sym, K, N):
    """The wide kernel's Mosaic GPU lowering (CPU) at 8B shapes: gate_up over an offline decode batch, down with
    asymmetric groups (112 group rows of scales and zeros in shared memory beside the ring and the output tile)."""
    wt = jnp.zeros((N, K), jnp.int4)
    s = jnp.ones((K // 128, N), jnp.bfloat16)
    z = None if sym else s
    x = jnp.zeros((M, K), jnp.bfloat16)
    tiling = _qmatmul_mgpu.wide_tiling(M, N, K, 128, not sym)  # 256 x 64 tiles for gate_up, 128 x 128 for down
    f = jax.jit(functools.partial(_qmatmul_mgpu.qmatmul_mgpu_wide, group_size=128, **tiling))
    assert "mosaic_gpu" in f.trace(x, wt, s, z).lower(lowering_platforms=("cuda",)).as_text()
    if not sym:  # 256-row tiles: 120 KB of output tile, scales and zeros leave room for one 72 KB ring slot
        with pytest.raises(ValueError, match="no room"):
            _qmatmul_mgpu.qmatmul_mgpu_wide(x, wt, s, z, group_size=128, tile_m=256)


@pytest.mark.parametrize("M,sym", [(1, True), (16, False)])
def test_kernel_lowers_for_cuda(M, sym):
    """The Mosaic GPU lowering (run on CPU; ptxas is the GPU's) of gate_up's shape at 1 and 16 rows: the int4 TMA,
    the inline dequantization (_biased_weight) and the product with the weight in registers (mma.sync up to SYNC_ROWS
    rows, else wgmma); with rows_first, the WGMMA_TRANSPOSED store of the output tile and its TMA store of M rows."""
    K, N = 4096, 2048
    wt = jnp.zeros((N, K), jnp.int4)
    s = jnp.ones((K // 128, N), jnp.bfloat16)
    z = None if sym else s
    x = jnp.zeros((M, K), jnp.bfloat16)
    for rows_first in (False, True):
        f = jax.jit(functools.partial(_qmatmul_mgpu.qmatmul_mgpu, group_size=128, rows_first=rows_first))
        assert f.eval_shape(x, wt, s, z).shape[1:] == ((M, N) if rows_first else (N, -(-M // 8) * 8))
        text = f.trace(x, wt, s, z).lower(lowering_platforms=("cuda",)).as_text()
        assert "qmatmul_nk_mosaic_gpu" in text  # its name in traces: qmatmul_nk_mosaic_gpu_kernel
    assert "lop3.b32" in text  # the dequantization's one LOP3 a value pair
    for sync_rows in (0, 16):  # up to sync_rows rows (Mp) per-warp mma.sync instead of wgmma
        f = jax.jit(functools.partial(_qmatmul_mgpu.qmatmul_mgpu, group_size=128, sync_rows=sync_rows))
        text = f.trace(x, wt, s, z).lower(lowering_platforms=("cuda",)).as_text()
        assert ("mma.sync.aligned.m16n8k16" in text) == (sync_rows > 0)
    texts = []
    for inline in (False, True):  # no memory warpgroup: the compute warpgroup's own copies lower as well
        f = jax.jit(functools.partial(_qmatmul_mgpu.qmatmul_mgpu, group_size=128, inline_copies=inline))
        texts.append(f.trace(x, wt, s, z).lower(lowering_platforms=("cuda",)).as_text())
    assert "qmatmul_nk_mosaic_gpu" in texts[1] and texts[1] != texts[0]


# --- the model -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gptq_g128(tmp_path_factory):
    """A small Llama as GPTQ v1 int4 (groups of 128, no act-order) in two variants, sym and asym, and the dense model
    of the asym one's dequantized weights."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxllm.models.quant import pack_int

    torch.manual_seed(1)
    # Every projection two K blocks of 128 (two groups; one a shard under tp 2) and as few 64-column blocks as the
    # wide kernel takes: Mosaic GPU's interpreter runs its programs one by one, and its time grows with N (8 heads and
    # 512 intermediate took 96 s for the projections test in CI: 2304 weight columns a layer, 1536 now).
    hf = LlamaConfig(
        vocab_size=96,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=128,
    )
    root = tmp_path_factory.mktemp("quant_nk")
    model = LlamaForCausalLM(hf).to(torch.bfloat16)
    out = {}
    for sym in (True, False):
        quant, dense = {}, {}
        for name, w in model.state_dict().items():
            if name.endswith("_proj.weight") and ".layers." in name:
                wt = w.float().numpy().T  # [I, O]
                q, s, z = qlayout.quantize_weight(wt, bits=4, group_size=128, sym=sym)
                s = s.astype(np.float16).astype(np.float32)
                zero = np.full_like(s, 8) if sym else z
                d = ((q.reshape(-1, 128, q.shape[1]) - zero[:, None]) * s[:, None]).reshape(q.shape).T
                dense[name] = torch.from_numpy(np.ascontiguousarray(d)).to(torch.bfloat16)
                p = name[: -len("weight")]
                tensors = {
                    "qweight": pack_int(q, 4),
                    "qzeros": pack_int((zero - 1).T.astype(np.int64), 4).T,
                    "scales": s.astype(np.float16),
                }
                quant.update({p + k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()})
            else:
                quant[name] = dense[name] = w.contiguous()
        for kind, tensors in (("gptq", quant), ("dense", dense)):
            folder = root / f"{kind}_{'sym' if sym else 'asym'}"
            model.save_pretrained(folder)
            save_file(tensors, str(folder / "model.safetensors"))
            if kind == "gptq":
                cfg = json.loads((folder / "config.json").read_text())
                cfg["quantization_config"] = dict(
                    quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=sym, checkpoint_format="gptq"
                )
                (folder / "config.json").write_text(json.dumps(cfg))
            out[kind, sym] = str(folder)
    return out


def _load(path, tp, nk, monkeypatch):
    from jaxllm.config import ModelConfig
    from jaxllm.models import quant
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import ParallelConfig

    monkeypatch.setattr(quant, "NK_LAYOUT", nk)
    cfg = ModelConfig.from_hf(path, dtype="bfloat16")
    mesh = ParallelConfig(tp, 1).make_mesh()
    return cfg, mesh, load_params(path, cfg, mesh)


def _mgpu_reference(x, wt, scales, zeros=None, *, group_size, **_):
    """qmatmul_mgpu's result (one split: partials [1, N, Mp] of y^T) from the dequantized weight. Under tp 2 the
    tests call it in place of the kernel: Mosaic GPU's interpreter, running on both simulated devices at once, hung or
    aborted the pytest worker in two CI runs (its shared memory is process-global); tp 1 runs the kernel itself."""
    from jaxllm.models.quant_matmul import nk_dequantize

    Mp = -(-x.shape[0] // 8) * 8
    y = nk_dequantize(wt, scales, zeros, group_size, jnp.float32) @ x.astype(jnp.float32).T
    return jnp.pad(y, ((0, 0), (0, Mp - x.shape[0])))[None]


def _mgpu_wide_reference(x, wt, scales, zeros=None, *, group_size, tile_m=128, **_):
    """qmatmul_mgpu_wide's result (y^T [N, Mp] in x's dtype) from the dequantized weight: its stand-in under tp 2,
    for the reason _mgpu_reference gives."""
    from jaxllm.models.quant_matmul import nk_dequantize

    Mp = -(-x.shape[0] // tile_m) * tile_m
    y = nk_dequantize(wt, scales, zeros, group_size, jnp.float32) @ x.astype(jnp.float32).T
    return jnp.pad(y, ((0, 0), (0, Mp - x.shape[0]))).astype(x.dtype)


@pytest.mark.parametrize("sym,tp", [(True, 1), (False, 2)])
def test_projections_in_the_nk_layout_match_the_planes_layout(gptq_g128, monkeypatch, sym, tp):
    """With NK_LAYOUT on every projection of a GPTQ g128 checkpoint is laid out int4 [*O, I] (row-parallel wo /
    w_down split on I under tp 2), and qmatmul's reference path and kernels path (the Mosaic GPU kernel in the
    interpreter, 5 rows, tp 1; its contract by _mgpu_reference under tp 2; the wide kernel, 200 rows, likewise by
    _mgpu_wide_reference under tp 2) equal the planes layout's product and the dense weights'."""
    from jaxllm.models.quant_matmul import qmatmul

    calls, wide_calls = [], []
    real = _qmatmul_mgpu.qmatmul_mgpu if tp == 1 else _mgpu_reference
    real_wide = _qmatmul_mgpu.qmatmul_mgpu_wide if tp == 1 else _mgpu_wide_reference
    monkeypatch.setattr(_qmatmul_mgpu, "qmatmul_mgpu", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    monkeypatch.setattr(
        _qmatmul_mgpu, "qmatmul_mgpu_wide", lambda x, *a, **k: wide_calls.append(x.shape) or real_wide(x, *a, **k)
    )
    _, _, dense = _load(gptq_g128["dense", sym], 1, False, monkeypatch)
    _, _, planes = _load(gptq_g128["gptq", sym], 1, False, monkeypatch)
    _, mesh, nk = _load(gptq_g128["gptq", sym], tp, True, monkeypatch)
    jax.clear_caches()  # an earlier test may have traced the kernel at these shapes: the count below needs fresh traces
    rng = np.random.default_rng(3)
    for key in ("w_qkv", "wo", "w_gate_up", "w_down"):
        w, p, d = (t["layers"][0][key] for t in (nk, planes, dense))
        assert w.layout.nk and not p.layout.nk and w.packed.dtype == jnp.int4
        assert w.packed.shape == (*d.shape[2 if key == "wo" else 1 :], int(np.prod(d.shape[: 2 if key == "wo" else 1])))
        assert (w.zeros is None) == sym
        n_in = 2 if key == "wo" else 1
        for rows in (5, 200):
            x = jnp.asarray(rng.standard_normal((rows, int(np.prod(d.shape[:n_in])))), jnp.bfloat16)
            want = np.asarray(x, np.float32) @ np.asarray(d, np.float32).reshape(x.shape[1], -1)
            base = qmatmul(x, p, kernels=False)
            for kernels in (False, True):
                got = jax.jit(functools.partial(qmatmul, kernels=kernels, interpret=True, mesh=mesh))(x, w)
                assert got.shape == base.shape
                assert _rel(got, base) < 1e-2 and _rel(got.reshape(rows, -1), want) < 1e-2, (key, rows, kernels)
    assert len(calls) == 4, calls  # the 5-row kernels-path products (one trace each)
    assert len(wide_calls) == 4 and all(r == 200 for r, _ in wide_calls), wide_calls  # the 200-row ones (NK_WIDE)


def test_decoder_with_nk_weights_matches_the_reference_path(gptq_g128, monkeypatch):
    """The decoder on the "pallas" backend (kernels in interpret mode) with NK_LAYOUT on: a 27-row ragged step (up to
    NK_KERNEL_MAX_ROWS rows: the Mosaic GPU kernel for every projection) gives the reference path's logits."""
    from jaxllm.models.attention import AttentionConfig
    from tests.model_harness import ragged_logits

    calls = []
    real = _qmatmul_mgpu.qmatmul_mgpu
    monkeypatch.setattr(_qmatmul_mgpu, "qmatmul_mgpu", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    jax.clear_caches()
    cfg, mesh, params = _load(gptq_g128["gptq", False], 1, True, monkeypatch)
    seqs = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89], [11, 7], [8] * 9]

    def logits(backend):
        attn = AttentionConfig(backend=backend, interpret=backend == "pallas", mesh=mesh)
        return [np.asarray(x, np.float32) for x in ragged_logits(params, cfg, seqs, [0] * 3, block_size=8, attn=attn)]

    kernel = logits("pallas")
    assert len(calls) == 4, calls
    ref = logits("reference")
    for k, r in zip(kernel, ref, strict=True):
        assert _rel(k, r) < 2e-2


def test_nk_qkv_partials_reach_the_attention_kernel(gptq_g128, monkeypatch):
    """A decode-only step of 1 row (the int models' batch-1 bucket) with NK_LAYOUT on, "pallas" backend (interpret
    mode): the qkv projection reaches the fused qkv/RoPE/write + decode kernel as the nk kernel's float32 split-K
    partials [S, T, K, G + 2, H] (rows first as the kernel writes them: no XLA sum or transpose in front of it), and
    the logits equal the reference backend's to bf16 rounding. 3 rows: split_k gives None (a plain projection)."""
    from jaxllm.models import quant_matmul
    from tests.model_harness import one_row_decode_logits, spy_add_rms_norm

    cfg, mesh, params = _load(gptq_g128["gptq", False], 1, True, monkeypatch)
    norms = spy_add_rms_norm(monkeypatch)
    seen, got, ref = one_row_decode_logits(params, cfg, mesh, monkeypatch)
    w = params["layers"][0]["w_qkv"]
    assert w.layout.nk
    # one split at these widths; two layer traces (layer 0, and the later layers: they take the previous layer's down
    # partials unsummed)
    assert seen == [(1, 1, *w.packed.shape[:-1])] * 2, seen
    assert norms == [(1, cfg.hidden_size)] * 3, norms  # o + residual + MLP norm twice, down + attention norm once
    for k, r in zip(got, ref, strict=True):
        assert _rel(k, r) < 2e-2
    h = jnp.zeros((3, w.layout.k), jnp.bfloat16)
    assert quant_matmul.split_k(h, w, interpret=True) is None


@pytest.mark.parametrize("block_k", [128, 64])
def test_nk_permute_puts_each_lanes_pairs_where_the_kernel_reads_them(block_k):
    """What _biased_weight does on a GPU (the interpreter unpermutes instead), in numpy on nk_permute's bytes (int4
    element 2i in byte i's low nibble): lane l of warp w reads rows 16 w + l // 4 (+ 8) with 64-bit loads at byte
    32 g + 8 (l % 4) of each 64-value group g, and word j >> 4 m, masked 0x000f000f and xor'd with bias's pattern,
    must be bias + q at the pair of columns 8 (8 g + 4 j + m) + 2 (l % 4) (+ 1) that WGMMA's layout gives that
    register."""
    q = np.random.default_rng(block_k).integers(0, 16, (64, block_k))
    nib = np.asarray(_qmatmul_mgpu.nk_permute(q - 8)) & 0xF
    raw = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)  # [64, block_k / 2] bytes

    def word(row, byte):
        return int.from_bytes(raw[row, byte : byte + 4].tobytes(), "little")

    def bf16(bits):
        return float(np.frombuffer(np.uint32(bits << 16).tobytes(), np.float32)[0])

    for w, lane, h in itertools.product(range(4), range(32), range(2)):
        row, pair = 16 * w + lane // 4 + 8 * h, lane % 4
        for g, j, m in itertools.product(range(block_k // 64), range(2), range(4)):
            v = ((word(row, 32 * g + 8 * pair + 4 * j) >> (4 * m)) & 0x000F000F) ^ 0x43084308
            col = 8 * (8 * g + 4 * j + m) + 2 * pair
            assert (bf16(v & 0xFFFF), bf16(v >> 16)) == (128 + q[row, col], 128 + q[row, col + 1])


@pytest.mark.parametrize("sym,shards", [(True, 1), (False, 2)])
def test_nk_relayout_on_host_and_device(sym, shards):
    """The nk device layout of a checkpoint's words (numpy while loading, jax for dummy weights and Orbax restores):
    int4 [O, I] holding q - 8 (row shards stay contiguous on I), zeros as z - 8; the checkpoint leaf keeps int32."""
    from jaxllm.models.quant import QuantLayout, QuantScheme, Relayout, pack_int
    from jaxllm.models.quant_matmul import nk_dequantize

    I, O, G = 512, 64, 128
    rng = np.random.default_rng(shards)
    q = rng.integers(0, 16, (I, O))
    s = rng.uniform(0.5, 1.5, (I // G, O)).astype(np.float32)
    z = rng.integers(0, 16, (I // G, O)).astype(np.float32)
    lay = QuantLayout("ffn", ("embed",), I // shards, shards, 0, G, nk=True)
    scheme = QuantScheme("int", 4, G, None)

    def relayout(field, x, dtype):
        return Relayout(field, scheme, lay, (), (), dtype, "int32" if field == "packed" else None)(x)

    words = pack_int(q, 4)
    for x in (words, jnp.asarray(words)):
        wt = relayout("packed", x, "int4")
        assert wt.shape == (O, I) and wt.dtype == jnp.int4
        np.testing.assert_array_equal(np.asarray(_qmatmul_mgpu.nk_unpermute(wt)).astype(np.int32), q.T - 8)
        assert not np.array_equal(np.asarray(wt).astype(np.int32), q.T - 8)  # the kernel's order, not I's
    zz = relayout("zeros", jnp.asarray(z), "float32")
    np.testing.assert_array_equal(np.asarray(zz), z - 8)
    dense = nk_dequantize(jnp.asarray(wt), jnp.asarray(s), None if sym else zz, G, jnp.float32)
    zero = 8 if sym else np.repeat(z, G, 0)
    np.testing.assert_allclose(np.asarray(dense), ((q - zero) * np.repeat(s, G, 0)).T, rtol=1e-6)


@pytest.mark.parametrize(
    "env,hopper,tp,want",
    [
        (None, True, 1, True),
        (None, False, 1, False),
        (False, True, 1, False),
        (None, True, 2, False),
        (True, True, 2, True),
    ],
)
def test_nk_layout_is_the_default_on_hopper_at_tp_1(gptq_g128, monkeypatch, env, hopper, tp, want):
    """Unset (NK_LAYOUT None), int4 weights take the nk layout exactly when the device is a Hopper GPU
    (kernels_pallas.on_hopper, patched here: this machine has none) and tp is 1; JAXLLM_INT4_NK=0 (False) keeps
    planes there, =1 (True) gives nk under tp 2 as well."""
    import kernels_pallas

    monkeypatch.setattr(kernels_pallas, "on_hopper", lambda: hopper)
    _, _, params = _load(gptq_g128["gptq", True], tp, env, monkeypatch)
    assert all(params["layers"][0][k].layout.nk == want for k in ("w_qkv", "wo", "w_gate_up", "w_down"))
