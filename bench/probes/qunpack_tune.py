"""Finding (H100, fcdb7d1, bench/results/qunpack_tune_h100_fcdb7d1.json): the default tiling, 64 columns and 8 warps a
program, is within 1-2% of the best of six for gate_up and down by wall time; 32 columns / 4 warps looked faster for
qkv and o (48.7 vs 60.3 us, 42.9 vs 52.6) by wall time, which includes dispatch: not adopted without kernel time.

Probe: _qunpack.unpack_kernel's tiling (block_n, num_warps) on the 8B shapes' int4 g128 weights, and the rate it
writes the dense bf16 weight at against a copy of the same bytes measured in the same process.

Each timed call unpacks COPIES distinct weights (no CSE); wall time per weight, median of REPS calls.

  python bench/probes/qunpack_tune.py --out OUT.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import environment, write_result  # noqa: E402
from kernels_pallas._qunpack import unpack_kernel  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CONFIGS = [(64, 8), (64, 4), (128, 8), (128, 4), (32, 4), (256, 8)]
COPIES, REPS = 6, 15


def timed(fn, *args):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(REPS):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / COPIES


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    key = jax.random.PRNGKey(0)
    for name, (K, N) in SHAPES.items():
        qw = [
            jax.random.randint(jax.random.fold_in(key, i), (K // 8, N), -(2**31), 2**31 - 1, jnp.int32)
            for i in range(COPIES)
        ]
        sc = [jnp.full((K // 128, N), 0.01 + i, jnp.bfloat16) for i in range(COPIES)]
        nbytes = K * N * 2 + K * N // 2 + 2 * sc[0].size * 2
        copy = jax.jit(lambda ws: [w * 3 for w in ws])  # read + write the same bytes as the bf16 output
        dense = [jnp.ones((K, N), jnp.bfloat16) for _ in range(COPIES)]
        t_copy = timed(copy, dense)
        rows.append(dict(shape=name, impl="copy_bf16", us=t_copy * 1e6, bytes_per_s=2 * K * N * 2 / t_copy))
        print(rows[-1], flush=True)
        for bn, warps in CONFIGS:
            f = jax.jit(
                lambda qs, ss, bn=bn, warps=warps: [
                    unpack_kernel(
                        q,
                        s,
                        None,
                        bits=4,
                        group_size=128,
                        plane=128,
                        dtype=jnp.dtype(jnp.bfloat16),
                        block_n=bn,
                        num_warps=warps,
                    )
                    for q, s in zip(qs, ss)
                ]
            )
            t = timed(f, qw, sc)
            rows.append(
                dict(shape=name, impl="unpack", block_n=bn, num_warps=warps, us=t * 1e6, bytes_per_s=nbytes / t)
            )
            print(rows[-1], flush=True)
    write_result("qunpack_tune", dict(env=environment(), rows=rows), args.out)


if __name__ == "__main__":
    main()
