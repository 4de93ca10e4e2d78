"""The MoE layer's grouped matmul (jaxllm/models/moe.py: jax.lax.ragged_dot over the tokens sorted by expert)
against a dense matmul of the same FLOPs, on one device.

  python bench/moe_matmul.py --out $OUT/moe_matmul_<device>.json                      # Qwen3-30B-A3B + Mixtral
  python bench/moe_matmul.py --shapes tiny --tokens 1,16 --out /tmp/moe_cpu.json      # CPU smoke test

Per (model shape, T tokens), with random routing of T tokens to top_k of E experts (router logits of random
weights: about T * k / E tokens per expert, as a trained router spreads them):
  grouped_gemms  the two ragged_dots alone (gate/up [T*k, D] x [E, D, 2F], down [T*k, F] x [E, F, D]) on rows
                 already sorted by expert: the grouped GEMM itself
  grouped_gemms_pallas   the same two GEMMs by kernels_pallas.grouped_matmul (the Pallas kernel the engine runs on
                 GPU; interpret mode on CPU), and grouped_gemms_pallas_{BM}x{BN} for each --pallas-tiles BMxBN (the
                 kernel's row and column tiles forced, for choosing _grouped.plan's heuristic)
  dense_gemms    the same two GEMMs as plain matmuls of the same sizes ([T*k, D] x [D, 2F], [T*k, F] x [F, D]):
                 the same FLOPs with one weight matrix, the grouped GEMM's ceiling
  expert_mlp     moe.expert_mlp(impl="ragged_dot"): sort by expert, gather rows, both ragged_dots, unsort, weighted
                 sum (the layer less the router)
  expert_mlp_pallas      moe.expert_mlp(impl="pallas"): the same with the Pallas grouped GEMM (the engine's GPU path)
  expert_mlp_gathered    moe.expert_mlp_gathered: each pair's expert weights gathered, batched matrix-vector
                 products (reads only the chosen experts; where the T * k copies fit --gathered-max-gib): where
                 this beats expert_mlp sets moe.GATHERED_MAX_PAIRS
  all_experts    moe.expert_mlp_dense: every token through every expert (E / k times the FLOPs), for small T
  grouped_gemms_mgpu     (H100 / H200 only) the same two grouped GEMMs by JAX's shipped Mosaic GPU kernel
                 (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu, one fixed tiling), the alternative to ragged_dot
  grouped_gemms_triton   (GPU) ragged_dot with jax_ragged_dot_use_gpu_pallas_triton_lowering, where this jax has it
A variant that fails (missing kernel, shared memory) records its error and the others go on.

XLA lowers ragged_dot on NVIDIA GPUs by expanding it into one dense dot over all E groups (RaggedDotRewriter: E
times the FLOPs, and an [E, T * k, D] masked operand) unless cuDNN's ragged-dot fusion is on; run the script twice
to compare, the second time with XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true (the flag is read
when the backend starts; the JSON's env records XLA_FLAGS).
Each figure is bench/kernels.py's chained-call difference (t(3 REPS) - t(REPS)) / 2 REPS (dispatch cost
cancels), with TFLOP/s and, for the grouped rows, the ratio to dense_gemms. The weights are read once per call:
at small T the grouped GEMM reads every expert that got a token (all E at T * k >= E), the dense one a single
[D, 2F] matrix, so the ratio there is a memory-traffic ratio, not a kernel-quality one (rows say both).
Correctness: expert_mlp, expert_mlp_pallas (and expert_mlp_gathered where timed) against expert_mlp_dense at every
shape with T <= --check-max-tokens, and grouped_gemms_pallas against grouped_gemms (max relative errors in the JSON;
> 2e-2 in bf16 is reported as a failure).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.common import environment, write_result  # noqa: E402
from bench.kernels import chained, timeit  # noqa: E402
from jaxllm.config import MoeConfig  # noqa: E402
from jaxllm.models.moe import expert_mlp, expert_mlp_dense, expert_mlp_gathered, route  # noqa: E402
from kernels_pallas import grouped_matmul  # noqa: E402

# name -> (D hidden, F expert width, E experts, k experts per token)
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "tiny": (64, 32, 8, 2),
}
TOKENS = (1, 8, 64, 512, 2048, 8192)


class _config:
    """jax_ragged_dot_use_gpu_pallas_triton_lowering set for a with-block (jit keys include it)."""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.old = jax.config.jax_ragged_dot_use_gpu_pallas_triton_lowering
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", self.value)

    def __exit__(self, *exc):
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", self.old)


def make_inputs(T, D, F, E, k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((T, D)), dtype)
    router = jnp.asarray(rng.standard_normal((D, E)) / np.sqrt(D), dtype)
    w_gate_up = jnp.asarray(rng.standard_normal((E, D, 2, F)) / np.sqrt(D), dtype)
    w_down = jnp.asarray(rng.standard_normal((E, F, D)) / np.sqrt(F), dtype)
    weights, ids = route(h, router, MoeConfig(num_experts=E, top_k=k, intermediate_size=F))
    return h, weights, ids, w_gate_up, w_down


def sorted_rows(h, ids, E):
    """The expert_mlp's GEMM operands: rows [T * k, D] sorted by expert and the group sizes [E]."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return h[order // k], jnp.bincount(flat, length=E).astype(jnp.int32)


