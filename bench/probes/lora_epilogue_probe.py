"""Finding (H100, lora_epilogue_h100_{7efd0bb,e3a7cfd}.json): XLA's GemmRewriter runs an add in a GEMM's epilogue
only when the add's first operand is a GEMM that adds nothing yet (it tries operand 0 first and gives up on a GEMM
that already adds a bias). (x + d) + o and (x + o) + d each leave one add as a kernel of its own (5.9 kernels a
layer here); o + (x + d) and d + (x + o) run both adds in epilogues (4.9), the second also keeping the base model's
o GEMM (in the engine, the first made cuBLAS pick a split-K o GEMM with a reduce kernel: lora_h100_7efd0bb.json).
jaxllm/lora/ops.add and the decoder use d + (x + o) (issue 34).

    python bench/probes/lora_epilogue_probe.py --out $OUT/lora_epilogue.json

An 8B-shaped o projection chain at T tokens with S slots of rank R, written in several orders of the same sum
(residual x, base output o(out), LoRA delta d), each followed by the next RMS norm as in the decoder: per variant
the optimized HLO's kernels (fusions and cuBLAS calls with their beta) and the time of a jit running the chain
`--reps` times over distinct layers' weights (median of --iters calls)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from jaxllm.lora import ops as lora_ops  # noqa: E402

BF = jnp.bfloat16


def _norm(y, g):
    y32 = y.astype(jnp.float32)
    return (y32 * jax.lax.rsqrt((y32 * y32).mean(-1, keepdims=True) + 1e-5) * g).astype(y.dtype)


def _proj(a, w):
    return jnp.einsum("TNH,NHD->TD", a, w)


def _d(a, lo, lw):
    return lora_ops.delta("o", a, *lo, lw).astype(BF)


# each: (x, attention output a, base weight w, slot arrays lo, slot weights lw) -> the residual stream after o
VARIANTS = {
    "(x + d) + o (4ba746a)": lambda x, a, w, lo, lw: (x + _d(a, lo, lw)) + _proj(a, w),
    "o + (x + d) (7efd0bb)": lambda x, a, w, lo, lw: _proj(a, w) + (x + _d(a, lo, lw)),
    "d + (x + o)": lambda x, a, w, lo, lw: _d(a, lo, lw) + (x + _proj(a, w)),
    "(x + o) + d (44de14e)": lambda x, a, w, lo, lw: (x + _proj(a, w)) + _d(a, lo, lw),
    "x + (o + d) (PEFT)": lambda x, a, w, lo, lw: x + (_proj(a, w) + _d(a, lo, lw)),
    "base (no LoRA)": lambda x, a, w, lo, lw: x + _proj(a, w),
}


def _kernels(text: str) -> list[str]:
    """The entry computation's kernels: fusions by kind / root, cuBLAS calls with beta."""
    entry = text[text.index("ENTRY") :]
    out = []
    for line in entry.splitlines()[1:]:
        if "custom-call(" in line:
            target = re.search(r'custom_call_target="([^"]+)"', line)
            beta = re.search(r'"beta":([0-9.]+)', line)
            out.append(f"{target.group(1) if target else '?'} beta={beta.group(1) if beta else '?'}")
        elif " fusion(" in line:
            name = re.match(r"\s*(?:ROOT )?%?([\w.\-]+)", line).group(1)
            kind = re.search(r"kind=(\w+)", line)
            out.append(f"fusion {name} {kind.group(1) if kind else ''}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--reps", type=int, default=8, help="chained layers per call")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    T, S, R, D, N = a.tokens, a.slots, a.rank, a.hidden, a.heads
    H = D // N
    rng = np.random.default_rng(0)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02, BF)  # noqa: E731
    layers = [(mk(N, H, D), mk(N, H, S, R), mk(S, R, D), mk(D)) for _ in range(a.reps)]
    x0, att = mk(T, D), mk(T, N, H)
    lw = lora_ops.select(jnp.asarray(np.arange(T) % (S + 1) - 1, jnp.int32), S, BF)
    rows = []
    for name, fn in VARIANTS.items():

        def chain(x, att, layers, lw, fn=fn):
            for wo, A, B, g in layers:
                x = fn(x, att, wo, (A, B), lw)
                att = _norm(x, g).reshape(att.shape)  # the next "attention output" reads the norm
            return x

        # as the engine compiles decode steps of >= 32 sequences (jaxllm/engine/xla_options.py): cuBLAS GEMMs
        opts = {"xla_gpu_enable_triton_gemm": False} if jax.default_backend() == "gpu" else {}
        jf = jax.jit(chain).lower(x0, att, layers, lw).compile(compiler_options=opts)
        kernels = _kernels(jf.as_text())
        jf(x0, att, layers, lw).block_until_ready()
        ts = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            jf(x0, att, layers, lw).block_until_ready()
            ts.append(time.perf_counter() - t0)
        row = dict(
            variant=name,
            us_per_layer=float(np.median(ts)) * 1e6 / a.reps,
            kernels=len(kernels),
            kernels_per_layer=len(kernels) / a.reps,
            kernel_list=kernels[:80],
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = dict(env=common.environment(), args=vars(a), rows=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
