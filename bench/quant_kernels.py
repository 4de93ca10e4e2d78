"""Quantized matmuls on one GPU (issue 29): kernel time and effective bytes/s over the same run's copy bandwidth, per
projection shape of Llama-3-8B and batch size, every quantized path beside the bf16 matmul of the same shape.

  python bench/quant_kernels.py --out $OUT/quant_kernels_h100.json [--m 1,2,4,8,16,32,64,256]
      [--shapes qkv,o,gate_up,down] [--impls bf16,int4_sym,int4_asym,int8,int4_dequant,fp8] [--sweep]
  --tiny: CPU smoke run (small shapes, kernels in interpret mode, no XProf; one call per timed chain unless --reps:
  an int4_mgpu row interprets the Mosaic GPU kernel at ~7 s a call, ~1 minute a shape and M on the 2-core VM).

impls: bf16 = x @ W (XLA's GEMM); int4_sym / int4_asym = int4 g128 through kernels_pallas.quantized_matmul with
the kernel forced (backend="kernel", also above its default batch limit, to find where the dequantize path wins);
int8 = int8 per-channel symmetric (W8A16), kernel; int4_dequant = int4 g128 sym through the dequantize + GEMM path
(the dense weight from _qunpack's kernel on a GPU);
fp8 = fp8_matmul (e4m3 weight, per-channel weight scales, dynamic per-token activation scales computed in the
call) with the fp8 x fp8 dot at every M; fp8_widened = the same function with both fp8 operands widened to bfloat16
for XLA's GEMM at every M (fp8_matmul's default up to FP8_WIDEN_MAX_ROWS); fp8_w8a16 = the fp8 weight widened to
x's dtype inside XLA's GEMM (exact for e4m3), the channel scales on the float32 product, x not rounded to fp8;
int4_xla = an int4 [K, N] array (jnp.int4) widened and scaled per 128-row group in front of XLA's GEMM (XLA's own s4
handling, no Pallas kernel); fp8_res = fp8_matmul then XLA's residual add of a [M, N] bf16 residual (M <= 2: the decode
bucket's rows); fp8_gemv / fp8_gemv_res = the same function (without / with the residual) as one Pallas kernel
(kernels_pallas/_fp8_gemv.py: the token scales, x's rounding, the GEMV, the scales and the add; --sweep adds its
FP8_GEMV_SWEEP tilings); fp8_gemv_e4m3 / fp8_gemv_amax = fp8_gemv given x already in e4m3 with its token scales
(Fp8Rows) / with K / 16 partial maxima a row (RowsWithMax), so the kernel skips its pass over the row;
fp8_gemv_silu = silu(gate) * up of the gate_up shape in one kernel (fp8_gemv_silu, F = N / 2 columns out; --sweep
adds FP8_SILU_SWEEP's tilings; fp8_gemv_silu_e4m3 given e4m3 rows as fp8_gemv_e4m3 is; the default layout "paired"
reads gate's and up's rows of a program as one tile of the weight as stored; fp8_gemv_silu_il[_e4m3] on the weight
interleaved at load time, one [2 block_n, K] block a program; fp8_gemv_silu_split[_e4m3] two tiles a K step), against
fp8_gemv_silu_xla = fp8_gemv, then XLA's silu * up; NAME_asm = NAME's kernel with dequant="asm" (PRMT / LOP3 inline PTX,
kernels_pallas/_qdequant.py); int4_mgpu / int4_mgpu_asym / int4_mgpu_pc = the Mosaic GPU kernel on the nk layout
(_qmatmul_mgpu), int4 g128 sym / asym and per-channel sym (no group: any block_k, e.g. {"block_k": 256}).
--sweep adds kernel tilings of int4_sym (every dequant path: float, asm, asm_sub; --sweep-dequant picks) at
--sweep-m. --check first runs every CHECK_CASES kernel variant against the reference with each dequant path.
Timing: R = --reps calls chained in one jit, each on its own x and on rotating copies of the weight (>= 256 MB
together, so the weights come from HBM and not the 50 MB L2; distinct inputs, so XLA merges no two calls); the
time per call is the summed kernel time of an XProf trace of that chain (every kernel the call launches: the
kernel, the split-K sum, x's pad / quantization), as bench/kernels.py times its small calls; wall_us is the
chain's wall time per call (plus the dispatch of one jitted run). Effective bytes = the weight as stored (packed ints, scales, zeros) + x + the output.
Each quantized row also checks its output against the reference on the same inputs (rel_err).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.common import environment, write_result  # noqa: E402
from kernels_pallas._fp8_gemv import interleave_gate_up, silu_plan  # noqa: E402
from kernels_pallas._qmatmul import DEQUANT  # noqa: E402
from kernels_pallas.qlayout import QuantizedWeight, choose_plane, padded_k, per_word  # noqa: E402
from kernels_pallas.quant import (  # noqa: E402
    Fp8Rows,
    RowsWithMax,
    fp8_gemv,
    fp8_gemv_ref,
    fp8_gemv_silu,
    fp8_gemv_silu_ref,
    fp8_matmul,
    fp8_matmul_ref,
    quantize_activations,
    quantized_matmul,
    quantized_matmul_ref,
)

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
TINY_SHAPES = {"qkv": (512, 384), "o": (256, 256), "gate_up": (256, 512), "down": (768, 256)}
IMPLS = (
    "bf16",
    "int4_sym",
    "int4_asym",
    "int8",
    "int4_dequant",
    "fp8",
    "int4_sym_asm",
    "int4_asym_asm",
    "int8_asm",
    "fp8_w8a16",
    "int4_xla",
    "int4_mgpu",
    "int4_mgpu_asym",
    "int4_mgpu_pc",
    "fp8_widened",
    "fp8_res",
    "fp8_gemv",
    "fp8_gemv_res",
    "fp8_gemv_e4m3",
    "fp8_gemv_amax",
    "fp8_gemv_silu",
    "fp8_gemv_silu_e4m3",
    "fp8_gemv_silu_il",
    "fp8_gemv_silu_il_e4m3",
    "fp8_gemv_silu_split",
    "fp8_gemv_silu_split_e4m3",
    "fp8_gemv_silu_xla",
)
# rows of at most 2 (the decode bucket's) with a [2, N] bf16 residual in their weight tuple
TWO_ROW_IMPLS = ("fp8_res", "fp8_gemv", "fp8_gemv_res", "fp8_gemv_e4m3", "fp8_gemv_amax", "fp8_gemv_silu")
TWO_ROW_IMPLS += ("fp8_gemv_silu_e4m3", "fp8_gemv_silu_il", "fp8_gemv_silu_il_e4m3", "fp8_gemv_silu_xla")
TWO_ROW_IMPLS += ("fp8_gemv_silu_split", "fp8_gemv_silu_split_e4m3")
# fp8_gemv's forms of x (timed with x already in that form): e4m3 rows with their token scales (the add + norm pass
# writes them), x with K / 16 partial maxima a row (the silu kernel's pieces)
GEMV_X = {
    "fp8_gemv_e4m3": "e4m3",
    "fp8_gemv_amax": "amax",
    "fp8_gemv_silu_e4m3": "e4m3",
    "fp8_gemv_silu_il_e4m3": "e4m3",
    "fp8_gemv_silu_split_e4m3": "e4m3",
}
# fp8_gemv's tilings (--sweep; its default tiling is the row without cfg): (block_n, block_k, splits, warps, stages)
FP8_GEMV_SWEEP = [
    dict(block_n=bn, block_k=bk, splits=sp, num_warps=w, num_stages=st)
    for bn, bk, sp, w, st in (
        (64, 256, None, 4, 3),
        (32, 512, None, 4, 3),
        (16, 256, None, 4, 3),
        (32, 256, None, 4, 4),
        (32, 128, None, 4, 3),
        (32, 256, 8, 4, 3),
    )
]
# fp8_gemv_silu's tilings (--sweep with an fp8_gemv_silu impl): (block_n, block_k, warps, stages); its default
# (silu_plan) is 16 + 16 columns, 256-wide K tiles (128 for the split layout), 4 warps, 3 stages
FP8_SILU_SWEEP = [
    dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
    for bn, bk, w, st in (
        (16, 256, 4, 3),
        (32, 128, 4, 3),
        (32, 256, 8, 3),
        (16, 256, 8, 3),
        (16, 128, 4, 4),
        (16, 128, 2, 3),
        (32, 128, 8, 4),
        (64, 128, 8, 3),
    )
]
SWEEP = [
    dict(block_n=bn, splits=sp, plane_loop=loop, fma=fma, num_warps=w, num_stages=st)
    for bn, sp, loop, fma, w, st in (
        (64, None, False, True, 8, 3),
        (32, None, True, False, 4, 3),
        (64, None, True, False, 4, 3),
        (32, None, True, False, 4, 2),
        (128, None, False, False, 8, 3),
        (32, None, True, False, 8, 3),
        # more programs than plan()'s 2 an SM: at M = 16 four 123-register programs of 4 warps fit an SM, and
        # o / down / qkv launch only 0.5-0.7 of that (no program overlaps its own tiles' loads with its math)
        (64, 4, False, True, 8, 3),
        (32, 4, True, False, 4, 3),
        (32, 8, True, False, 4, 3),
    )
] + [  # larger row blocks for M >= 128 (--sweep-m 256): each weight tile dequantized once per block_m rows
    dict(block_m=bm, block_n=bn, plane_loop=True, fma=False, num_warps=w, num_stages=st)
    for bm, bn, w, st in ((128, 32, 4, 3), (128, 64, 8, 3), (256, 32, 8, 2))
]
# dequant="asm" (PRMT / LOP3 inline PTX, kernels_pallas/_qdequant.py; not measured yet): the FMA variant at M <= 4, the
# MMA variant at every M (with x's row copies loaded by row index it needs no padding to 8 rows)
SWEEP += [
    dict(dequant="asm", block_n=bn, plane_loop=loop, fma=fma, num_warps=w, num_stages=st)
    for bn, loop, fma, w, st in (
        (64, False, True, 8, 3),
        (32, True, False, 4, 3),
        (32, False, False, 4, 3),
        (32, False, False, 4, 2),  # unrolled planes: the asm writes the MMA's registers (no shared-memory trip)
        (64, True, False, 4, 3),
        (64, True, False, 8, 3),
    )
] + [  # the zero point subtracted in x's dtype instead of folded (fewer instructions from M ~ 32 on, by SASS counts)
    dict(dequant="asm_sub", block_n=bn, plane_loop=True, fma=False, num_warps=w, num_stages=3)
    for bn, w in ((32, 4), (64, 8))
]
# prefetch (float path): tile t + 1's weight words loaded into registers before tile t is dequantized. SASS (PyPI
# Triton 3.9, sm_90): neither variant's weight load is pipelined by Triton (no cp.async for it; only the MMA's x
# slice is), so each program waits a full DRAM latency per tile. With the FMA planes unrolled ptxas sinks the
# prefetch to the loop's end (128 registers, no overlap); with plane_loop the loads stay ahead of the plane loop
# (~156 registers: 3 programs of 4 warps per SM at BN 32, 16 KB each in flight during the dequantization)
SWEEP += [
    dict(prefetch=True, block_n=bn, plane_loop=loop, fma=fma, num_warps=w, num_stages=3)
    for bn, loop, fma, w in (
        (32, True, True, 4),
        (64, True, True, 8),
        (32, True, True, 8),
        (64, False, True, 8),
        (32, True, False, 4),
        (64, True, False, 4),
    )
]
ROTATE_BYTES = 256 << 20
MGPU_SWEEP = [  # _qmatmul_mgpu tilings (--sweep with an int4_mgpu impl; --mgpu-configs replaces them)
    dict(nw=1),
    dict(ctas_per_sm=4),
    dict(nw=1, ctas_per_sm=4),
    dict(stages=4),
    dict(ctas_per_sm=2),
    dict(sync_rows=0),  # wgmma at every row count (the default: per-warp mma.sync up to 16 rows, SYNC_ROWS)
] + [  # qmatmul_mgpu_wide (x's rows tiled; the default above 256 rows)
    dict(wide=True, tile_m=tm, block_k=bk, nw=nw)
    for tm, bk, nw in ((128, 128, 2), (128, 64, 2), (256, 64, 2), (64, 128, 2))
]


def copy_bw(nbytes, reps):
    """Read + write bytes/s of an XLA elementwise pass over a bf16 array of nbytes (chain difference)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(nbytes // 2, np.float32), jnp.bfloat16)

    def build(n):
        def f(x):
            for _ in range(n):
                x = jax.lax.optimization_barrier(x + jnp.bfloat16(1))
            return x

        return jax.jit(f)

    run = runner(build, x)
    t = per_call(run, reps)[0]
    for _ in range(3):  # a chain difference that noise made non-positive (a loaded CPU): longer chains
        if t > 0:
            break
        reps *= 4
        t = per_call(run, reps)[0]
    return 2 * x.size * 2 / t


def runner(build, *args):
    fns = {}

    def run(n):
        if n not in fns:
            fns[n] = build(n)
        jax.block_until_ready(fns[n](*args))

    return run


def per_call(run, reps, pairs=5):
    """(median, min, max) over `pairs` of (t(3 reps) - t(reps)) / (2 reps)."""
    run(reps)
    run(3 * reps)
    d = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        run(reps)
        t1 = time.perf_counter()
        run(3 * reps)
        t2 = time.perf_counter()
        d.append(((t2 - t1) - (t1 - t0)) / (2 * reps))
    return float(np.median(d)), float(np.min(d)), float(np.max(d))


def xprof_us(run, reps, runs=3):
    """Summed kernel time per call from an XProf trace, and the kernels (name, us per call)."""
    from bench.profile_summary import summarize

    run(reps)
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _ in range(runs):
            run(reps)
    s = summarize(d)
    ks = s["devices"][0]["top_kernels"] if s.get("devices") else []
    calls = runs * reps
    return sum(k["ms"] for k in ks) * 1e3 / calls, [(k["name"][:70], round(k["ms"] * 1e3 / calls, 2)) for k in ks]


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---- weights ---------------------------------------------------------------------------------------------------
def int_weight(key, K, N, bits, group_size, sym):
    """A random packed weight (every bit pattern is a valid layout), made on the device."""
    kq, ks, kz = jax.random.split(key, 3)
    plane = choose_plane(K, bits, group_size)
    kp = padded_k(K, bits, plane)
    words = jax.random.bits(kq, (kp // per_word(bits), N), jnp.uint32)
    words = jax.lax.bitcast_convert_type(words, jnp.int32)
    ng = 1 if group_size == -1 else kp // group_size
    scales = (jax.random.uniform(ks, (ng, N), jnp.float32, 0.5, 1.5) * 0.02 / (1 << (bits - 1))).astype(jnp.bfloat16)
    zeros = None if sym else jax.random.randint(kz, (ng, N), 0, 1 << bits).astype(jnp.bfloat16)
    return QuantizedWeight(words, scales, zeros, None, bits=bits, group_size=group_size, k=K, plane=plane)


def make_impl(name, K, N, key):
    """(call(x, w), w for one copy, bytes of one weight copy)."""
    if name == "bf16":
        w = (jax.random.normal(key, (K, N), jnp.float32) * 0.02).astype(jnp.bfloat16)
        return (lambda x, w: x @ w), w, K * N * 2
    if name.startswith("fp8"):  # one e4m3 weight [N, K] with per-channel scales
        w = (jax.random.normal(key, (N, K), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
        s = jax.random.uniform(key, (N,), jnp.float32, 0.5, 1.5) * 0.02 / 8
        if name in TWO_ROW_IMPLS:  # the _res rows add the [2, N] residual
            r = jax.random.normal(jax.random.fold_in(key, 7), (2, N), jnp.float32).astype(jnp.bfloat16)
            if name == "fp8_res":  # fp8_matmul (its default: widened up to 2 rows), then XLA's residual add
                return (lambda x, w: w[2][: x.shape[0]] + fp8_matmul(x, w[0], w[1])), (w, s, r), N * K + N * 4
            res = name == "fp8_gemv_res"
            if name.startswith("fp8_gemv_silu"):  # gate / up: [2F, K] -> silu(gate) * up [M, F]
                xla = name.endswith("_xla")
                if "_il" in name:  # the weight interleaved at load time for each block_n the sweep takes
                    r = {bn: interleave_gate_up(w, s, bn) for bn in (16, 32, 64) if (N // 2) % bn == 0}

                def silu(x, w, **cfg):
                    if xla:  # fp8_gemv's gate / up, then XLA's silu * up fusion (the decoder's path before)
                        gu = fp8_gemv(x, w[0], w[1], **cfg)
                        return jax.nn.silu(gu[:, : N // 2]) * gu[:, N // 2 :]
                    if isinstance(w[2], dict):
                        bn = cfg.get("block_n") or silu_plan(N // 2, K, layout="interleaved")[0]
                        return fp8_gemv_silu(x, *w[2][bn], layout="interleaved", **cfg).x
                    layout = "split" if "_split" in name else "paired"
                    return fp8_gemv_silu(x, w[0], w[1], layout=layout, **cfg).x

                return silu, (w, s, r), N * K + N * 4

            def gemv(x, w, **cfg):
                return fp8_gemv(x, w[0], w[1], residual=w[2][: x.shape[0]] if res else None, **cfg)

            return gemv, (w, s, r), N * K + N * 4
        if name != "fp8_w8a16":
            widen = name == "fp8_widened"
            return (lambda x, w: fp8_matmul(x, *w, widen=widen)), (w, s), N * K + N * 4

        def w8a16(x, w):
            wq, sc = w
            y = jax.lax.dot_general(x, wq.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            return (y * sc[None, :]).astype(x.dtype)

        return w8a16, (w, s), N * K + N * 4
    if name == "int4_xla":
        kq, ks = jax.random.split(key)
        q = jax.random.randint(kq, (K, N), -8, 8, jnp.int32).astype(jnp.int4)
        sc = (jax.random.uniform(ks, (K // 128, N), jnp.float32, 0.5, 1.5) * 0.02 / 8).astype(jnp.bfloat16)

        def int4_xla(x, w):
            q, sc = w
            dense = (q.astype(x.dtype).reshape(K // 128, 128, N) * sc[:, None, :]).reshape(K, N)
            return jnp.dot(x, dense, preferred_element_type=jnp.float32).astype(x.dtype)

        return int4_xla, (q, sc), K * N // 2 + sc.size * 2
    if name.startswith("int4_mgpu"):  # the Mosaic GPU kernel on the nk layout (_qmatmul_mgpu.nk_layout of planes)
        from kernels_pallas import _qmatmul_mgpu

        group = -1 if name == "int4_mgpu_pc" else 128
        w = int_weight(key, K, N, 4, group, name != "int4_mgpu_asym")
        nk = _qmatmul_mgpu.nk_layout(w.qweight, w.scales, w.zeros, plane=w.plane, dtype=jnp.bfloat16)

        def mgpu(x, w, **cfg):
            y = _qmatmul_mgpu.matmul(x, *w[1], group_size=group, **cfg)
            # partials: the rows-first [S, M, N] partials the decoder's split_k consumers take, summed here for the check
            return y.sum(0).astype(x.dtype) if cfg.get("partials") else y

        return (
            mgpu,
            (w, nk),
            sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(nk) if a.dtype != jnp.int4) + N * w.kp // 2,
        )
    bits, group, sym = dict(
        int4_sym=(4, 128, True), int4_asym=(4, 128, False), int8=(8, -1, True), int4_dequant=(4, 128, True)
    )[name.removesuffix("_asm")]
    w = int_weight(key, K, N, bits, group, sym)
    return None, w, w.nbytes


def reference(name, x, w):
    if name == "bf16":
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    if name in ("fp8", "fp8_widened"):
        return fp8_matmul_ref(x, *w)
    if name.startswith("fp8_gemv_silu"):
        return fp8_gemv_silu_ref(x, w[0], w[1]).x
    if name in TWO_ROW_IMPLS:
        return fp8_gemv_ref(x, w[0], w[1], residual=w[2][: x.shape[0]] if name.endswith("res") else None)
    if name == "fp8_w8a16":
        return jnp.dot(x.astype(jnp.float32), w[0].astype(jnp.float32).T) * w[1][None, :]
    if name == "int4_xla":
        q, sc = w
        K, N = q.shape
        dense = q.astype(jnp.float32).reshape(K // 128, 128, N) * sc.astype(jnp.float32)[:, None, :]
        return jnp.dot(x.astype(jnp.float32), dense.reshape(K, N))
    if name.startswith("int4_mgpu"):
        return quantized_matmul_ref(x, w[0])
    return quantized_matmul_ref(x, w)


def gemv_x(name, x):
    """x as impl `name` takes it: Fp8Rows (e4m3 and token scales) or RowsWithMax (K / 16 partial maxima a row) for
    GEMV_X's rows, else x."""
    form = GEMV_X.get(name)
    if form == "e4m3":
        return Fp8Rows(*quantize_activations(x), x.dtype)
    if form == "amax":
        M, K = x.shape
        return RowsWithMax(x, jnp.abs(x.astype(jnp.float32)).reshape(M, K // 16, 16).max(-1))
    return x


def measure(row, call, xs, ws, nbytes, copy, args):
    """Times call(x_i, w_i) over distinct inputs x_i and the rotating weight copies ws into row: the summed kernel
    time per call of an XProf trace of `reps` chained calls (each call's inputs differ, so XLA can merge none),
    and the chain's wall time per call (which adds the dispatch of one jitted run)."""

    def build(n):
        def f(xs, ws):
            return [call(xs[i], ws[i % len(ws)]) for i in range(n)]

        return jax.jit(f)

    run = runner(build, xs[: args.reps], ws)
    run(args.reps)
    walls = []
    for _ in range(1 if args.tiny else 5):  # --tiny: the Mosaic GPU interpreter's calls take seconds; one is a figure
        t0 = time.perf_counter()
        run(args.reps)
        walls.append((time.perf_counter() - t0) / args.reps)
    row["wall_us"] = float(np.median(walls)) * 1e6
    t = row["wall_us"] * 1e-6
    if not args.tiny:
        us, kernels = xprof_us(run, args.reps)
        if us:
            row.update(time_us=us, timing="xprof", kernels=kernels)
            t = us * 1e-6
    row.setdefault("time_us", t * 1e6)
    row.update(bytes=nbytes, bytes_per_s=nbytes / t, frac_copy=nbytes / t / copy)


def bench_shape(shape, K, N, ms, impls, copy, args, rows, sweep):
    sweep_m = [int(m) for m in args.sweep_m.split(",")]
    key = jax.random.key(list(SHAPES).index(shape))
    for name in impls:
        call, w0, wbytes = make_impl(name, K, N, key)
        # >= reps copies: no two calls of a chain share a weight (XLA would merge their dots into one GEMM)
        copies = 2 if args.tiny else max(args.reps, -(-ROTATE_BYTES // wbytes))
        ws = [w0] + [make_impl(name, K, N, jax.random.fold_in(key, i))[1] for i in range(1, copies)]
        configs = [{}] + (sweep if sweep and name == "int4_sym" else [])
        if name.startswith("int4_mgpu") and sweep:
            configs += json.loads(args.mgpu_configs) if args.mgpu_configs else MGPU_SWEEP
        if name == "fp8_gemv" and sweep:
            fp8_sweep = json.loads(args.fp8_gemv_configs) if args.fp8_gemv_configs else FP8_GEMV_SWEEP
            configs += [c for c in fp8_sweep if K % c.get("block_k", 128) == 0 and N % c.get("block_n", 16) == 0]
        if name.startswith("fp8_gemv_silu") and not name.endswith("_xla") and sweep:
            silu_sweep = json.loads(args.fp8_silu_configs) if args.fp8_silu_configs else FP8_SILU_SWEEP
            configs += [c for c in silu_sweep if K % c["block_k"] == 0 and (N // 2) % c["block_n"] == 0]
        for M in ms:
            if name in TWO_ROW_IMPLS and M > 2:
                continue  # the fused GEMV takes the decode bucket's 1-2 rows
            xs = [
                jax.random.normal(jax.random.fold_in(key, 1000 * M + i), (M, K), jnp.float32).astype(jnp.bfloat16)
                for i in range(args.reps)
            ]
            want = reference(name, xs[0], w0)
            xs = [gemv_x(name, x) for x in xs]
            x = xs[0]
            for cfg in configs:
                if cfg and (
                    M not in sweep_m
                    or shape not in args.sweep_shapes.split(",")
                    or (cfg.get("fma") and M > 4)
                    or M % cfg.get("block_m", 1)
                    or cfg.get("dequant", "float") not in args.sweep_dequant.split(",")
                ):
                    continue
                row = dict(shape=shape, K=K, N=N, M=M, impl=name, copies=copies, cfg=cfg)
                try:
                    tuned = name.startswith(("fp8_gemv", "int4_mgpu"))
                    fn = functools.partial(call, interpret=args.tiny, **cfg) if tuned else call
                    if fn is None:
                        backend = "dequant" if name == "int4_dequant" else "kernel"
                        kw = dict(dequant="asm") if name.endswith("_asm") else {}
                        fn = functools.partial(quantized_matmul, backend=backend, interpret=args.tiny, **kw, **cfg)
                    got = jax.jit(fn)(x, w0)
                    row["rel_err"] = rel_err(got, want)
                    row["finite"] = bool(np.isfinite(np.asarray(got, np.float32)).all())
                    nbytes = wbytes + M * K * 2 + M * N * 2
                    measure(row, jax.jit(fn), xs, ws, nbytes, copy, args)
                    if args.hlo_dir and name in ("fp8", "int4_dequant", "fp8_w8a16", "int4_xla") and M in (1, 16, 256):
                        with open(os.path.join(args.hlo_dir, f"{shape}_{name}_M{M}.hlo.txt"), "w") as f:
                            f.write(jax.jit(fn).lower(x, w0).compile().as_text())
                except Exception as e:  # noqa: BLE001 - one failing row must not end the run
                    row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                    traceback.print_exc()
                rows.append(row)
                print(
                    json.dumps(
                        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "kernels"}
                    ),
                    flush=True,
                )
        ws = w0 = None  # frees this impl's copies before the next


CHECK_CASES = [  # (K, N, M, bits, group_size, sym, act_order): every kernel variant against the reference
    (576, 1536, 1, 4, 32, True, False),
    (576, 1536, 3, 4, 64, False, False),
    (576, 960, 16, 8, -1, True, False),
    (4096, 4096, 1, 4, 128, False, False),
    (4096, 4096, 2, 4, 32, True, True),
    (4096, 4096, 8, 4, -1, False, False),
    (4096, 4096, 64, 4, 128, True, False),
    (4096, 4096, 128, 4, 128, False, False),
    (1024, 512, 33, 8, 128, False, False),
    (1024, 512, 4, 8, 64, True, False),
    (14336, 4096, 16, 4, 128, True, False),
    (4096, 6144, 1, 8, -1, True, False),
]


def check(rows, tiny):
    """The kernel (forced) against quantized_matmul_ref on weights quantized from random floats, and both against
    the float weight's product: lowering and numerics of every variant on this device."""
    from kernels_pallas.qlayout import pack_quantized, quantize_weight

    rng = np.random.default_rng(0)
    cases = CHECK_CASES[:3] if tiny else CHECK_CASES
    for (K, N, M, bits, G, sym, act), dequant in [(c, d) for d in DEQUANT for c in cases]:
        row = dict(stage="check", K=K, N=N, M=M, bits=bits, group_size=G, sym=sym, act_order=act, dequant=dequant)
        try:
            wf = rng.standard_normal((K, N)).astype(np.float32) * 0.02
            q, s, z = quantize_weight(wf, bits=bits, group_size=G, sym=sym)
            g_idx = rng.permutation(np.arange(K) // G) if act else None
            if act:  # the checkpoint's rows in act-order: group g_idx[k]; same float weight
                q, s2, z2 = quantize_weight(wf[np.argsort(g_idx, kind="stable")], bits=bits, group_size=G, sym=sym)
                inv = np.argsort(np.argsort(g_idx, kind="stable"))
                q, s, z = q[inv], s2, z2
            w = pack_quantized(q, s, z, bits=bits, group_size=G, g_idx=g_idx, dtype=jnp.bfloat16)
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
            got = jax.jit(functools.partial(quantized_matmul, backend="kernel", interpret=tiny, dequant=dequant))(x, w)
            ref = quantized_matmul_ref(x, w)
            dense = jnp.dot(x.astype(jnp.float32), jnp.asarray(wf))
            row.update(
                rel_err=rel_err(got, ref),
                ref_vs_float=rel_err(ref, dense),
                kernel_vs_float=rel_err(got, dense),
                finite=bool(np.isfinite(np.asarray(got, np.float32)).all()),
                shape=list(got.shape),
            )
            row["ok"] = row["finite"] and row["rel_err"] < 1e-2 and tuple(got.shape) == (M, N)
        except Exception as e:  # noqa: BLE001 - one failing case must not end the run
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:600]}")
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)


def summary(rows):
    """One line per (shape, M): each impl's time and fraction of copy (default config rows)."""
    out = {}
    for r in rows:
        if r.get("cfg") or "time_us" not in r or r.get("stage") == "check":
            continue
        out.setdefault(f"{r['shape']} M={r['M']}", {})[r["impl"]] = (round(r["time_us"], 2), round(r["frac_copy"], 3))
    return out


def bench_silu(ms, F, configs, copy, reps, rows, interpret=False):
    """fp8_silu_mlp's middle stage at M rows: the gate / up GEMM's unscaled bfloat16 product [M, 2, F] times its
    token and channel scales, silu * up, rounded to e4m3 per token: XLA's fusions of silu_mul_fp8_ref ("silu_xla")
    against the Pallas pass (_silu_mul_fp8.py, "silu_kernel" with each tuning in configs). Bytes: the product read
    once, the e4m3 values written."""
    from kernels_pallas import _silu_mul_fp8, quant

    for M in ms:
        key = jax.random.key(M)
        copies = max(2, -(-(256 << 20) // (M * 2 * F * 2)))  # rotating inputs: >= 256 MB, out of L2
        gus = [jax.random.normal(jax.random.fold_in(key, i), (M, 2, F), jnp.bfloat16) * 8 for i in range(copies)]
        rs = jax.random.uniform(key, (M, 1), jnp.float32, 0.01, 0.1)
        cs = jax.random.uniform(key, (2, F), jnp.float32, 0.001, 0.01)
        want = quant.silu_mul_fp8_ref(gus[0], rs, cs)
        variants = [("silu_xla", {}, quant.silu_mul_fp8_ref)] + [
            (
                "silu_kernel",
                cfg,
                functools.partial(
                    _silu_mul_fp8.silu_mul_fp8_kernel, min_scale=quant.FP8_MIN_SCALE, interpret=interpret, **cfg
                ),
            )
            for cfg in configs
        ]
        for name, cfg, fn in variants:

            def build(n, fn=fn, rs=rs, cs=cs):
                def f(xs):
                    return [fn(jax.lax.optimization_barrier(xs[i % len(xs)]), rs, cs) for i in range(n)]

                return jax.jit(f)

            try:
                got = jax.jit(fn)(gus[0], rs, cs)
                bad = int((np.asarray(got[0], np.float32) != np.asarray(want[0], np.float32)).sum())
                run = runner(build, gus)
                us = xprof_us(run, reps)[0] if not interpret else float("nan")
                nbytes = M * 2 * F * 2 + M * F
                row = dict(
                    stage="silu_fp8",
                    M=M,
                    F=F,
                    impl=name,
                    cfg=cfg,
                    time_us=round(us, 2),
                    mismatches=bad,
                    frac_copy=round(nbytes / (us * 1e-6) / copy, 3) if copy else None,
                )
            except Exception as e:  # noqa: BLE001 - a tuning that does not compile is a row, not the end of the run
                row = dict(stage="silu_fp8", M=M, F=F, impl=name, cfg=cfg, error=repr(e)[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)


def bench_add_norm(splits, ms, D, configs, reps, rows, interpret=False):
    """The decoder's residual add of o / down's split-K partials [S, M, D] (float32) and the RMSNorm after it: XLA's
    fusions of add_rms_norm_ref ("add_norm_xla") against the Pallas pass (_add_rms_norm.py, "add_norm_kernel" with
    each tuning in configs). The partials are few MB at most, so they sit in L2 as in the decode step, where the
    projection has just written them."""
    from kernels_pallas import _add_rms_norm, quant

    for S in splits:
        for M in ms:
            key = jax.random.key(1000 * S + M)
            xs = [jax.random.normal(jax.random.fold_in(key, i), (M, D), jnp.bfloat16) for i in range(2)]
            ps = [jax.random.normal(jax.random.fold_in(key, 10 + i), (S, M, D), jnp.float32) for i in range(2)]
            w = jnp.ones((D,), jnp.bfloat16)
            want = quant.add_rms_norm_ref(xs[0], ps[0], w, 1e-5)
            variants = [("add_norm_xla", {}, functools.partial(quant.add_rms_norm_ref, eps=1e-5))] + [
                (
                    "add_norm_kernel",
                    cfg,
                    functools.partial(_add_rms_norm.add_rms_norm_kernel, eps=1e-5, interpret=interpret, **cfg),
                )
                for cfg in configs
            ]
            for name, cfg, fn in variants:

                def build(n, fn=fn, w=w):
                    def f(xa, pa):
                        return [
                            fn(jax.lax.optimization_barrier(xa[i % 2]), jax.lax.optimization_barrier(pa[i % 2]), w)
                            for i in range(n)
                        ]

                    return jax.jit(f)

                try:
                    got = jax.jit(fn)(xs[0], ps[0], w)
                    bad = sum(
                        int((np.asarray(g, np.float32) != np.asarray(t, np.float32)).sum()) for g, t in zip(got, want)
                    )
                    us, kernels = xprof_us(runner(build, xs, ps), reps) if not interpret else (float("nan"), [])
                    row = dict(stage="add_norm", S=S, M=M, D=D, impl=name, cfg=cfg, time_us=round(us, 2))
                    row.update(mismatches=bad, kernels=kernels)
                except Exception as e:  # noqa: BLE001 - a tuning that does not compile is a row, not the end of the run
                    row = dict(stage="add_norm", S=S, M=M, D=D, impl=name, cfg=cfg, error=repr(e)[:300])
                rows.append(row)
                print(json.dumps(row), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--m", default="1,2,4,8,16,32,64,256")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--sweep", action="store_true", help="int4_sym kernel tilings at --sweep-m")
    p.add_argument("--sweep-m", default="1,16,64")
    p.add_argument(
        "--mgpu-configs", default=None, help="int4_mgpu's sweep entries as a JSON list (replaces MGPU_SWEEP)"
    )
    p.add_argument(
        "--fp8-gemv-configs", default=None, help="fp8_gemv's sweep entries as a JSON list (replaces FP8_GEMV_SWEEP)"
    )
    p.add_argument(
        "--fp8-silu-configs",
        default=None,
        help="fp8_gemv_silu's sweep entries as a JSON list (replaces FP8_SILU_SWEEP)",
    )
    p.add_argument("--sweep-shapes", default=",".join(SHAPES))
    p.add_argument("--sweep-dequant", default="float,asm,asm_sub", help="the sweep's entries with these dequant paths")
    p.add_argument(
        "--configs",
        default=None,
        help="the sweep's entries as a JSON list of qmatmul tunings instead of SWEEP, e.g. '[{\"splits\": 4}]'",
    )
    p.add_argument("--check", action="store_true", help="first, every kernel variant against the reference")
    p.add_argument("--no-bench", action="store_true", help="only the --check stage")
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="calls per timed chain (default 10; 1 with --tiny: the Mosaic GPU interpreter takes seconds a call)",
    )
    p.add_argument("--hlo-dir", default=None, help="write the optimized HLO of the fp8 / dequant calls here")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes, interpret mode")
    p.add_argument("--silu-m", default=None, help="only fp8_silu_mlp's silu * up stage at these M (bench_silu)")
    p.add_argument("--silu-configs", default="[{}]", help="its kernel tunings, a JSON list")
    p.add_argument(
        "--add-norm-splits", default=None, help="only the residual add + norm pass at these S (bench_add_norm)"
    )
    p.add_argument("--add-norm-configs", default="[{}]", help="its kernel tunings, a JSON list")
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 1 if args.tiny else 10
    if args.add_norm_splits:
        rows: list = []
        splits = [int(x) for x in args.add_norm_splits.split(",")]
        D = 256 if args.tiny else 4096
        bench_add_norm(
            splits,
            [int(m) for m in args.m.split(",")],
            D,
            json.loads(args.add_norm_configs),
            args.reps,
            rows,
            args.tiny,
        )
        write_result("quant_kernels", dict(env=environment(), rows=rows), args.out)
        return rows
    if args.silu_m:
        rows = []
        copy = copy_bw(1 << 20 if args.tiny else 1 << 29, args.reps)
        F = 256 if args.tiny else 14336
        ms = [int(m) for m in args.silu_m.split(",")]
        bench_silu(ms, F, json.loads(args.silu_configs), copy, args.reps, rows, interpret=args.tiny)
        write_result("quant_kernels", dict(env=environment(), copy_bytes_per_s=copy, rows=rows), args.out)
        return rows
    shapes = TINY_SHAPES if args.tiny else SHAPES
    ms = [int(m) for m in args.m.split(",")]
    impls = args.impls.split(",")
    for name in impls:
        if name not in IMPLS:
            raise SystemExit(f"unknown impl {name!r}; choose from {IMPLS}")
    rows, copy = [], None
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
    if args.check:
        check(rows, args.tiny)
    if not args.no_bench:
        copy = copy_bw(1 << 20 if args.tiny else 1 << 29, args.reps)
        print(f"copy {copy / 1e12:.3f} TB/s", flush=True)
        for shape in args.shapes.split(","):
            K, N = shapes[shape]
            sweep = (json.loads(args.configs) if args.configs else SWEEP) if args.sweep else []
            bench_shape(shape, K, N, ms, impls, copy, args, rows, sweep)
    result = dict(env=environment(), copy_bytes_per_s=copy, rows=rows, summary=summary(rows))
    for k, v in result["summary"].items():
        print(k, v, flush=True)
    write_result("quant_kernels", result, args.out)
    return result


if __name__ == "__main__":
    main()
