"""Finding: the fused decode kernel's Triton lowering matches qkv_write_kv + the decode kernel on the H100 for
every cache type the engine serves (relative error 1.3e-5 to 5.6e-4; KERNELS_NOTES, fused_decode_check_h100_e236328).

GPU check of the fused decode kernel's Triton lowering (the CPU tests run it in interpret mode): for the
model families and cache types the engine serves (fp8 e4m3 / e5m2 KV with scales, ALiBi without RoPE, a
sliding window, fp16 with G = 7, split-K partials, head dim 64 / page 32), fused_decode_attention against
qkv_write_kv + the decode kernel on the same inputs, with NaN in each new token's slot before the call.
Reports the relative error of the live rows, that padding rows are zero and that both wrote the same pages.

  python bench/probes/fused_decode_check.py --out OUT.json
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kernels_pallas as kp  # noqa: E402
from tests.test_kernels import make_cache  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
out_path = ap.parse_args().out
res = []
cases = [  # K, G, H, S, lens, parts, dtype, kv_dtype, rope, extra
    (8, 4, 128, 16, [200, 0], 4, jnp.bfloat16, jnp.float8_e4m3fn, True, {}),
    (8, 4, 128, 16, [700, 33, 1, 0], 0, jnp.bfloat16, jnp.float8_e5m2, True, {}),
    (8, 5, 128, 16, [300, 17, 0], 0, jnp.bfloat16, None, False, dict(alibi=True)),  # Baichuan-13B-like
    (8, 4, 128, 16, [5000, 90, 0], 0, jnp.bfloat16, None, True, dict(sliding_window=4096)),  # Mistral-like
    (4, 7, 128, 16, [31, 2000, 0], 0, jnp.float16, None, True, {}),  # Qwen2.5-7B-like, fp16
    (2, 4, 64, 32, [129, 64, 0], 4, jnp.bfloat16, None, True, {}),
]
for K, G, H, S, lens, parts, dt, kvdt, rope, extra in cases:
    rng = np.random.default_rng(1)
    B = len(lens)
    k, v, bt = make_cache(rng, K, H, S, lens, M=max(64, -(-max(lens) // S) + 1), dtype=dt)
    slots = np.array([int(bt[b, (n - 1) // S]) * S + (n - 1) % S if n else -1 for b, n in enumerate(lens)], np.int32)
    kn, vn = np.array(k.astype(jnp.float32)), np.array(v.astype(jnp.float32))
    for sl in slots[slots >= 0]:
        kn[:, sl // S, sl % S] = vn[:, sl // S, sl % S] = np.nan
    kvd = kvdt or dt
    k, v = jnp.asarray(kn).astype(kvd), jnp.asarray(vn).astype(kvd)
    shape = (parts, B, K, G + 2, H) if parts else (B, K, G + 2, H)
    qkv = jnp.asarray(rng.standard_normal(shape), jnp.float32 if parts else dt)
    pos = jnp.asarray([max(n - 1, 0) for n in lens], jnp.int32)
    inv = jnp.asarray(500000.0 ** -(np.arange(0, H, 2) / H), jnp.float32) if rope else None
    kw = dict(scale=H**-0.5)
    if kvdt is not None:
        kw.update(k_scale=0.5, v_scale=2.0)
    if extra.get("alibi"):
        kw["alibi_slopes"] = jnp.asarray(2.0 ** -np.arange(1, K * G + 1) * 4, jnp.float32)
    if "sliding_window" in extra:
        kw["sliding_window"] = extra["sliding_window"]
    lens_a, slots_a = jnp.asarray(lens, jnp.int32), jnp.asarray(slots)
    row = dict(
        K=K,
        G=G,
        H=H,
        S=S,
        lens=lens,
        parts=parts,
        dtype=str(jnp.dtype(dt)),
        kv=str(jnp.dtype(kvd)),
        rope=rope,
        extra={k_: str(v_) for k_, v_ in extra.items()},
    )
    try:
        scales = {k_: kw[k_] for k_ in ("k_scale", "v_scale") if k_ in kw}
        q, k1, v1 = kp.qkv_write_kv(qkv, pos, inv, k, v, slots_a, dtype=dt, **scales)
        want = kp.paged_decode_attention(q, k1, v1, lens_a, bt, **kw)
        got, k2, v2 = kp.fused_decode_attention(qkv, pos, inv, k, v, slots_a, lens_a, bt, dtype=dt, **kw)
        w, g = np.asarray(want.astype(jnp.float32)), np.asarray(got.astype(jnp.float32))
        live = np.asarray(lens) > 0
        row.update(
            finite=bool(np.isfinite(g[live]).all()),
            rel_err=float(np.linalg.norm(g[live] - w[live]) / np.linalg.norm(w[live])),
            pad_zero=not g[~live].any(),
            pages_equal=all(
                np.array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), equal_nan=True)
                for a, b in ((k1, k2), (v1, v2))
            ),
        )
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    print(row, flush=True)
    res.append(row)
with open(out_path, "w") as f:
    json.dump(
        dict(
            device=str(jax.devices()[0].device_kind),
            jax=jax.__version__,
            commit=os.environ.get("GIT_COMMIT"),
            command=" ".join(sys.argv),
            rows=res,
        ),
        f,
        indent=1,
    )
