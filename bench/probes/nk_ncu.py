"""The nk int4 kernel (kernels_pallas/_qmatmul_mgpu.qmatmul_mgpu) launched twice a shape and configuration, on random
int4 g128 weights of Llama-3-8B's projection shapes, for Nsight Compute and Mosaic GPU's compiler dumps (ptxas's
registers and spills, SASS) to read what limits it at one row:

    MOSAIC_GPU_DUMP_TO=$OUT/mgpu XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none \
        --kernel-name regex:qmatmul_nk --section SpeedOfLight --section WarpStateStats ... \
        python bench/probes/nk_ncu.py --m 1 --shapes o,down --configs '[{}, {"rows_first": true}]'

Prints one line a launch (shape, configuration, wall us of the second launch, which ncu's replay inflates) so the
ncu report's launches can be matched to configurations in order. GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels_pallas import _qmatmul_mgpu  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def operands(K, N, M, seed):
    kq, ks, kx = jax.random.split(jax.random.key(seed), 3)
    wt = jax.random.randint(kq, (N, K), -8, 8, jnp.int8).astype(jnp.int4)
    scales = (jax.random.uniform(ks, (K // 128, N), jnp.float32, 0.5, 1.5) / 64).astype(jnp.bfloat16)
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    return x, wt, scales


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--configs", default="[{}]", help="JSON list of qmatmul_mgpu keyword arguments")
    args = p.parse_args(argv)
    configs = json.loads(args.configs)
    for shape in args.shapes.split(","):
        K, N = SHAPES[shape]
        x, wt, scales = operands(K, N, args.m, list(SHAPES).index(shape))
        for cfg in configs:
            for _ in range(2):
                t = time.perf_counter()
                jax.block_until_ready(_qmatmul_mgpu.qmatmul_mgpu(x, wt, scales, group_size=128, **cfg))
                us = (time.perf_counter() - t) * 1e6
            print(json.dumps({"shape": shape, "m": args.m, "config": cfg, "second_launch_wall_us": round(us, 1)}))


if __name__ == "__main__":
    main()
