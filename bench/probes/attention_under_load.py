"""The offline run's decode attention alone and between the layer's GEMMs, over one layer's KV pool or each layer's.

Finding (one H200, stop 67, bench/results/attention_under_load_*_h200_*.json): the GPU's 700 W power cap. The
500 x 462 / 256 run holds the GPU at ~691 W with the SM clock at ~1555 MHz (nvidia-smi: reason "SW power cap"),
where short calls run at 1980 MHz. Here, 500 live rows of 462-718 tokens, the launch takes 366-367 us a call when
the GPU is cool (alone or between the GEMMs, one pool or one a layer: neither matters) and 396 us when full layers
on random data have run back to back for 10 s (~690 W, ~1690 MHz): the engine trace's 400 us. The kernel bench's
340-350 us was 470 live rows at full clock.

The question (bench/HISTORY.md "Stop 66"): the H200 trace of the 500 x 462 / 256 run has the fused decode launch at
~400 us a layer a step, where bench/kernels.py --only fused_engine runs the same launch at the same shape (470 live
rows of 462-718 tokens in a 512-row bucket) in 340.7-349.8 us. The kernel bench chains the launch on one layer's
pages; the engine runs it between the layer's GEMMs and on a different layer's pages each time. Which of the two
costs the ~13 %? (Neither: the clock, above.)

    python bench/probes/attention_under_load.py --out P.json [--layers 32] [--steps 3]

A "step" here is --layers decoder layers of the 8B shape at --rows rows (the decode bucket), each the engine's
decode layer in outline: qkv GEMM, the fused decode attention (kernels_pallas.fused_decode_attention, as
jaxllm/models/attention.py calls it), o GEMM + residual, gate/up GEMM, silu * up, down GEMM + residual. Modes:
    full:      that layer;                          gemm: the attention left out (q's rows stand in for its output);
    attn:      the attention alone (each layer's q from the previous layer's output, so the launches chain);
and pools: "each" (a KV pool per layer, as the engine's cache) or "one" (every layer on the same pool, as the
kernel bench). Each row: the step's wall time (median of --steps timed steps), the XProf time per step of every
kernel kind (the attention launch's mean us a call among them), and the GPU's SM clock / power from nvidia-smi
(sampled every 50 ms while the row ran, and while its profiled steps ran) where nvidia-smi is there. The attention's
cost inside the layer is also the difference full - gemm. --sustain-s S runs the steps back to back for S seconds
first (the clock the power cap allows); the pools hold random values and the layer normalizes its stream, since
zeros and a stream that overflows draw less power (call J's zero pools reached ~600 W and kept 1980 MHz).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import common  # noqa: E402

D, KV, G, H, F, S = 4096, 8, 4, 128, 14336, 16  # Llama-3-8B's decoder layer; 16-token pages


class SmiLog:
    """nvidia-smi's SM clock, memory clock and power every 50 ms in a thread; window(t0, t1) -> their means."""

    FIELDS = "clocks.sm,clocks.mem,power.draw"

    def __init__(self):
        self.rows: list[tuple[float, list[float]]] = []
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.rows.append((time.time(), [float(v) for v in line.split(",")]))
            except ValueError:
                pass

    def window(self, t0: float, t1: float) -> dict:
        vals = [v for t, v in self.rows if t0 <= t <= t1]
        if not vals:
            return {}
        names = ("sm_mhz", "mem_mhz", "power_w")
        return {n: round(statistics.mean(v[i] for v in vals), 1) for i, n in enumerate(names)} | {"samples": len(vals)}

    def close(self):
        if self.proc is not None:
            self.proc.terminate()