def grouped_gemms(rows, sizes, w_gate_up, w_down):
    E, D = w_gate_up.shape[:2]
    gate, up = jnp.split(jax.lax.ragged_dot(rows, w_gate_up.reshape(E, D, -1), sizes), 2, axis=-1)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)


def pallas_grouped_gemms(rows, sizes, w_gate_up, w_down, **tuning):
    """grouped_gemms by the Pallas kernel (grouped_matmul runs it in interpret mode off GPU)."""
    E, D = w_gate_up.shape[:2]
    kw = dict(backend="kernel", **tuning)
    gate, up = jnp.split(grouped_matmul(rows, sizes, w_gate_up.reshape(E, D, -1), **kw), 2, axis=-1)
    return grouped_matmul(jax.nn.silu(gate) * up, sizes, w_down, **kw)


def dense_gemms(rows, w_gate_up, w_down):
    gate, up = jnp.split(rows @ w_gate_up, 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ w_down


def mgpu_grouped_gemms(rows, sizes, w_gate_up, w_down):
    """grouped_gemms with JAX's Mosaic GPU ragged_dot kernel (Hopper)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    E, D = w_gate_up.shape[:2]
    kw = dict(group_sizes=sizes, block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
    gate, up = jnp.split(ragged_dot_mgpu.ragged_dot(rows, w_gate_up.reshape(E, D, -1), **kw), 2, axis=-1)
    return ragged_dot_mgpu.ragged_dot((jax.nn.silu(gate) * up).astype(rows.dtype), w_down, **kw)


def bench_shape(name, T, dtype, runs, check_max_tokens, gathered_max_gib, max_call_s=0.25, skip=(), pallas_tiles=()):
    D, F, E, k = SHAPES[name]
    gathered = T * k * 3 * D * F * jnp.dtype(dtype).itemsize <= gathered_max_gib * 2**30
    h, weights, ids, w_gate_up, w_down = make_inputs(T, D, F, E, k, dtype)
    rows, sizes = sorted_rows(h, ids, E)
    dense_w = (w_gate_up[0].reshape(D, 2 * F), w_down[0])
    gemm_flops = 2 * T * k * D * 3 * F  # gate + up + down
    row = dict(
        shape=name,
        T=T,
        D=D,
        F=F,
        E=E,
        k=k,
        dtype=str(jnp.dtype(dtype)),
        experts_with_tokens=int((np.asarray(sizes) > 0).sum()),
        gemm_gflop=gemm_flops / 1e9,
    )

    def measure(key, fn, args, flops):
        """fn(*args) -> like args[0]: chained timing, or one call's wall time where one call takes longer than
        max_call_s (XLA's dense expansion of ragged_dot at large T: E times the FLOPs). An error (a missing
        kernel, out of memory) is recorded and the other variants go on; a --skip variant is not run."""
        if key in skip:
            row[key] = dict(error="skipped (--skip)")
            return
        try:
            f = jax.jit(fn)
            jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            one = time.perf_counter() - t0
            if one > max_call_s:
                row[key] = dict(us=one * 1e6, tflops=flops / one / 1e12, timing="one call (not chained: slow)")
                return
            med, lo, hi, wall = timeit(chained(fn), *args, runs=runs)
            row[key] = dict(
                us=med * 1e6,
                min_us=lo * 1e6,
                max_us=hi * 1e6,
                wall_us=wall * 1e6,
                tflops=flops / med / 1e12 if med > 0 else None,
            )
        except Exception as e:  # noqa: BLE001 - recorded in the JSON, the sweep goes on
            row[key] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")

    layer = (h, weights, ids, w_gate_up, w_down)
    measure(
        "grouped_gemms",
        lambda r, s, a, b: grouped_gemms(r, s, a, b).astype(r.dtype),
        (rows, sizes, w_gate_up, w_down),
        gemm_flops,
    )
    grouped_args = (rows, sizes, w_gate_up, w_down)
    measure(
        "grouped_gemms_pallas",
        lambda r, s, a, b: pallas_grouped_gemms(r, s, a, b).astype(r.dtype),
        grouped_args,
        gemm_flops,
    )
    for bm, bn in pallas_tiles:
        measure(
            f"grouped_gemms_pallas_{bm}x{bn}",
            lambda r, s, a, b, t=dict(block_m=bm, block_n=bn): pallas_grouped_gemms(r, s, a, b, **t).astype(r.dtype),
            grouped_args,
            gemm_flops,
        )
    measure("dense_gemms", lambda r, a, b: dense_gemms(r, a, b).astype(r.dtype), (rows, *dense_w), gemm_flops)
    for key, impl in (("expert_mlp", "ragged_dot"), ("expert_mlp_pallas", "pallas")):
        measure(
            key,
            lambda x, w, i, a, b, impl=impl: expert_mlp(x, w, i, a, b, impl=impl).astype(x.dtype),
            layer,
            gemm_flops,
        )
    if gathered:
        measure(
            "expert_mlp_gathered",
            lambda x, w, i, a, b: expert_mlp_gathered(x, w, i, a, b).astype(x.dtype),
            layer,
            gemm_flops,
        )
    if jax.default_backend() == "gpu":
        from kernels_pallas._common import on_hopper

        if on_hopper():
            measure(
                "grouped_gemms_mgpu",
                lambda r, s, a, b: mgpu_grouped_gemms(r, s, a, b).astype(r.dtype),
                (rows, sizes, w_gate_up, w_down),
                gemm_flops,
            )
        if hasattr(jax.config, "jax_ragged_dot_use_gpu_pallas_triton_lowering"):
            with _config(True):
                measure(
                    "grouped_gemms_triton",
                    lambda r, s, a, b: grouped_gemms(r, s, a, b).astype(r.dtype),
                    (rows, sizes, w_gate_up, w_down),
                    gemm_flops,
                )
    if T <= check_max_tokens:
        measure(
            "all_experts",
            lambda x, w, i, a, b: expert_mlp_dense(x, w, i, a, b).astype(x.dtype),
            layer,
            gemm_flops * E // k,
        )
        want = np.asarray(jax.jit(expert_mlp_dense)(h, weights, ids, w_gate_up, w_down), np.float32)
        fns = {"expert_mlp": expert_mlp, "expert_mlp_pallas": functools.partial(expert_mlp, impl="pallas")}
        if gathered:
            fns["expert_mlp_gathered"] = expert_mlp_gathered
        errs = []
        for key, fn in fns.items():
            if key in skip:
                continue
            got = np.asarray(jax.jit(fn)(h, weights, ids, w_gate_up, w_down), np.float32)
            row[f"rel_err_{key}_vs_all_experts"] = _rel_err(got, want)
            errs.append(row[f"rel_err_{key}_vs_all_experts"])
        row["max_rel_err_vs_all_experts"] = max(errs, default=0.0)
        if "grouped_gemms_pallas" not in skip and "grouped_gemms" not in skip:
            got = jax.jit(pallas_grouped_gemms)(rows, sizes, w_gate_up, w_down)
            ref = jax.jit(grouped_gemms)(rows, sizes, w_gate_up, w_down)
            row["max_rel_err_pallas_vs_ragged_dot"] = _rel_err(np.asarray(got, np.float32), np.asarray(ref, np.float32))
        worst = max(row["max_rel_err_vs_all_experts"], row.get("max_rel_err_pallas_vs_ragged_dot", 0.0))
        row["check_ok"] = worst <= (1e-4 if jnp.dtype(dtype) == jnp.float32 else 2e-2)
    dense_us = row["dense_gemms"].get("us", 0)
    for key in [k for k, v in row.items() if isinstance(v, dict) and k != "dense_gemms"]:
        if "us" in row.get(key, {}):
            row[f"{key}_over_dense"] = row[key]["us"] / dense_us if dense_us > 0 else None
    return row


def _rel_err(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma list of token counts T")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--runs", type=int, default=5, help="timed pairs per figure (median kept)")
    p.add_argument(
        "--check-max-tokens",
        type=int,
        default=512,
        help="also time the all-experts einsum and check against it up to this T",
    )
    p.add_argument(
        "--gathered-max-gib",
        type=float,
        default=4.0,
        help="also time expert_mlp_gathered where its T * k gathered expert copies fit in this",
    )
    p.add_argument(
        "--max-call-s",
        type=float,
        default=0.25,
        help="a variant whose single call takes longer is timed by that one call, not chained",
    )
    p.add_argument("--skip", default="", help="comma list of variants not to time (e.g. grouped_gemms_mgpu)")
    p.add_argument(
        "--pallas-tiles",
        default="",
        help="comma list of BMxBN tiles (e.g. 16x64,16x128,64x128) to also time the Pallas kernel with (beside the "
        "plan's choice)",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    rows, failures = [], []
    for name in a.shapes.split(","):
        for T in map(int, a.tokens.split(",")):
            try:
                row = bench_shape(
                    name,
                    T,
                    dtype,
                    a.runs,
                    a.check_max_tokens,
                    a.gathered_max_gib,
                    a.max_call_s,
                    a.skip.split(","),
                    [tuple(map(int, t.split("x"))) for t in a.pallas_tiles.split(",") if t],
                )
            except Exception as e:  # noqa: BLE001 - an OOM at one size keeps the others
                traceback.print_exc()
                failures.append(dict(shape=name, T=T, error=f"{type(e).__name__}: {e}"))
                continue
            rows.append(row)
            if row.get("check_ok") is False:
                failures.append(dict(shape=name, T=T, error=f"max rel err {row['max_rel_err_vs_all_experts']}"))
            times = {
                key: (f"{v['us']:.1f} us" if "us" in v else v["error"][:60])
                for key, v in row.items()
                if isinstance(v, dict)
            }
            print(f"{name} T={T}: {times}", flush=True)
    result = dict(env=environment() | {"xla_flags": os.environ.get("XLA_FLAGS", "")}, rows=rows, failures=failures)
    write_result("moe_matmul", result, a.out)
    return result


if __name__ == "__main__":
    main()
