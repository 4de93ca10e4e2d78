"""Which weight value the nk int4 kernel (kernels_pallas/_qmatmul_mgpu.qmatmul_mgpu) multiplies with each input: one
64 x 128 block (N = 64, K = 128, per-channel scales 1), x one-hot at k, so the kernel's y is the column of the
dequantized weight it paired with k. Prints, per k, the columns k' whose values equal y (row by row), or the rows
that differ. GPU only; a debugging aid for the layout of its register operand.

    python bench/probes/nk_mapping.py [--asym]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels_pallas import _qmatmul_mgpu  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--k", type=int, default=128)
    args = p.parse_args(argv)
    N, K = args.n, args.k
    q = np.random.default_rng(0).integers(0, 16, (N, K))  # q, natural K order
    wt = jnp.asarray(_qmatmul_mgpu.nk_permute(q - 8)).astype(jnp.int4)
    s = jnp.ones((1, N), jnp.bfloat16)
    f = jax.jit(lambda x: _qmatmul_mgpu.qmatmul_mgpu(x, wt, s, group_size=-1, splits=1)[0, :, 0])
    A = (q - 8).astype(np.float32)
    out = {}
    for k in range(K):
        x = jnp.zeros((1, K), jnp.bfloat16).at[0, k].set(1)
        y = np.asarray(f(x), np.float32)
        hits = [int(c) for c in range(K) if np.array_equal(A[:, c], y)]
        if hits:
            out[k] = hits
        else:  # per row: which columns hold y's value (rows moved?)
            rows = [int(r) for r in range(N) if y[r] != A[r, k]]
            out[k] = {"differ_rows": rows[:16], "n": len(rows), "y": y[:8].tolist(), "A_k": A[:8, k].tolist()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