def engine_shapes(rows: int, live: int, lo: int = 462, hi: int = 718, seed: int = 1):
    """The offline run's decode step (bench/kernels.py's fused_engine): `live` rows of lo-hi tokens (462-718: the run's
    whole decode phase) in a `rows` bucket, each sequence's pages a run of the pool's first pages in a random order (the engine's LIFO free list
    keeps the pages it hands out low). -> (lens, pos, slots, block table, pool pages, KV bytes a layer)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ctxs = [int(c) for c in rng.integers(lo, hi + 1, live)]
    M = 1024 // S  # max_model_len 1024
    need = [-(-c // S) for c in ctxs]
    order = 1 + rng.permutation(sum(need))
    bt = np.zeros((rows, M), np.int32)
    at = 0
    for b, n in enumerate(need):
        bt[b, :n] = order[at : at + n]
        at += n
    lens = np.asarray(ctxs + [0] * (rows - live), np.int32)
    pos = np.maximum(lens - 1, 0)
    slots = np.where(lens > 0, bt[np.arange(rows), pos // S] * S + pos % S, -1).astype(np.int32)
    return lens, pos, slots, bt, sum(need) + 1, sum(ctxs) * KV * H * 2 * 2


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--live", type=int, default=470)
    p.add_argument("--ctx", default="462-718", help="the live rows' contexts: lo-hi tokens, uniform")
    p.add_argument("--sustain-s", type=float, default=0.0, help="steps back to back this long before timing")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modes", default="attn:one,attn:each,gemm:each,full:one,full:each")
    p.add_argument("--ffn", type=int, default=F, help="the MLP's width (tests: small)")
    p.add_argument("--interpret", action="store_true", help="CPU: the kernels in interpret mode (tests)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import kernels_pallas
    from bench.profile_summary import summarize

    B, L, ffn = args.rows, args.layers, args.ffn
    lens, pos, slots, bt, pool, kv_bytes = engine_shapes(B, args.live, *map(int, args.ctx.split("-")))
    lens, pos, slots, bt = (jnp.asarray(a) for a in (lens, pos, slots, bt))
    inv_freq = jnp.asarray(500000.0 ** -(np.arange(0, H, 2) / H), jnp.float32)
    key = jax.random.PRNGKey(0)
    ks = jax.random.split(key, 6)
    w = lambda k, shape: jax.random.normal(k, shape, jnp.bfloat16) * (shape[0] ** -0.5)  # noqa: E731
    W = w(ks[0], (D, KV * (G + 2) * H)), w(ks[1], (D, D)), w(ks[2], (D, 2 * ffn)), w(ks[3], (ffn, D))
    x0 = jax.random.normal(ks[4], (B, D), jnp.bfloat16)

    def attention(qkv, kp, vp):
        return kernels_pallas.fused_decode_attention(
            qkv, pos, inv_freq, kp, vp, slots, lens, bt, scale=H**-0.5, interpret=args.interpret
        )

    def norm(x):  # the layer's RMS norms (no weight): keeps the stream's values, and the GPU's power, as a model's
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)

    def layer(mode, W, x, kp, vp):
        Wqkv, Wo, Wgu, Wd = W
        if mode == "attn":
            qkv = jnp.broadcast_to(x[:, : (G + 2) * H].reshape(B, 1, G + 2, H), (B, KV, G + 2, H))
            out, kp, vp = attention(qkv, kp, vp)
            return out.reshape(B, D), kp, vp
        qkv = (norm(x) @ Wqkv).reshape(B, KV, G + 2, H)
        if mode == "gemm":
            out = qkv[:, :, :G].reshape(B, D)
        else:
            out, kp, vp = attention(qkv, kp, vp)
        h = out.reshape(B, D) @ Wo + x
        gu = norm(h) @ Wgu
        a = jax.nn.silu(gu[:, :ffn]) * gu[:, ffn:]
        return a @ Wd + h, kp, vp

    def step_fn(mode, pools):
        def step(x, W, kps, vps):
            kps, vps = list(kps), list(vps)
            for i in range(L):
                j = i if pools == "each" else 0
                x, kps[j], vps[j] = layer(mode, W, x, kps[j], vps[j])
            return x, tuple(kps), tuple(vps)

        return jax.jit(step, donate_argnums=(2, 3))

    smi = SmiLog()
    results = []
    kps = vps = ()  # KV pools, [KV, pool, S, H] each: one a layer, or one; donated to each step, kept across rows
    for spec in args.modes.split(","):
        mode, pools = spec.split(":")
        n = L if pools == "each" else 1
        if len(kps) != n:  # random values: zeros draw less power
            kps = vps = ()  # the old pools go before the new ones are made
            jax.clear_caches()
            kvs = [jax.random.normal(k, (KV, pool, S, H), jnp.bfloat16) for k in jax.random.split(ks[5], 2 * n)]
            kps, vps = tuple(kvs[:n]), tuple(kvs[n:])
            del kvs
        fn = step_fn(mode, pools)
        x = x0
        x, kps, vps = fn(x, W, kps, vps)  # compile + warm
        jax.block_until_ready(x)
        t_start = time.time()
        if args.sustain_s:  # back to back for sustain_s seconds: the GPU at its sustained power and clock
            while time.time() - t_start < args.sustain_s:
                for _ in range(10):
                    x, kps, vps = fn(x, W, kps, vps)
                jax.block_until_ready(x)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            x, kps, vps = fn(x, W, kps, vps)
            jax.block_until_ready(x)
            times.append(time.perf_counter() - t)
        d = tempfile.mkdtemp()
        t_prof = time.time()
        with jax.profiler.trace(d):
            for _ in range(args.profile_steps):  # back to back, as the timed loop before them was not
                x, kps, vps = fn(x, W, kps, vps)
            jax.block_until_ready(x)
        t_end = time.time()
        summary = summarize(d)
        dev = summary["devices"][0] if summary.get("devices") else {}
        kernels = dev.get("top_kernels", [])
        per_step = [
            dict(
                name=k["name"][:70],
                ms_per_step=round(k["ms"] / args.profile_steps, 4),
                us_per_call=round(k["ms"] * 1e3 / k["runs"], 2),
            )
            for k in kernels[:8]
            if "runs" in k and k["runs"]
        ]
        attn = [k for k in per_step if "paged_decode" in k["name"]]
        row = dict(
            mode=mode,
            pools=pools,
            layers=L,
            rows=B,
            live=args.live,
            ctx=args.ctx,
            pool_pages=pool,
            kv_bytes_per_layer=kv_bytes,
            step_ms=statistics.median(times) * 1e3,
            step_ms_all=[round(t * 1e3, 3) for t in times],
            busy_ms_per_step=dev["busy_ms"] / args.profile_steps if "busy_ms" in dev else None,
            attention_us_per_call=attn[0]["us_per_call"] if attn else None,
            attention_tb_s=round(kv_bytes / (attn[0]["us_per_call"] * 1e-6) / 1e12, 3) if attn else None,
            kernels=per_step,
            gpu=smi.window(t_start, t_end),
            gpu_profiled=smi.window(t_prof, t_end),
        )
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
    smi.close()
    by = {(r["mode"], r["pools"]): r for r in results}
    derived = {}
    if ("full", "each") in by and ("gemm", "each") in by:
        derived["full_minus_gemm_us_per_layer"] = (
            (by["full", "each"]["step_ms"] - by["gemm", "each"]["step_ms"]) * 1e3 / L
        )
    result = dict(env=common.environment(), rows=results, derived=derived)
    print(json.dumps(derived))
    if args.out:
        common.write_result("attention_under_load", result, args.out)
    return result


if __name__ == "__main__":
    main()
