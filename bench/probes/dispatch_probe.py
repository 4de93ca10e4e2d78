"""Host time of a compiled call by what it is given. Finding (one H200, stop 66, dispatch_probe_*_h200_b81479a.json):
~1.1 us of host time per argument array, jit or AOT-compiled alike; the 8B GPTQ step's 323 param + 64 KV arrays
cost ~0.43 ms of its ~2.1 ms launch (bf16's 195 + 64: ~0.24 ms). The rest of the launch is XLA's command-buffer
update and launch; fewer, stacked arrays would need the layers run as a scan (not done).

The question: how much of the 1.2-2.2 ms that a batch-1 decode step spends in its compiled call (bench/latency.py
--host-timing's launch) is the handling of its arguments, the model's params pytree (hundreds of arrays; more for
quantized models, whose projections carry their scales) and the KV cache, rather than the program's launch.

    python bench/probes/dispatch_probe.py --shape llama3-8b --load-format dummy [--quantization gptq] --out P.json

Builds the engine (as bench/latency.py), then times calls of a program that does nothing but add 1 to a small
int32 array, compiled with every argument kept (keep_unused) and given, by row: the ints alone; the params and
the ints; the params, the KV cache and the ints; half of the params' arrays and the ints. Each row is timed as
jax.jit's call and as an AOT-compiled call (jax.stages.Compiled, as the engine calls its step programs), the
median host time of --calls calls (each waits for the one before, so no queue paces the host). Also: the time
of flattening the params pytree, and the arrays' counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import common  # noqa: E402


def host_ms(fn, args, calls: int) -> float:
    """Median host milliseconds of fn(*args), each call after the previous one's result is ready."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return statistics.median(times) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    llm, t0, t_ready = common.build_llm(args)
    runner = llm.llm_engine.runner
    params, kv = runner.params, runner.kv_caches
    leaves = jax.tree_util.tree_leaves(params)
    ints = jnp.zeros((64,), jnp.int32)
    noop = jax.jit(lambda *a: a[-1] + 1, keep_unused=True)
    cases = dict(
        ints=(ints,),
        params=(params, ints),
        params_kv=(params, kv, ints),
        half_params=(leaves[: len(leaves) // 2], ints),
    )
    rows = {}
    for name, a in cases.items():
        compiled = noop.lower(*a).compile()
        rows[name] = dict(
            arrays=len(jax.tree_util.tree_leaves(a)),
            jit_ms=host_ms(noop, a, args.calls),
            compiled_ms=host_ms(compiled, a, args.calls),
        )
        print(name, rows[name], flush=True)
    flat = []
    for _ in range(args.calls):
        t = time.perf_counter()
        jax.tree_util.tree_flatten(params)
        flat.append(time.perf_counter() - t)
    base = rows["ints"]["compiled_ms"]
    per_array_us = (rows["params"]["compiled_ms"] - base) * 1e3 / max(rows["params"]["arrays"] - 1, 1)
    result = dict(
        env=common.environment(),
        engine=dict(ready_s=t_ready - t0, quantization=getattr(args, "quantization", None), shape=args.shape),
        param_arrays=len(leaves),
        kv_arrays=len(jax.tree_util.tree_leaves(kv)),
        flatten_params_ms=statistics.median(flat) * 1e3,
        rows=rows,
        compiled_us_per_param_array=per_array_us,
    )
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=1))
    common.write_result("dispatch_probe", result, args.out)
    return result


if __name__ == "__main__":
    main()
