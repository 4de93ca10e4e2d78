"""Benchmarks of kernels_pallas on one GPU: decode, ragged prefill, KV write, ceilings measured in the same run.

  python bench/kernels.py --out bench/results/kernels_<device>.json [--sweep]
      [--only ceil,tune,causal,combine,inflight,waves,mgpu_decode,mgpu_xprof,decode_backend,pool,goal,b1,decode,prefill,mgpu,write,qkv,fused,fused_engine,fused_sweep,fp8_decode,mixed,backend,trace,profile]
  stages: tune = current defaults vs their predecessors and neighbours; qkv = the fused qkv/RoPE/KV-write
  kernel vs XLA RoPE + the write kernel; fused = the fused decode kernel (RoPE + KV write + attention) vs the
  qkv/RoPE/write kernel then the decode kernel (Triton, and Mosaic GPU on Hopper), at the engine's decode shapes;
  fused_engine = the same at the offline run's decode steps (varied lengths, the engine's KV pool);
  fused_sweep = the fused kernel vs the write then the Mosaic GPU kernel over 512-4k contexts x 1-64 rows; mixed = mixed prefill + decode
  steps through the entry point with and without split_decode; trace = an XProf split of a decode call (kernel
  vs the ops around it, written to <out>_trace.json); profile = one launch per goal shape for ncu; causal =
  the ragged prefill defaults vs the previous tiles plus an XProf split of the goal-shape call; combine =
  XProf times of the split-K combine's tilings at B1 x 32k; pool = B1 x 32k with the engine's padding row
  and KV pool size; inflight = decode configs with more KV bytes in
  flight; b1 = decode configs over the engine's padded batch-1 as it was before stop 17 (8 sequences, 1 live;
  2 since).

Each timed call is chained inside one jit (the output feeds the next call's q), so XLA cannot fold
repeats, and the time per call is the difference of two chain lengths, (t(3 REPS) - t(REPS)) / 2 REPS:
the fixed cost of dispatching and syncing one jitted run (0.15-0.3 ms on the H100 machine, measured by
an XProf trace: a B1 x 32k call spans 57.7 us on the GPU while wall / REPS gave 72 us) cancels. The
median of 5 such pairs is kept; `wall_us` keeps the older wall / REPS figure for comparison. Calls under
20 us, where that difference is inside its own noise, take the summed kernel time of an XProf trace
instead (`timing: "xprof"`, with the chain figure kept as `chain_us`).
Effective bytes for attention = KV read once (sum of context lengths * K * H * 2 * itemsize) + q + out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels_pallas import reference  # noqa: E402
from kernels_pallas._common import on_hopper  # noqa: E402
from kernels_pallas._decode import fused_decode_attention_kernel, paged_decode_attention_kernel  # noqa: E402
from kernels_pallas._decode_mgpu import paged_decode_mgpu  # noqa: E402
from kernels_pallas._prefill_mgpu import ragged_prefill_mgpu
from kernels_pallas._ragged import ragged_paged_attention_kernel  # noqa: E402
from kernels_pallas._write import qkv_write_kv_kernel, write_kv_kernel  # noqa: E402

REPS = 10
TINY_S = 20e-6  # calls shorter than this are timed from an XProf trace (see _measure)


def per_call(run, runs=5):
    """Seconds per call: run(n) executes n chained calls once and waits. Returns (median, min, max) of
    (t(3 REPS) - t(REPS)) / (2 REPS) over `runs` pairs, and the median of t(REPS) / REPS (wall)."""
    run(REPS)
    run(3 * REPS)
    diff, wall = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        run(REPS)
        t1 = time.perf_counter()
        run(3 * REPS)
        t2 = time.perf_counter()
        diff.append(((t2 - t1) - (t1 - t0)) / (2 * REPS))
        wall.append((t1 - t0) / REPS)
    return float(np.median(diff)), float(np.min(diff)), float(np.max(diff)), float(np.median(wall))


def runner(build, *args, state=None):
    """run(n): executes build(n) (a jitted function chaining n calls, compiled once per n) on args and waits.
    With state (a list of donated buffers, e.g. KV pages), build(n) takes (*state, *args) and returns the
    new state, which replaces the old one in place."""
    fns = {}

    def run(n):
        if n not in fns:
            fns[n] = build(n)
        if state is None:
            jax.block_until_ready(fns[n](*args))
        else:
            state[:] = fns[n](*state, *args)
            jax.block_until_ready(state)

    return run


def timeit(build, *args, runs=5):
    """per_call for build(n) -> a jitted function of args that chains n calls."""
    return per_call(runner(build, *args), runs)


def xprof_us(run, runs=3):
    """GPU time per call from an XProf trace: the kernels' summed durations (gaps between them excluded) over
    `runs` executions of run(REPS), per call, and the per-kernel summary. For calls of a few us, where
    the difference of two chain lengths is within its own noise (negative minima)."""
    import tempfile

    from bench.profile_summary import summarize

    run(REPS)
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _ in range(runs):
            run(REPS)
    summary = summarize(d)
    kernels = summary["devices"][0]["top_kernels"] if summary.get("devices") else []
    return sum(k["ms"] for k in kernels) * 1e3 / (runs * REPS), summary


def time_row(row, run):
    """Times run (per_call) into row's time fields; calls under TINY_S from XProf (tiny_xprof). Returns the
    seconds per call the row's rates use."""
    t, tmin, tmax, wall = per_call(run)
    row.update(time_us=t * 1e6, time_min_us=tmin * 1e6, time_max_us=tmax * 1e6, wall_us=wall * 1e6)
    return tiny_xprof(row, run, t)


def tiny_xprof(row, run, t):
    """Calls under TINY_S: the row's time becomes the XProf kernel time (the chain figure kept as chain_us)."""
    if t >= TINY_S:
        return t
    us, summary = xprof_us(run)
    if not us:  # no device kernels in the trace (e.g. on CPU): keep the chain figure
        return t
    row.update(
        chain_us=t * 1e6,
        time_us=us,
        timing="xprof",
        kernels=[(k["name"][:60], round(k["us_per_run"], 2)) for k in summary["devices"][0]["top_kernels"][:4]]
        if summary.get("devices")
        else [],
    )
    return us * 1e-6


