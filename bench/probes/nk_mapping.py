"""Which weight value the nk int4 kernel (kernels_pallas/_qmatmul_mgpu.qmatmul_mgpu) multiplies with each input, for
small shapes and tilings: the relative error of x @ W against numpy on random x, and where it is wrong, x one-hot at
each k so that y is the column of the dequantized weight the kernel paired with k (per k: the matching columns, or
how many rows differ). GPU only; a debugging aid for the layout of its register operand.

    python bench/probes/nk_mapping.py [--configs '[{"k": 256, "n": 64, "splits": 1}]']
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

CONFIGS = [
    dict(k=128, n=64, splits=1),
    dict(k=256, n=64, splits=1),
    dict(k=256, n=64, splits=2),
    dict(k=128, n=128, splits=1),
    dict(k=128, n=64, splits=1, group=128),
    dict(k=1024, n=64, splits=1, stages=2),
    dict(k=1024, n=64, splits=1),
    dict(k=4096, n=256),
]


def run(cfg):
    K, N, group = cfg["k"], cfg["n"], cfg.get("group", -1)
    kw = {k: v for k, v in cfg.items() if k in ("splits", "stages", "nw", "block_k")}
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (N, K))
    ng = 1 if group == -1 else K // group
    s = rng.uniform(0.5, 1.5, (ng, N)).astype(np.float32) if group != -1 else np.ones((1, N), np.float32)
    wt = jnp.asarray(_qmatmul_mgpu.nk_permute(q - 8)).astype(jnp.int4)
    sj = jnp.asarray(s, jnp.bfloat16)
    f = jax.jit(lambda x: _qmatmul_mgpu.qmatmul_mgpu(x, wt, sj, group_size=group, **kw).sum(0)[:, 0])
    dense = (q - 8).astype(np.float32) * np.repeat(np.asarray(sj, np.float32), K // ng, axis=0).T  # [N, K]
    x = rng.standard_normal((1, K)).astype(np.float32)
    y = np.asarray(f(jnp.asarray(x, jnp.bfloat16)), np.float32)
    ref = dense @ np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)[0]
    rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    out = {"cfg": cfg, "rel_err": rel}
    if rel > 1e-2 and K <= 1024:
        cols = {}
        for k in range(K):
            y = np.asarray(f(jnp.zeros((1, K), jnp.bfloat16).at[0, k].set(1)), np.float32)
            hits = [int(c) for c in range(K) if np.array_equal(dense[:, c], y)]
            cols[k] = hits if hits else {"rows_differ": int((y != dense[:, k]).sum()), "zero": bool((y == 0).all())}
        out["map"] = {k: v for k, v in cols.items() if v != [k]}
        out["n_wrong"] = len(out["map"])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", default=None, help="JSON list (default CONFIGS)")
    args = p.parse_args(argv)
    for cfg in json.loads(args.configs) if args.configs else CONFIGS:
        try:
            r = run(cfg)
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            r = {"cfg": cfg, "error": repr(e)[:300]}
        m = r.pop("map", None)
        print(json.dumps(r), json.dumps(dict(list(m.items())[:40])) if m else "")


if __name__ == "__main__":
    main()
