"""The MoE grouped GEMM (kernels_pallas/_grouped.py) in interpret mode against its reference, through
expert_mlp / moe_mlp (expert parallelism's rows of other ranks' experts), and its Triton lowering for the real
model shapes (lowered for CUDA on CPU: the kernel's TTIR is built, no GPU needed)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ModelConfig, MoeConfig
from jaxllm.models.loader import load_params
from jaxllm.models.moe import expert_mlp, expert_mlp_dense, moe_mlp, route
from jaxllm.sharding import ParallelConfig
from kernels_pallas import _grouped, grouped_matmul, grouped_matmul_ref
from tests.tiny_models import hf_config


def _case(T, k, E, K, N, dtype, seed, tail=0, empty=()):
    """M = T * k rows sorted by expert with uneven random group sizes (the experts in `empty` get none) and
    `tail` rows past the groups, which are NaN: they must not reach any output."""
    rng = np.random.default_rng(seed)
    M = T * k
    p = rng.dirichlet(np.full(E, 0.5))
    p[list(empty)] = 0
    sizes = rng.multinomial(M - tail, p / p.sum()).astype(np.int32)
    rows = rng.standard_normal((M, K)).astype(np.float32)
    rows[M - tail :] = np.nan
    w = (rng.standard_normal((E, K, N)) / np.sqrt(K)).astype(np.float32)
    return jnp.asarray(rows, dtype), jnp.asarray(sizes), jnp.asarray(w, dtype)


def _loop(rows, sizes, w):
    """Each group's rows times its expert's weights, one numpy matmul per expert (float64)."""
    rows, w = np.asarray(rows, np.float64), np.asarray(w, np.float64)
    out = np.zeros((rows.shape[0], w.shape[2]))
    start = 0
    for e, s in enumerate(np.asarray(sizes)):
        out[start : start + s] = rows[start : start + s] @ w[e]
        start += s
    return out


CASES = [  # T, k, E, K, N, tail rows, empty experts, block_m
    (1, 1, 4, 64, 32, 0, (), None),
    (1, 8, 16, 64, 48, 0, (), None),
    (3, 2, 4, 32, 64, 1, (0,), None),
    (3, 8, 16, 128, 32, 5, (3, 7), None),
    (16, 1, 4, 64, 32, 2, (2,), None),
    (16, 8, 16, 64, 32, 9, (0, 15), None),
    (70, 2, 4, 64, 96, 11, (1,), None),  # groups of ~40 rows: several 16-row tiles each
    (70, 8, 16, 32, 64, 0, (5,), 32),
    (70, 1, 16, 64, 32, 30, (), 16),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("T, k, E, K, N, tail, empty, block_m", CASES)
def test_kernel_matches_reference(T, k, E, K, N, tail, empty, block_m, dtype):
    rows, sizes, w = _case(T, k, E, K, N, dtype, seed=T * 100 + k * 10 + E, tail=tail, empty=empty)
    want = np.asarray(grouped_matmul_ref(rows, sizes, w, out_dtype=jnp.float32))
    got = _grouped.grouped_matmul_kernel(rows, sizes, w, out_dtype=jnp.float32, block_m=block_m, interpret=True)
    got = np.asarray(got)
    assert got.shape == (T * k, N) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[T * k - tail :].any()  # rows past the groups: exactly zero
    if dtype == jnp.bfloat16:  # the default output dtype: rows', rounded once from the float32 sums (one ulp)
        out = grouped_matmul(rows, sizes, w, backend="kernel", block_m=block_m)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, rtol=2**-8, atol=1e-5)


def test_reference_matches_a_loop_over_experts():
    rows, sizes, w = _case(9, 2, 4, 32, 16, jnp.float32, seed=1, tail=3, empty=(2,))
    got = np.asarray(grouped_matmul_ref(rows, sizes, w))
    np.testing.assert_allclose(got, _loop(rows, sizes, w), rtol=1e-5, atol=1e-5)


def test_tile_plan_covers_every_row_once():
    """Every row lies in exactly one live tile, of its own expert (-1 past the groups), however uneven the sizes;
    the static tile count is enough for the worst case (every group's last tile one row)."""
    for sizes, M, bm in [([3, 0, 17, 1], 24, 16), ([1] * 16, 16, 16), ([0, 0, 0, 0], 5, 16), ([33, 0, 31], 70, 16)]:
        te, tr, tn = map(np.asarray, _grouped.tile_plan(jnp.asarray(sizes, jnp.int32), M, bm))
        owner = np.full(M, -2)
        for e, r, n in zip(te, tr, tn, strict=True):
            assert n <= bm and (owner[r : r + n] == -2).all()
            owner[r : r + n] = e
        want = np.concatenate([np.repeat(np.arange(len(sizes)), sizes), np.full(M - sum(sizes), -1)])
        np.testing.assert_array_equal(owner, want)
    assert _grouped.num_tiles(16, 16, 16) == 16 and _grouped.num_tiles(8, 128, 16) == 8


def test_entry_point_dispatch_and_errors():
    rows, sizes, w = _case(3, 2, 4, 24, 16, jnp.float32, seed=2)  # K = 24: not a multiple of 16
    assert not _grouped.supported(rows.dtype, 24, 16)
    np.testing.assert_allclose(np.asarray(grouped_matmul(rows, sizes, w)), _loop(rows, sizes, w), rtol=1e-5)
    with pytest.raises(ValueError, match="does not take"):
        grouped_matmul(rows, sizes, w, backend="kernel")
    with pytest.raises(ValueError, match="backend="):
        grouped_matmul(rows, sizes, w, backend="triton")


@pytest.mark.parametrize("T, E, k", [(1, 4, 1), (5, 16, 8), (37, 8, 2)])
def test_expert_mlp_pallas_matches_dense(T, E, k):
    """expert_mlp through the kernel (interpret) == the all-experts einsum; expert parallel halves (first_expert,
    the other rank's pairs sorted past the groups) sum to it, and each half alone is not it."""
    rng = np.random.default_rng(T + E)
    D, F = 32, 48
    h = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((D, E)), jnp.float32)
    w_gate_up = jnp.asarray(rng.standard_normal((E, D, 2, F)) / np.sqrt(D), jnp.float32)
    w_down = jnp.asarray(rng.standard_normal((E, F, D)) / np.sqrt(F), jnp.float32)
    weights, ids = route(h, router, MoeConfig(num_experts=E, top_k=k, intermediate_size=F))
    want = np.asarray(expert_mlp_dense(h, weights, ids, w_gate_up, w_down))
    got = np.asarray(jax.jit(expert_mlp, static_argnames="impl")(h, weights, ids, w_gate_up, w_down, impl="pallas"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    half = E // 2
    parts = [
        expert_mlp(
            h,
            weights,
            ids,
            w_gate_up[r * half : (r + 1) * half],
            w_down[r * half : (r + 1) * half],
            r * half,
            impl="pallas",
        )
        for r in range(2)
    ]
    np.testing.assert_allclose(np.asarray(parts[0] + parts[1]), want, rtol=1e-5, atol=1e-5)
    mine = (np.asarray(ids) < half).any(axis=1)  # tokens with a pair on rank 0
    assert not np.asarray(parts[0])[~mine].any()  # rank 0 gives exactly zero for tokens it has no pair of
    if mine.all() and (np.asarray(ids) >= half).any():
        assert not np.allclose(np.asarray(parts[0]), want, atol=1e-3)
    with pytest.raises(ValueError, match="impl="):
        expert_mlp(h, weights, ids, w_gate_up, w_down, impl="cuda")


@pytest.mark.parametrize("ep", [False, True])
def test_moe_mlp_tp2_pallas_equals_ragged_dot(ep):
    """moe_mlp over a tp=2 mesh (shard_map; expert parallel: each rank's experts from its first_expert) with
    the kernel equals the ragged_dot path at tp=1."""
    hf = hf_config("qwen3_moe").to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    cfg = dataclasses.replace(ModelConfig.from_hf(hf, dtype="float32"), expert_parallel=ep)
    mesh = ParallelConfig(2, 1).make_mesh()
    lp = load_params("", cfg, mesh, load_format="dummy")["layers"][0]
    h = jnp.asarray(np.random.default_rng(0).standard_normal((7, cfg.hidden_size)), jnp.float32)
    want = np.asarray(moe_mlp(lp, h, cfg, None, impl="ragged_dot"))
    got = np.asarray(moe_mlp(lp, h, cfg, mesh, impl="pallas"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize(
    "M, K, N, E",
    [(8, 2048, 1536, 128), (4096, 768, 2048, 128), (16384, 2048, 1536, 128), (2048, 14336, 4096, 8)],
)
def test_triton_lowering_of_model_shapes(M, K, N, E):
    """Qwen3-30B-A3B (decode, prefill) and Mixtral shapes lower to the kernel's Triton IR (for CUDA, on CPU):
    the block shapes and indexing the plan picks are ones the Triton lowering takes."""
    from jax import export

    dt = jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((M, K), dt),
        jax.ShapeDtypeStruct((E,), jnp.int32),
        jax.ShapeDtypeStruct((E, K, N), dt),
    )
    fn = jax.jit(lambda x, s, w: _grouped.grouped_matmul_kernel(x, s, w))
    ok = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(fn, platforms=["cuda"], disabled_checks=ok)(*args).mlir_module()
    assert "xla.gpu.triton" in text and "grouped_matmul_bm" in text