def xprof_row(results, row, call, args, nbytes, copy):
    """Times call both ways (chain difference and XProf kernel time per call, see xprof_us) into row, with
    each figure's fraction of the copy ceiling, and appends it (with the error instead, if it fails)."""
    try:
        run = runner(chained(call), *args)
        t = time_row(row, run)
        us, summary = xprof_us(run)
        row.update(
            kernel_us=us,
            kernel_frac_copy=nbytes / (us * 1e-6) / copy,
            frac_copy=nbytes / t / copy,
            bytes_per_s=nbytes / t,
            kernels={x["name"][:40]: round(x["us_per_run"], 2) for x in summary["devices"][0]["top_kernels"]},
        )
    except Exception as e:  # noqa: BLE001 - one failing row must not end the run
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    results.append(row)
    print(json.dumps(row), flush=True)


def chained(call):
    """build(n) for timeit: jit(lambda q, *rest: n chained calls, q <- out)."""

    def build(n):
        def f(q, *rest):
            for _ in range(n):
                q = call(q, *rest)
            return q

        return jax.jit(f)

    return build


def copy_bw():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1 << 28,), np.float32)).astype(jnp.bfloat16)  # 512MB

    def build(n):
        def f(x):
            for _ in range(n):  # the barrier keeps XLA from fusing the passes into one
                x = jax.lax.optimization_barrier(x + jnp.bfloat16(1))  # (x * 1.0001 rounds to x * 1 in bf16)
            return x

        return jax.jit(f)

    t = timeit(build, x)[0]
    return 2 * x.size * 2 / t


def matmul_rate(n=8192):
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((n, n), np.float32), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((n, n), np.float32) / np.sqrt(n), jnp.bfloat16)

    def build(m):
        def f(a, b):
            for _ in range(m):
                a = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            return a

        return jax.jit(f)

    t = timeit(build, a, b)[0]
    return 2 * n**3 / t


