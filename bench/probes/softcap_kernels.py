"""GPU check of attention soft-capping (Gemma 2) in the Triton kernels: ragged prefill, split-K decode and the fused
decode kernel, compiled for the device (not interpreted), against kernels_pallas/reference.py, with and without a
sliding window, at Gemma 2's head dim 256. On CPU the kernels run in interpret mode (--small: tiny shapes).

  python bench/probes/softcap_kernels.py --out $OUT/softcap_kernels_<device>.json

Finding: not run on a GPU yet (the CPU interpret-mode tests in tests/test_kernels.py pass).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kernels_pallas as kp  # noqa: E402
from bench.common import environment, write_result  # noqa: E402
from kernels_pallas import reference  # noqa: E402

TOL = 2e-2  # bf16, as tests/test_kernels.py


def make_cache(rng, K, H, S, lens, dtype=jnp.bfloat16):
    """Each sequence's pages shuffled over the cache, the unused pages and slots NaN (no pytest import: the
    device image may not have it)."""
    need = [max(1, -(-n // S)) for n in lens]
    M, P = max(need) + 1, sum(need) + 3
    perm, bt, at = rng.permutation(P), np.zeros((len(lens), M), np.int32), 0
    k, v = (np.full((K, P, S, H), np.nan, np.float32) for _ in range(2))
    for b, n in enumerate(lens):
        bt[b, : need[b]] = perm[at : at + need[b]]
        at += need[b]
        for j in range(n):
            k[:, bt[b, j // S], j % S] = rng.standard_normal((K, H))
            v[:, bt[b, j // S], j % S] = rng.standard_normal((K, H))
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(bt)


def _ragged_args(rng, N, K, H, S, dtype, q_lens, seq_lens, pad_tokens=3):
    k, v, bt = make_cache(rng, K, H, S, seq_lens, dtype)
    q = jnp.asarray(rng.standard_normal((sum(q_lens) + pad_tokens, N, H)), dtype)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, k, v, jnp.asarray(seq_lens, jnp.int32), qsl, bt


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)) if np.isfinite(out).all() else np.inf


def cases(small: bool, interpret: bool):
    rng = np.random.default_rng(0)
    N, K, H = (4, 2, 64) if small else (8, 4, 256)
    q_lens, seq_lens = ([5, 1], [5, 20]) if small else ([40, 1, 300, 0], [40, 90, 700, 0])
    dec = [20, 5] if small else [900, 5, 33]
    for window in (7,) if small else (None, 64):
        kw = dict(scale=H**-0.5, soft_cap=1.5, sliding_window=window)
        args = _ragged_args(rng, N, K, H, 16, jnp.bfloat16, q_lens, seq_lens)
        yield (
            f"ragged window={window}",
            kp.ragged_paged_attention(*args, interpret=interpret, **kw),
            reference.ragged_paged_attention_ref(*args, **kw),
        )
        k, v, bt = make_cache(rng, K, H, 16, dec)
        q = jnp.asarray(rng.standard_normal((len(dec), N, H)), jnp.bfloat16)
        lens = jnp.asarray(dec, jnp.int32)
        yield (
            f"decode window={window}",
            kp.paged_decode_attention(q, k, v, lens, bt, interpret=interpret, **kw),
            reference.paged_decode_attention_ref(q, k, v, lens, bt, **kw),
        )
        G = N // K
        qkv = jnp.asarray(rng.standard_normal((len(dec), K, G + 2, H)), jnp.bfloat16)
        slots = jnp.asarray([int(bt[b, (n - 1) // 16]) * 16 + (n - 1) % 16 for b, n in enumerate(dec)], jnp.int32)
        pos, inv_freq = lens - 1, jnp.asarray(1e4 ** -(np.arange(0, H, 2) / H), jnp.float32)
        out, _, _ = kp.fused_decode_attention(
            qkv, pos, inv_freq, k, v, slots, lens, bt, dtype=jnp.bfloat16, interpret=interpret, **kw
        )
        qr, kr, vr = reference.qkv_write_kv(qkv, pos, inv_freq, k, v, slots, dtype=jnp.bfloat16)
        yield f"fused decode window={window}", out, reference.paged_decode_attention_ref(qr, kr, vr, lens, bt, **kw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU interpret mode)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    rows = []
    try:
        for name, out, ref in cases(a.small, interpret):
            err = rel_err(out, ref)
            rows.append(dict(case=name, rel_err=err, ok=err < TOL))
            print(rows[-1], flush=True)
    except Exception as e:  # noqa: BLE001 - a kernel that does not lower: recorded, not lost
        traceback.print_exc()
        rows.append(dict(case="error", error=f"{type(e).__name__}: {str(e)[:500]}", ok=False))
    result = dict(env=environment(), interpret=interpret, rows=rows, passed=all(r["ok"] for r in rows))
    write_result("softcap_kernels", result, a.out)
    return result


if __name__ == "__main__":
    main()
