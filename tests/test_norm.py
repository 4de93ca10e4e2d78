"""kernels_pallas.norm: the residual add + RMSNorm kernel (interpret mode) against its reference, and the decoder's
pending-delta path that uses it (decoder.ADD_NORM_MAX_ROWS) against the reference backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import norm


def _inputs(T, D, parts, dtype, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = (3 * jax.random.normal(k[0], (T, D))).astype(dtype)
    shape, ddtype = ((parts, T, D), jnp.float32) if parts else ((T, D), dtype)
    delta = jax.random.normal(k[1], shape).astype(ddtype)
    weight = (1 + 0.2 * jax.random.normal(k[2], (D,))).astype(dtype)
    return x, delta, weight


@pytest.mark.parametrize(
    "T,D,parts,dtype,plus_one",
    [
        (1, 4096, 0, jnp.bfloat16, False),  # the 8B decode row; D in four 1024-wide chunks
        (2, 4096, 16, jnp.bfloat16, False),  # an int4 projection's split-K partials
        (2, 3584, 0, jnp.bfloat16, True),  # Qwen2.5-7B's width (7 chunks of 512); Gemma's (1 + w)
        (5, 896, 3, jnp.float16, False),
        (16, 96, 1, jnp.float32, True),  # chunks of 32; MAX_ROWS rows
    ],
)
def test_add_rms_norm_kernel_matches_reference(T, D, parts, dtype, plus_one):
    x, delta, weight = _inputs(T, D, parts, dtype)
    r, h = norm.add_rms_norm(x, delta, weight, eps=1e-5, plus_one=plus_one, interpret=True)
    r_ref, h_ref = norm.add_rms_norm_ref(x, delta, weight, eps=1e-5, plus_one=plus_one)
    assert r.dtype == r_ref.dtype and h.dtype == h_ref.dtype and h.shape == (T, D)
    np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(r_ref, np.float32))  # one rounding, same
    # h: the float32 sum of squares runs in another order: 16-bit h at most one ulp apart, float32 a few
    ulp = float(jnp.finfo(dtype).eps) * (8 if dtype == jnp.float32 else 1)
    h, h_ref = np.asarray(h, np.float32), np.asarray(h_ref, np.float32)
    assert np.all(np.abs(h - h_ref) <= ulp * np.abs(h_ref) + 1e-30)
    assert np.mean(h != h_ref) < 0.01 or dtype == jnp.float32


def test_add_rms_norm_takes_what_its_kernel_does_and_refuses_the_rest():
    x, delta, weight = _inputs(2, 100, 0, jnp.bfloat16)  # D not a multiple of 32: the reference runs
    assert not norm.add_rms_norm_supported(x, delta)
    for got, want in zip(
        norm.add_rms_norm(x, delta, weight, eps=1e-6, interpret=True),
        norm.add_rms_norm_ref(x, delta, weight, eps=1e-6),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="add_rms_norm_kernel does not take"):
        norm.add_rms_norm_kernel(x, delta, weight, eps=1e-6, interpret=True)
    x, delta, _ = _inputs(norm.MAX_ROWS + 1, 64, 0, jnp.bfloat16)
    assert not norm.add_rms_norm_supported(x, delta)  # a prefill's rows: XLA's fusions
    x, delta, _ = _inputs(2, 64, 2, jnp.bfloat16)
    assert not norm.add_rms_norm_supported(x, delta.astype(jnp.bfloat16))  # partials are float32
    assert norm.add_rms_norm_supported(x, delta)
    np.testing.assert_array_equal(  # add_delta: add_rms_norm's r alone
        np.asarray(norm.add_delta(x, delta), np.float32),
        np.asarray(norm.add_rms_norm_ref(x, delta, jnp.ones(64, x.dtype), eps=1e-6)[0], np.float32),
    )


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2_moe"])
def test_decoder_adds_pending_outputs_in_the_norm_kernel(tmp_path, monkeypatch, arch):
    """A decode-only step of 2 rows on the "pallas" backend (interpret mode): each layer's o and down (or MoE)
    output (o and down as split-K partials) is left pending and added in the next norm's add_rms_norm launch (two a layer, the last layer's
    output added after the loop), and the logits equal the reference backend's; Gemma 2 (post-norms, (1 + w)) and
    Qwen2-MoE (a MoE block's output) included. With ADD_NORM_MAX_ROWS 0, or for the 5-token first step, no launch."""
    from jaxllm.config import ModelConfig
    from jaxllm.models import decoder
    from jaxllm.models.attention import AttentionConfig
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import ParallelConfig
    from tests.model_harness import ragged_logits
    from tests.tiny_models import make_tiny_model_dir

    make_tiny_model_dir(arch, str(tmp_path))
    cfg = ModelConfig.from_hf(str(tmp_path), dtype="float32")
    mesh = ParallelConfig(1, 1).make_mesh()
    params = load_params(str(tmp_path), cfg, mesh)
    seqs, cached = [[5, 9, 2, 77, 3], [11, 7, 40]], [4, 2]  # a second step of one new token each: 2 rows
    calls = []
    real = norm.add_rms_norm_kernel
    monkeypatch.setattr(
        norm, "add_rms_norm_kernel", lambda x, d, *a, **k: calls.append((x.shape, d.shape)) or real(x, d, *a, **k)
    )

    def logits(attn):
        jax.clear_caches()  # the layer is jitted: trace it again with the spy
        out = ragged_logits(params, cfg, seqs, cached, block_size=4, attn=attn, pad_tokens=0, pad_seqs=0)
        return [np.asarray(x, np.float32) for x in out]

    ref = logits(AttentionConfig(mesh=mesh))
    assert not calls
    got = logits(AttentionConfig(backend="pallas", interpret=True, mesh=mesh))
    D = cfg.hidden_size
    # a trace per (LayerKind, pending delta or not): layer 0's has one launch (its mlp_norm), the others' two
    traces = {(cfg.layer_kind(i), i > 0) for i in range(cfg.num_layers)}
    assert calls and all(x == (2, D) and d[-2:] == (2, D) for x, d in calls), calls
    # o and down as ADD_NORM_SPLITS float32 partials; Gemma 2's normed outputs and a MoE block's output as they are
    parts = (decoder.ADD_NORM_SPLITS, 2, D)
    assert {d for _, d in calls} == {"llama": {parts}, "gemma2": {(2, D)}, "qwen2_moe": {parts, (2, D)}}[arch]
    assert len(calls) == sum(1 + later for _, later in traces), calls
    for o, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())
    calls.clear()
    monkeypatch.setattr(decoder, "ADD_NORM_MAX_ROWS", 0)
    off = logits(AttentionConfig(backend="pallas", interpret=True, mesh=mesh))
    assert not calls
    for o, r in zip(off, got, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())