def make_case(
    B,
    ctx,
    N=32,
    K=8,
    H=128,
    S=16,
    dtype=jnp.bfloat16,
    kv_dtype=None,
    q_per_seq=1,
    seed=0,
    total_pages=None,
    max_len=None,
):
    """Random paged cache with shuffled block tables; unused pages hold NaN (checks the kernels skip them).
    max_len: the block tables' width in tokens (the engine's max_model_len) when it exceeds ctx."""
    rng = np.random.default_rng(seed)
    kv_dtype = kv_dtype or dtype
    M = -(-ctx // S)
    P = total_pages or B * M + 8
    perm = rng.permutation(P)[: B * M].reshape(B, M).astype(np.int32)
    if max_len and -(-max_len // S) > M:
        perm = np.concatenate([perm, rng.integers(0, P, (B, -(-max_len // S) - M), np.int32)], axis=1)
    k = jax.random.normal(jax.random.PRNGKey(seed), (K, P, S, H), jnp.float32)
    v = jax.random.normal(jax.random.PRNGKey(seed + 1), (K, P, S, H), jnp.float32)
    unused = np.ones(P, bool)
    unused[perm.ravel()] = False
    nanmask = jnp.asarray(unused)[None, :, None, None]
    k = jnp.where(nanmask, jnp.nan, k).astype(kv_dtype)
    v = jnp.where(nanmask, jnp.nan, v).astype(kv_dtype)
    T = B * q_per_seq
    q = jax.random.normal(jax.random.PRNGKey(seed + 2), (T, N, H), jnp.float32).astype(dtype)
    lens = jnp.full((B,), ctx, jnp.int32)
    qsl = jnp.arange(B + 1, dtype=jnp.int32) * q_per_seq
    return q, k, v, lens, qsl, jnp.asarray(perm)


def rel_err(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bench_decode(
    results,
    B,
    ctx,
    copy,
    label,
    configs,
    S=16,
    K=8,
    N=32,
    H=128,
    kv_dtype=None,
    shipped=True,
    check=True,
    max_len=None,
    impl="pallas_triton",
    fn=paged_decode_attention_kernel,
):
    q, k, v, lens, qsl, bt = make_case(B, ctx, N=N, K=K, H=H, S=S, kv_dtype=kv_dtype, max_len=max_len)
    scale = H**-0.5
    nbytes = B * ctx * K * H * 2 * jnp.dtype(k.dtype).itemsize + 2 * q.size * q.dtype.itemsize  # KV + q + out
    bandwidth = lambda t: dict(bytes_per_s=nbytes / t, frac_copy=nbytes / t / copy)  # noqa: E731
    ref = None
    if check:
        ref = reference.paged_decode_attention_ref(q, k, v, lens, bt, scale=scale, pages_per_step=64)
    for cfg in configs:
        row = dict(
            kind="decode",
            label=label,
            B=B,
            ctx=ctx,
            N=N,
            K=K,
            H=H,
            S=S,
            kv_dtype=str(jnp.dtype(k.dtype)),
            impl=impl,
            cfg=cfg,
        )
        call = lambda q, k, v, lens, bt, cfg=cfg: fn(  # noqa: E731
            q, k, v, lens, bt, scale=scale, **cfg
        )
        _measure(results, row, call, (q, k, v, lens, bt), ref, bandwidth)
    if shipped:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        row = dict(
            kind="decode",
            label=label,
            B=B,
            ctx=ctx,
            N=N,
            K=K,
            H=H,
            S=S,
            kv_dtype=str(jnp.dtype(k.dtype)),
            impl="jax_shipped_paged_attention",
            cfg=dict(block_h=16, pages_per_compute_block=8, k_splits=16),
        )
        call = lambda q, k, v, lens, bt: paged_attention(q * jnp.asarray(scale, q.dtype), k, v, bt, lens)  # noqa: E731
        _measure(results, row, call, (q, k, v, lens, bt), ref, bandwidth)


# the fp8_decode stage's configs for fp8 pages (the default first). Per the SASS of PyPI Triton 3.9 (sm_90):
# default (block_k 32, 4 warps) 163 registers -> 3 programs an SM, 8 KB of K + V a block; num_warps 8: 116
# registers, 2 programs of 8 warps; block_k 16: 116 registers, 4 KB a block; block_k 64: 222 registers (2 programs)
FP8_DECODE_CONFIGS = [
    dict(),
    dict(num_warps=8),
    dict(block_k=64, num_warps=8),
    dict(block_k=16),
    dict(block_k=64),
    dict(prefetch=1),
    dict(prefetch=3),
]


def bench_engine_like(
    results,
    copy,
    label,
    B=512,
    ctx=600,
    live=None,
    jitter=0,
    max_len=None,
    total_pages=None,
    K=8,
    H=128,
    configs=({},),
    fn=paged_decode_attention_kernel,
    kv_dtype=None,
):
    """Decode over a batch like the engine's: `live` sequences with lengths ctx - jitter .. ctx, the rest
    padding (length 0); one row per kernel config. kv_dtype: the pages' (default the model's bfloat16)."""
    q, k, v, lens, _, bt = make_case(B, ctx, K=K, H=H, max_len=max_len, total_pages=total_pages, kv_dtype=kv_dtype)
    live = B if live is None else live
    rng = np.random.default_rng(4)
    lens = np.zeros(B, np.int32)
    lens[:live] = ctx - rng.integers(0, jitter + 1, live)
    lens = jnp.asarray(lens)
    nbytes = int(lens.sum()) * K * H * 2 * k.dtype.itemsize + 2 * live * q.shape[1] * H * 2
    ref = reference.paged_decode_attention_ref(q, k, v, lens, bt, scale=H**-0.5, pages_per_step=64)[:live]
    for cfg in configs:
        row = dict(
            kind="decode",
            label=f"engine_like_{label}",
            B=B,
            ctx=ctx,
            live=live,
            jitter=jitter,
            table_pages=int(bt.shape[1]),
            kv_dtype=str(k.dtype),
            total_pages=int(k.shape[1]),
            impl="pallas_triton" if fn is paged_decode_attention_kernel else fn.__name__,
            cfg=cfg,
        )
        call = lambda q, k, v, lens, bt, cfg=cfg: fn(  # noqa: E731
            q, k, v, lens, bt, scale=H**-0.5, **cfg
        )
        try:  # padding sequences (length 0) have no defined output: compare the live ones
            row["rel_err"] = rel_err(call(q, k, v, lens, bt)[:live], ref)
        except Exception as e:  # noqa: BLE001 - _measure records the failure
            row["rel_err_error"] = str(e)[:200]
        _measure(
            results,
            row,
            call,
            (q, k, v, lens, bt),
            None,
            lambda t: dict(bytes_per_s=nbytes / t, frac_copy=nbytes / t / copy),
        )


def _measure(results, row, call, args, ref, rates):
    """Checks call against ref, times it, and appends the row (with the error instead, if it fails);
    rates(t) gives the row's rate fields for t seconds per call."""
    try:
        if ref is not None:
            row["rel_err"] = rel_err(call(*args), ref)
        row.update(**rates(time_row(row, runner(chained(call), *args))))
    except Exception as e:  # noqa: BLE001 - one failing config must not end the sweep
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    results.append(row)
    print(json.dumps(row), flush=True)


def matmul_rates(flops, mm_rate):
    return lambda t: dict(tflops=flops / t / 1e12, frac_matmul=flops / t / mm_rate)


def bench_prefill(
    results, chunk, prefix, mm_rate, label, configs, N=32, K=8, H=128, S=16, check=True, impl="pallas_triton"
):
    ctx = prefix + chunk
    q, k, v, _, _, bt = make_case(1, ctx, N=N, K=K, H=H, S=S, q_per_seq=chunk)
    lens = jnp.array([ctx], jnp.int32)
    qsl = jnp.array([0, chunk], jnp.int32)
    scale = H**-0.5
    # causal: query j (position prefix + j) sees prefix + j + 1 keys; QK^T and PV are 2 flops per MAC each
    keys = prefix * chunk + chunk * (chunk + 1) / 2
    flops = 4 * N * H * keys
    ref = None
    if check:
        ref = reference.ragged_paged_attention_ref(q, k, v, lens, qsl, bt, scale=scale, pages_per_step=16)
    for cfg in configs:
        row = dict(kind="prefill", label=label, chunk=chunk, prefix=prefix, N=N, K=K, H=H, S=S, impl=impl, cfg=cfg)
        fn = ragged_prefill_mgpu if impl == "mosaic_gpu" else ragged_paged_attention_kernel
        call = functools.partial(fn, scale=scale, **cfg)
        _measure(results, row, call, (q, k, v, lens, qsl, bt), ref, matmul_rates(flops, mm_rate))


WRITE_IMPLS = {
    "xla_scatter": reference.write_kv,
    "pallas": write_kv_kernel,
}


def bench_write(results, T, copy, impl, K=8, H=128, S=16, P=16384, kv_dtype=jnp.bfloat16):
    """REPS chained writes in one jit with the cache donated (as in the engine's step); both caches."""
    rng = np.random.default_rng(3)
    write = WRITE_IMPLS[impl]
    kp = jnp.full((K, P, S, H), jnp.nan, jnp.float32).astype(kv_dtype)
    vp = jnp.full((K, P, S, H), jnp.nan, jnp.float32).astype(kv_dtype)
    kn = jnp.asarray(rng.standard_normal((T, K, H)), jnp.bfloat16)
    vn = jnp.asarray(rng.standard_normal((T, K, H)), jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(P * S)[:T].astype(np.int32))

    def build(n):
        def f(kp, vp, kn, vn, s):
            for i in range(n):
                kp, vp = write(kp, vp, kn + i, vn, s)
            return kp, vp

        return jax.jit(f, donate_argnums=(0, 1))

    row = dict(
        kind="write_kv",
        impl=impl,
        T=T,
        K=K,
        H=H,
        kv_dtype=str(jnp.dtype(kv_dtype)),
        note="chained writes in one jit, cache donated; includes one small add per write (k + i)",
    )
    try:
        cache = [kp, vp]
        run = runner(build, kn, vn, slots, state=cache)
        run(REPS)
        kp = cache[0]
        got = np.asarray(kp.astype(jnp.float32).reshape(K, P * S, H)[:, np.asarray(slots)])
        want = reference.quantize(kn + (REPS - 1), 1.0, kv_dtype).astype(jnp.float32)
        want = np.asarray(want).transpose(1, 0, 2)
        row["exact"] = bool(np.array_equal(got, want))
        row["untouched_nan"] = int(np.isnan(np.asarray(kp.astype(jnp.float32))).sum()) == K * (P * S - T) * H
        nbytes = 2 * T * K * H * (2 + jnp.dtype(kv_dtype).itemsize)  # read new k, v; write their rows
        t = time_row(row, run)
        row.update(bytes_per_s=nbytes / t, frac_copy=nbytes / t / copy)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    results.append(row)
    print(json.dumps(row), flush=True)


def bench_qkv(results, T, K=8, G=4, H=128, S=16, P=16384):
    """The per-layer ops between the qkv projection and attention: XLA's RoPE fusions + the v slice + the
    Pallas KV write (the engine before b0ba538) vs one fused Pallas launch (qkv_write_kv_kernel)."""
    rng = np.random.default_rng(4)
    kp = jnp.zeros((K, P, S, H), jnp.bfloat16)
    vp = jnp.zeros((K, P, S, H), jnp.bfloat16)
    qkv = jnp.asarray(rng.standard_normal((T, K, G + 2, H)), jnp.bfloat16)
    pos = jnp.asarray(rng.integers(0, 4096, T), jnp.int32)
    inv_freq = jnp.asarray(500000.0 ** -(np.arange(0, H, 2) / H), jnp.float32)
    slots = jnp.asarray(rng.permutation(P * S)[:T].astype(np.int32))

    def xla(qkv, kp, vp):
        return reference.qkv_write_kv(qkv, pos, inv_freq, kp, vp, slots, write=write_kv_kernel)

    def fused(qkv, kp, vp):
        return qkv_write_kv_kernel(qkv, pos, inv_freq, kp, vp, slots)

    outs = {}
    for impl, fn in (("xla_rope_pallas_write", xla), ("pallas_fused", fused)):
        row = dict(kind="qkv_rope_write", impl=impl, T=T, K=K, G=G, H=H)
        try:

            def build(n, fn=fn):
                def f(qkv, kp, vp):
                    for _ in range(n):  # q feeds the next rep's qkv so the reps chain
                        q, kp, vp = fn(qkv, kp, vp)
                        qkv = qkv.at[:, :, 0].set(q[:, ::G] * 0.5)
                    return qkv, kp, vp

                return jax.jit(f, donate_argnums=(1, 2))

            state = [qkv, kp, vp]
            outs[impl] = [np.asarray(x.astype(jnp.float32)) for x in fn(qkv, kp, vp)[:1]]
            time_row(row, runner(build, state=state))
            kp, vp = state[1], state[2]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        results.append(row)
        print(json.dumps(row), flush=True)
    if len(outs) == 2:
        diff = outs["pallas_fused"][0] - outs["xla_rope_pallas_write"][0]
        results[-1]["q_max_abs_diff_vs_xla"] = float(np.abs(diff).max())


def bench_fused_decode(
    results, B, ctx, live=None, M=64, K=8, G=4, H=128, S=16, separate_too=True, ctxs=None, pool=None, label=None
):
    """A decode step's attention from the qkv projection ([B, K, G + 2, H], bf16): the qkv/RoPE/write kernel then
    the Triton decode kernel (the engine before 5f73bd6), the fused Triton decode kernel (one launch), and the
    qkv/RoPE/write kernel then the Mosaic GPU decode kernel (Hopper). B sequences of ctx tokens in M-page tables,
    the first `live` of them live (the engine's padded batch-1 bucket: 2 rows, 1 live, splits planned for one
    sequence as the engine plans them). separate_too=False leaves out the first (the max |diff| columns then
    compare against the fused kernel). ctxs: the live sequences' lengths instead (live = len(ctxs)); pool: the
    pages' pool (the engine's KV cache size in pages), the tables' pages drawn from all of it, instead of exactly
    B * M pages. Each row has kv_bytes (the live tokens' K and V, read once) and kv_tb_s."""
    rng = np.random.default_rng(6)
    lengths = list(ctxs) if ctxs is not None else [ctx] * (B if live is None else live)
    live = len(lengths)
    P = (pool or B * M) + 1
    kp = jnp.asarray(rng.standard_normal((K, P, S, H)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((K, P, S, H)), jnp.bfloat16)
    pages = rng.permutation(B * M) if pool is None else rng.choice(pool, size=B * M, replace=False)
    bt = jnp.asarray(1 + pages.reshape(B, M).astype(np.int32))
    lens = jnp.asarray(lengths + [0] * (B - live), jnp.int32)
    pos = jnp.maximum(lens - 1, 0)  # each row's new token: its position, and its slot in its last page
    slots = jnp.where(lens > 0, jnp.take_along_axis(bt, (pos // S)[:, None], axis=1)[:, 0] * S + pos % S, -1)
    kv_bytes = sum(lengths) * K * H * 2 * 2
    qkv = jnp.asarray(rng.standard_normal((B, K, G + 2, H)), jnp.bfloat16)
    inv_freq = jnp.asarray(500000.0 ** -(np.arange(0, H, 2) / H), jnp.float32)
    scale = H**-0.5

    def separate(qkv, kp, vp):
        q, kp, vp = qkv_write_kv_kernel(qkv, pos, inv_freq, kp, vp, slots)
        return paged_decode_attention_kernel(q, kp, vp, lens, bt, scale=scale), kp, vp

    plan = dict(plan_seqs=live) if live < B else {}

    def fused(qkv, kp, vp):
        return fused_decode_attention_kernel(qkv, pos, inv_freq, kp, vp, slots, lens, bt, scale=scale, **plan)

    def mosaic(qkv, kp, vp):
        q, kp, vp = qkv_write_kv_kernel(qkv, pos, inv_freq, kp, vp, slots)
        return paged_decode_mgpu(q, kp, vp, lens, bt, scale=scale, **plan), kp, vp

    impls = [("qkv_write_then_decode", separate)] if separate_too else []
    impls.append(("pallas_fused_decode", fused))
    if on_hopper():
        impls.append(("qkv_write_then_mosaic_decode", mosaic))
    outs = {}
    for impl, fn in impls:
        row = dict(kind="fused_decode", label=label, impl=impl, B=B, live=live, ctx=ctx, M=M, K=K, G=G, H=H)
        row.update(pool_pages=pool, kv_bytes=kv_bytes)
        try:

            def build(n, fn=fn):
                def f(kp, vp, qkv):
                    for _ in range(n):  # the output feeds the next rep's q rows so the reps chain
                        out, kp, vp = fn(qkv, kp, vp)
                        qkv = qkv.at[:, :, 0].set(out[:, ::G] * 0.5)
                    return kp, vp

                return jax.jit(f, donate_argnums=(0, 1))

            outs[impl] = np.asarray(fn(qkv, kp, vp)[0].astype(jnp.float32))
            state = [kp, vp]
            row["kv_tb_s"] = kv_bytes / time_row(row, runner(build, qkv, state=state)) / 1e12
            kp, vp = state
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        results.append(row)
        print(json.dumps(row), flush=True)
    base = "qkv_write_then_decode" if separate_too else "pallas_fused_decode"
    for row in results[len(results) - len(impls) + 1 :]:  # this call's rows after the base's
        if row["impl"] in outs and base in outs:
            row[f"max_abs_diff_vs_{base}"] = float(np.abs(outs[row["impl"]] - outs[base]).max())


def bench_mixed(results, n_prefill, chunk, n_decode, ctx, N=32, K=8, H=128, S=16):
    """A mixed step (chunked prefill + decode tokens, as in the throughput run's first 33 steps) through the
    entry point: the decode tokens in 1-token ragged tiles vs split off to the decode kernel."""
    import kernels_pallas as kp

    rng = np.random.default_rng(8)
    q_lens = [chunk] * n_prefill + [1] * n_decode
    seq_lens = [chunk] * n_prefill + [ctx] * n_decode
    B, M = len(q_lens), -(-max(seq_lens) // S)
    P = sum(-(-n // S) for n in seq_lens) + 8
    perm = rng.permutation(P).astype(np.int32)
    bt, at = np.zeros((B, M), np.int32), 0
    for b, n in enumerate(seq_lens):
        bt[b, : -(-n // S)] = perm[at : at + -(-n // S)]
        at += -(-n // S)
    k = jax.random.normal(jax.random.PRNGKey(0), (K, P, S, H), jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(1), (K, P, S, H), jnp.bfloat16)
    T = sum(q_lens)
    q = jax.random.normal(jax.random.PRNGKey(2), (T, N, H), jnp.bfloat16)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    args = (q, k, v, jnp.asarray(seq_lens, jnp.int32), qsl, jnp.asarray(bt))
    ref = None
    for split in (False, True):
        row = dict(
            kind="mixed",
            label=f"{n_prefill}x{chunk}_prefill+{n_decode}x{ctx}_decode",
            impl="pallas_triton",
            cfg=dict(split_decode=split),
        )
        call = lambda q, k, v, l, s, b, split=split: kp.ragged_paged_attention(  # noqa: E731
            q, k, v, l, s, b, scale=H**-0.5, split_decode=split
        )
        _measure(results, row, call, args, ref, lambda t: {})
        out = np.asarray(call(*args), np.float32)
        if ref is None:
            ref = out
        else:
            row["rel_err_vs_unsplit"] = rel_err(out, ref)


def bench_backends(results, mm_rate, T=4096, N=32, K=8, H=128):
    """The same causal attention math (one 4k sequence, 32 q / 8 kv heads, D128, fp16, dense KV) through
    JAX's shipped kernels on each Pallas GPU backend: Mosaic GPU (attention_mgpu, FA3-style: TMA,
    wgmma, warp specialization) and the Triton lowering (attention.mha). Our ragged paged prefill kernel
    on the same shape is the goal_chunk4k row; this row says what each backend reaches on this chip."""
    rng = np.random.default_rng(5)
    # float16: attention_mgpu stages q/k/v through float16 shared memory (bf16 inputs are refused)
    q = jnp.asarray(rng.standard_normal((1, T, N, H)), jnp.float16)
    k = jnp.asarray(rng.standard_normal((1, T, K, H)), jnp.float16)
    v = jnp.asarray(rng.standard_normal((1, T, K, H)), jnp.float16)
    flops = 4 * N * H * T * (T + 1) / 2
    ref = None
    try:
        rep = lambda x: jnp.repeat(x, N // K, axis=2)  # noqa: E731
        s = jnp.einsum("bqnh,bknh->bnqk", q.astype(jnp.float32), rep(k).astype(jnp.float32)) * H**-0.5
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None, None], s, -jnp.inf)
        ref = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, axis=-1), rep(v).astype(jnp.float32))
    except Exception:  # noqa: BLE001
        pass

    def mosaic(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am

        cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
        return am.attention(q * jnp.asarray(H**-0.5, q.dtype), k, v, cfg)

    def triton(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention as ta

        rep = lambda x: jnp.repeat(x, N // K, axis=2)  # noqa: E731
        return ta.mha(q, rep(k), rep(v), segment_ids=None, sm_scale=H**-0.5, causal=True)

    for name, fn in (("mosaic_gpu_attention_mgpu", mosaic), ("triton_attention_mha", triton)):
        row = dict(kind="backend", label="dense_causal_4k", impl=name, T=T, N=N, K=K, H=H)
        _measure(results, row, fn, (q, k, v), ref, matmul_rates(flops, mm_rate))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true", help="try several tile configs per shape")
    ap.add_argument("--only", default="ceil,decode,prefill,write")
    a = ap.parse_args()
    only = set(a.only.split(","))
    if "profile" in only:  # one launch of each goal-shape kernel, for ncu
        for B, ctx in ((64, 2048), (1, 32768)):
            q, k, v, lens, _, bt = make_case(B, ctx)
            jax.block_until_ready(paged_decode_attention_kernel(q, k, v, lens, bt, scale=0.088))
        q, k, v, _, _, bt = make_case(1, 4096, q_per_seq=4096)
        jax.block_until_ready(
            ragged_paged_attention_kernel(
                q, k, v, jnp.array([4096], jnp.int32), jnp.array([0, 4096], jnp.int32), bt, scale=0.088
            )
        )
        return
    if "trace" in only:  # where a decode call's time goes: the kernel vs the ops around it (XProf)
        traces = {}
        for B, ctx in ((1, 32768), (64, 2048)):
            q, k, v, lens, _, bt = make_case(B, ctx)
            build = chained(lambda q, k, v, lens, bt: paged_decode_attention_kernel(q, k, v, lens, bt, scale=0.088))
            _, summary = xprof_us(runner(build, q, k, v, lens, bt))
            traces[f"B{B}_ctx{ctx}"] = dict(calls=3 * REPS, summary=summary)
            print(json.dumps(traces[f"B{B}_ctx{ctx}"])[:3000], flush=True)
        with open(a.out.replace(".json", "_trace.json"), "w") as fh:
            json.dump(traces, fh, indent=1)
        only.discard("trace")
    info = dict(
        device=str(jax.devices()[0].device_kind),
        platform=platform.platform(),
        jax=jax.__version__,
        git_commit=os.environ.get("GIT_COMMIT", "unknown"),
        command=" ".join(sys.argv),
        reps=REPS,
    )
    print(json.dumps(info), flush=True)
    results = []
    copy = copy_bw()
    info["copy_bytes_per_s"] = copy
    mm = matmul_rate() if only & {"prefill", "ceil", "backend", "tune", "causal"} else None
    info["bf16_matmul_flops"] = mm
    print(json.dumps(info), flush=True)

    if "tune" in only:  # the current defaults against the previous ones and their neighbours, same run
        # batch 1 at the latency workload's lengths in the engine's 1024-token tables (the engine padded batch 1
        # to 8 sequences until stop 17, to 2 since): split-K plus its combine vs one program per kv head
        for B, ctx in ((1, 192), (8, 192), (1, 700)):
            bench_decode(
                results,
                B,
                ctx,
                copy,
                f"b{B}_ctx{ctx}_table1k",
                [dict(), dict(num_splits=1)],
                shipped=False,
                max_len=1024,
            )
    if "causal" in only:  # ragged prefill: the defaults against the previous tiles, and where a call's time goes
        cfgs = [dict(), dict(block_k=64, num_stages=2)]
        bench_prefill(results, 4096, 0, mm, "goal_chunk4k", cfgs)
        bench_prefill(results, 4096, 4096, mm, "chunk4k_prefix4k", cfgs)
        bench_prefill(results, 512, 8192, mm, "chunk512_prefix8k", cfgs)
        q, k, v, _, _, bt = make_case(1, 4096, q_per_seq=4096)
        args = (q, k, v, jnp.array([4096], jnp.int32), jnp.array([0, 4096], jnp.int32), bt)
        build = chained(lambda *a: ragged_paged_attention_kernel(*a, scale=0.088))
        _, summary = xprof_us(runner(build, *args))
        results.append(
            dict(
                kind="trace",
                label="goal_chunk4k",
                impl="pallas_triton",
                cfg={},
                calls=3 * REPS,
                summary=summary,
                time_us=0.0,
            )
        )
        print(json.dumps(summary)[:3000], flush=True)
    if "combine" in only:  # batch 1 x 32k: the split-K combine's tiling (it is launch/latency-bound), XProf times
        q, k, v, lens, _, bt = make_case(1, 32768)
        for cfg in [dict()] + [dict(combine_block_h=hb, combine_warps=w) for hb in (64, 32) for w in (1, 2, 4)]:
            build = chained(
                lambda q, k, v, lens, bt, cfg=cfg: paged_decode_attention_kernel(q, k, v, lens, bt, scale=0.088, **cfg)
            )
            us, summary = xprof_us(runner(build, q, k, v, lens, bt))
            kernels = {x["name"][:40]: round(x["us_per_run"], 2) for x in summary["devices"][0]["top_kernels"]}
            row = dict(
                kind="combine_xprof", label="goal_b1_ctx32k", impl="pallas_triton", cfg=cfg, time_us=us, kernels=kernels
            )
            results.append(row)
            print(json.dumps(row), flush=True)
    if "inflight" in only:  # decode: more KV bytes in flight per SM (prefetch 3 = two blocks ahead, bigger
        # blocks) with fewer, longer splits so the extra registers still give one wave; defaults repeated
        b1 = [
            dict(),
            dict(prefetch=3),
            dict(prefetch=3, num_splits=33),
            dict(prefetch=3, num_splits=32),
            dict(num_splits=33),
            dict(block_k=64, num_splits=33),
            dict(block_k=64, num_splits=33, prefetch=1),
            dict(block_k=64),
            dict(),
        ]
        bench_decode(results, 1, 32768, copy, "goal_b1_ctx32k", b1, shipped=False)
        bench_decode(
            results,
            64,
            2048,
            copy,
            "goal_b64_ctx2k",
            [dict(), dict(prefetch=3), dict(block_k=32, prefetch=3), dict()],
            shipped=False,
        )
    if "waves" in only:  # split-K over several waves of programs (the block scheduler balances what one wave
        # cannot: B1 x 32k's programs end over ~4 us, bench/KERNELS_NOTES.md stop 18) against the one-wave default
        for B, ctx, splits in (
            (1, 32768, (49, 66, 98, 132, 147, 198, 264)),
            (4, 8192, (12, 24, 36, 49)),
            (2, 131072, (24, 48, 72, 96)),
        ):
            cfgs = [dict()] + [dict(num_splits=n) for n in splits] + [dict()]
            bench_decode(results, B, ctx, copy, f"waves_b{B}_ctx{ctx}", cfgs, shipped=False, check=ctx <= 32768)
    if "mgpu_decode" in only:  # the Mosaic GPU decode kernel (_decode_mgpu.py) against the Triton one, same inputs
        deep = [dict(slots=4, ctas_per_sm=1), dict(slots=5, ctas_per_sm=1), dict(slots=4, num_splits=17)]
        wide = [dict(slots=2), dict(block_kv=128, slots=2), dict(slots=3)]
        for B, ctx, mg in (
            (1, 32768, deep + [dict(slots=2)]),
            (64, 2048, wide),
            (16, 16384, wide + deep[:2]),
            (4, 8192, deep[:2] + [dict(slots=3, ctas_per_sm=1)]),
            (2, 131072, deep[:2]),
        ):
            label = f"mgpu_b{B}_ctx{ctx}"
            bench_decode(results, B, ctx, copy, label, [dict()], shipped=False, check=ctx <= 32768)
            bench_decode(
                results,
                B,
                ctx,
                copy,
                label,
                mg + mg[:1],
                shipped=False,
                impl="mosaic_gpu",
                fn=paged_decode_mgpu,
                check=ctx <= 32768,
            )
            bench_decode(results, B, ctx, copy, label, [dict()], shipped=False, check=False)
        for cfg in ({}, dict(slots=2)):  # the throughput run's decode batch
            fn = paged_decode_mgpu if cfg else paged_decode_attention_kernel
            bench_engine_like(
                results,
                copy,
                "engine_shape_cache21k" + ("_mosaic" if cfg else ""),
                live=500,
                jitter=20,
                max_len=1024,
                total_pages=21189,
                configs=(cfg,),
                fn=fn,
            )
    if "mgpu_xprof" in only:  # the same comparison by XProf kernel time (the chain difference of short Mosaic GPU
        # calls moved by 2x between repeats in 88e7d4d): per call, the summed kernels (combine included)

        impls = dict(triton=paged_decode_attention_kernel, mosaic=paged_decode_mgpu)
        cases = {
            (1, 32768): [
                ("triton", {}),
                ("mosaic", dict(slots=4, ctas_per_sm=1)),
                ("mosaic", dict(slots=5, ctas_per_sm=1)),
                ("mosaic", dict(slots=2)),
                ("triton", {}),
            ],
            (64, 2048): [
                ("triton", {}),
                ("mosaic", dict(slots=2)),
                ("mosaic", dict(block_kv=128, slots=2)),
                ("mosaic", dict(slots=3)),
                ("triton", {}),
            ],
            (16, 16384): [
                ("triton", {}),
                ("mosaic", dict(block_kv=128, slots=2)),
                ("mosaic", dict(slots=4, ctas_per_sm=1)),
            ],
            (4, 8192): [
                ("triton", {}),
                ("mosaic", dict(slots=4, ctas_per_sm=1)),
                ("mosaic", dict(slots=3, ctas_per_sm=1)),
            ],
        }
        for (B, ctx), variants in cases.items():
            q, k, v, lens, _, bt = make_case(B, ctx)
            nbytes = B * ctx * k.shape[0] * k.shape[-1] * 2 * 2 + 2 * q.size * 2
            for name, cfg in variants:
                fn = impls[name]
                build = chained(lambda q, k, v, lens, bt, fn=fn, cfg=cfg: fn(q, k, v, lens, bt, scale=0.088, **cfg))
                run = runner(build, q, k, v, lens, bt)
                row = dict(kind="decode_xprof", label=f"b{B}_ctx{ctx}", impl=name, cfg=cfg)
                try:
                    t = time_row(row, run)
                    us, summary = xprof_us(run)
                    row.update(
                        kernel_us=us,
                        kernel_frac_copy=nbytes / (us * 1e-6) / copy,
                        frac_copy=nbytes / t / copy,
                        bytes_per_s=nbytes / t,
                        kernels={
                            x["name"][:40]: round(x["us_per_run"], 2) for x in summary["devices"][0]["top_kernels"]
                        },
                    )
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                results.append(row)
                print(json.dumps(row), flush=True)
    if "decode_backend" in only:  # where the Mosaic GPU decode kernel beats the Triton one (XProf kernel time and
        # chain time per call, same inputs, same run): the goal shapes, shorter contexts, the engine's batch

        deep, wide = dict(slots=4, ctas_per_sm=1), dict(slots=2, ctas_per_sm=2)
        cases = [
            (1, 32768, None, None, [deep, wide]),
            (4, 8192, None, None, [deep]),
            (16, 16384, None, None, [deep]),
            (2, 131072, None, None, [deep]),
            (64, 2048, None, None, [deep, dict(block_kv=128, slots=2), wide]),
            (64, 512, 2048, None, [deep, wide]),
            (8, 4096, None, None, [deep, wide]),
            (512, 600, 1024, 500, [deep, wide]),
            (128, 1024, None, None, [deep, wide]),
        ]
        for B, ctx, max_len, live, mg in cases:
            q, k, v, lens, _, bt = make_case(B, ctx, max_len=max_len, total_pages=21189 if live else None)
            if live is not None:
                lens = np.zeros(B, np.int32)
                lens[:live] = ctx - np.random.default_rng(4).integers(0, 21, live)
                lens = jnp.asarray(lens)
            nbytes = int(lens.sum()) * k.shape[0] * k.shape[-1] * 2 * 2 + 2 * q.size * 2
            for name, cfg in [("triton", {})] + [("mosaic", c) for c in mg] + [("triton", {})]:
                fn = paged_decode_attention_kernel if name == "triton" else paged_decode_mgpu
                call = lambda q, k, v, lens, bt, fn=fn, cfg=cfg: fn(q, k, v, lens, bt, scale=0.088, **cfg)  # noqa: E731
                row = dict(
                    kind="decode_xprof",
                    label=f"b{B}_ctx{ctx}" + (f"_live{live}" if live else ""),
                    table_tokens=int(bt.shape[1]) * 16,
                    impl=name,
                    cfg=cfg,
                )
                xprof_row(results, row, call, (q, k, v, lens, bt), nbytes, copy)
    if "pool" in only:  # B1 x 32k through the entry point as the engine calls it: the bucket's padding row (length
        # 0) and a KV pool of the engine's size (55,690 pages of 16 tokens: the H200's at max_model_len 32768), the
        # sequence's pages shuffled over it, against the goal shape's one row over a pool of its own pages only
        import kernels_pallas as kp

        for B, pool in ((1, None), (1, 55690), (2, None), (2, 55690)):
            label = f"pool_b{B}_ctx32768_pages{pool or 'own'}"
            bench_engine_like(
                results, copy, label, B=B, ctx=32768, live=1, total_pages=pool, fn=kp.paged_decode_attention
            )
    if "goal" in only:  # the decode goal shapes through the entry point (the backend it picks), the Triton kernel
        # and JAX's shipped kernel, each by chain difference and by XProf kernel time, twice
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        import kernels_pallas as kp

        impls = [
            ("entry_point", lambda q, k, v, lens, bt: kp.paged_decode_attention(q, k, v, lens, bt, scale=0.088)),
            ("pallas_triton", lambda q, k, v, lens, bt: paged_decode_attention_kernel(q, k, v, lens, bt, scale=0.088)),
            (
                "jax_shipped_paged_attention",
                lambda q, k, v, lens, bt: paged_attention(q * jnp.asarray(0.088, q.dtype), k, v, bt, lens),
            ),
        ]
        for B, ctx in ((64, 2048), (1, 32768)):
            q, k, v, lens, _, bt = make_case(B, ctx)
            nbytes = B * ctx * k.shape[0] * k.shape[-1] * 2 * 2 + 2 * q.size * 2
            ref = reference.paged_decode_attention_ref(q, k, v, lens, bt, scale=0.088, pages_per_step=64)
            for rep in range(2):
                for name, call in impls:
                    row = dict(
                        kind="decode_goal",
                        label=f"goal_b{B}_ctx{ctx}",
                        impl=name,
                        rep=rep,
                        rel_err=rel_err(call(q, k, v, lens, bt), ref) if rep == 0 else None,
                    )
                    xprof_row(results, row, call, (q, k, v, lens, bt), nbytes, copy)
    if "b1" in only:  # batch-1 decode padded to 8 sequences, 1 live (the engine before stop 17), latency lengths
        cfgs = [dict(), dict(num_splits=1)] + [
            dict(num_splits=1, block_k=bk, num_warps=w, prefetch=pf)
            for bk in (64, 128, 256)
            for w in (4, 8)
            for pf in (0, 2)
        ]
        for ctx in (144, 256, 700):
            bench_engine_like(results, copy, f"b1_ctx{ctx}", B=8, ctx=ctx, live=1, max_len=1024, configs=cfgs)
    if a.sweep:
        dec_cfgs = [
            dict(block_k=bk, num_warps=w, num_stages=st) for bk in (32, 64, 128) for w in (1, 2, 4) for st in (2, 3)
        ]
        pre_cfgs = [
            dict(block_m=bm, block_k=bk, num_warps=w, num_stages=st)
            for bm in (64, 128)
            for bk in (32, 64)
            for w in (4, 8)
            for st in (2, 3)
        ]
    else:
        dec_cfgs = [dict()]
        pre_cfgs = [dict()]
    if "decode" in only:
        bench_decode(results, 64, 2048, copy, "goal_b64_ctx2k", dec_cfgs)
        bench_decode(
            results,
            1,
            32768,
            copy,
            "goal_b1_ctx32k",
            dec_cfgs + [dict(num_splits=n, block_k=64, num_stages=2, num_warps=w) for n in (32, 64) for w in (2, 4)],
        )
        if not a.sweep:
            bench_decode(results, 64, 2048, copy, "page32", [dict()], S=32, shipped=False)
            bench_decode(results, 64, 2048, copy, "page64", [dict()], S=64, shipped=False)
            bench_decode(results, 64, 2048, copy, "fp8_e4m3", [dict()], kv_dtype=jnp.float8_e4m3fn, shipped=False)
            bench_decode(results, 16, 16384, copy, "b16_ctx16k", [dict()])
            bench_decode(results, 2, 131072, copy, "b2_ctx128k", [dict()], shipped=False, check=False)
            bench_decode(results, 64, 2048, copy, "mha_N32_K32_D64", [dict()], N=32, K=32, H=64)
            # the throughput run's decode batch (500 live of 512, 580-600 tokens, 64-page tables, a cache the
            # engine's size): 0.91 of copy alone (7276253) where the engine's step saw ~0.87
            bench_engine_like(
                results, copy, "engine_shape_cache21k", live=500, jitter=20, max_len=1024, total_pages=21189
            )
    if "fp8_decode" in only:
        # fp8 (e4m3) pages at the throughput run's decode shape beside bf16 pages, same run: fp8 reads half the
        # bytes but measured 388 vs 458 us a layer (stop 43). SASS (bench/probes/decode_sass.py): its loads are
        # 128-bit, but Triton widens fp8 byte by byte (~2.9x the instructions per KV byte of bf16) and the block's
        # math, not its 8 KB of loads, sets the pace; these configs trade bytes per block against occupancy
        for kv_dtype, label, cfgs in (
            (jnp.bfloat16, "bf16_pages", [dict()]),
            (jnp.float8_e4m3fn, "fp8_pages", FP8_DECODE_CONFIGS),
        ):
            bench_engine_like(
                results,
                copy,
                label,
                live=500,
                jitter=20,
                max_len=1024,
                total_pages=21189,
                kv_dtype=kv_dtype,
                configs=cfgs,
            )
    if "mgpu" in only:  # the Mosaic GPU prefill kernel against the Triton one, same inputs and run
        for chunk, prefix, label in (
            (4096, 0, "goal_chunk4k"),
            (4096, 4096, "chunk4k_prefix4k"),
            (512, 8192, "chunk512_prefix8k"),
        ):
            bench_prefill(results, chunk, prefix, mm, label, [dict()])
            bench_prefill(
                results,
                chunk,
                prefix,
                mm,
                label,
                [
                    dict(block_kv=128, steps_in_flight=2),
                    dict(block_kv=128, steps_in_flight=3),
                    dict(block_kv=64, steps_in_flight=4),
                ],
                impl="mosaic_gpu",
            )
    if "prefill" in only:
        bench_prefill(results, 4096, 0, mm, "goal_chunk4k", pre_cfgs)
        if not a.sweep:
            bench_prefill(results, 4096, 4096, mm, "chunk4k_prefix4k", [dict()])
            bench_prefill(results, 512, 8192, mm, "chunk512_prefix8k", [dict()])
    if "write" in only:
        for T in (1, 64, 512, 4096):
            for impl in WRITE_IMPLS:
                bench_write(results, T, copy, impl)
        for impl in WRITE_IMPLS:
            bench_write(results, 64, copy, impl, kv_dtype=jnp.float8_e4m3fn)
    if "mixed" in only:
        bench_mixed(results, 8, 512, 256, 600)
        bench_mixed(results, 4, 1024, 480, 600)
        bench_mixed(results, 1, 512, 8, 600)
    if "qkv" in only:
        for T in (8, 512, 2048, 4096, 8192):
            bench_qkv(results, T)
    if "fused" in only:
        for B, ctx, live, M in (
            (2, 200, 1, 64),
            (2, 200, 1, 2048),  # batch 1 at max_model_len 32k: the table is max_model_len wide
            (8, 200, 8, 64),
            (64, 2048, 64, 128),
            (256, 700, 256, 64),
            (512, 600, 500, 64),
            (2, 32640, 1, 2048),
            (16, 8064, 16, 512),
        ):
            bench_fused_decode(results, B, ctx, live=live, M=M)
    if "fused_engine" in only:  # the offline run's decode steps (500 x 462 / 256, 8B, max_model_len 1024): its trace
        # has the fused launch at ~2.84 TB/s where the (512, 600, 500) row above ran ~3.38 (HISTORY "Stop 66").
        # Here: that row again; ~470 live rows of 462-718 tokens (the run's decode steps) over their own pages; the
        # same over the engine's 55,204-page pool (the H200's KV cache at gpu_memory_utilization 0.9)
        ctxs = [int(c) for c in np.random.default_rng(1).integers(462, 719, 470)]
        for lab, kw in (
            ("b512_ctx600_live500", dict(live=500)),
            ("b512_live470_ctx462to718", dict(ctxs=ctxs)),
            ("b512_live470_ctx462to718_pool55204", dict(ctxs=ctxs, pool=55204)),
        ):
            bench_fused_decode(results, 512, 600, M=64, label=lab, **kw)
    if "fused_sweep" in only:  # where the write + Mosaic path overtakes the fused launch: contexts x rows
        for B, live in ((2, 1), (8, 8), (16, 16), (64, 64)):
            for ctx in (512, 1024, 2048, 4096):
                bench_fused_decode(results, B, ctx, live=live, M=256, separate_too=False)
    if "backend" in only:
        bench_backends(results, mm)

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(info=info, results=results), f, indent=1)
    print("\nkind     label                 impl                           cfg -> time_us  TB/s  frac  err")
    for r in results:
        if "error" in r:
            print(r["kind"], r.get("label"), r["impl"], r.get("cfg"), "ERROR", r["error"][:200])
            continue
        rate = r.get("bytes_per_s", 0) / 1e12 if "bytes_per_s" in r else r.get("tflops", 0)
        frac = r.get("frac_copy", r.get("frac_matmul", 0))
        print(
            f"{r['kind']:8s} {str(r.get('label')):20s} {r['impl'][:28]:28s} {json.dumps(r.get('cfg', {}))[:60]:60s}"
            f" {r['time_us']:9.1f} {rate:7.3f} {frac:5.2f} {_err(r):.1e}"
        )


def _err(row) -> float:
    """A row's rel_err for the table; NaN where there is none (repeats are checked once: None)."""
    err = row.get("rel_err")
    return float("nan") if err is None else err


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
