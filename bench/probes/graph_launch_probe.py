"""Host time of one call of a many-kernel jitted program launched as a CUDA graph (XLA command buffer), by what
changes between calls (--sync: each call waits for the one before, so a queue of calls in flight cannot pace the
host): whether the host time a batch-1 decode step spends in its compiled call (bench/
step_phases.py's exe_call: 1.2-2.3 ms on an H200) depends on its input buffers moving.

    python bench/probes/graph_launch_probe.py --out /tmp/glp.json [--layers 150] [--calls 300]

The program: `layers` rounds of a small GEMM and a softmax (two kernels each) whose adds read a small int32 input
`ints` (as a decode step's kernels read its packed host inputs), and a large state donated and returned (the KV
cache's role). Modes, each timed over `calls` calls after a warm-up (host time inside the call, and the wall time
per call with the device kept busy):
  same        the same `ints` array every call; x the same array
  fresh       `ints` put on the device anew before every call (a new buffer each time), as the engine's
              packed host arguments are
  fresh_chain fresh `ints`, and x the previous call's output (as prev_tokens)
  stable      fresh `ints` copied by the program into a buffer of its own first (a select on a runtime value, which
              XLA cannot remove), the kernels reading that copy
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def build(layers: int, width: int, stable: bool):
    import jax
    import jax.numpy as jnp

    def f(ws, ints, x, state):
        if stable:  # one copy kernel reads the fresh input; every later kernel reads the copy
            ints = jnp.where(ints[-1] != 12345, ints, 0)
        h = x
        for i in range(layers):
            h = jnp.dot(h, ws[i % ws.shape[0]], preferred_element_type=jnp.float32).astype(x.dtype)
            h = jax.nn.softmax(h.astype(jnp.float32) + ints[i % (ints.shape[0] - 1)], axis=-1).astype(x.dtype)
        state = state.at[0, : h.shape[1]].add(h[0].astype(state.dtype))
        return h, state

    return jax.jit(f, donate_argnums=(3,))


def run_mode(mode: str, layers: int, width: int, calls: int, sync: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    fn = build(layers, width, stable=mode == "stable")
    key = jax.random.PRNGKey(0)
    ws = jax.random.normal(key, (16, width, width), jnp.bfloat16) * 0.05
    host_ints = np.arange(17, dtype=np.int32)
    ints = jax.device_put(host_ints)
    x = jnp.ones((8, width), jnp.bfloat16)
    state = jnp.zeros((4096, 4096), jnp.bfloat16)  # 32 MB, donated each call
    host, out = [], None
    for i in range(calls + 20):
        if mode != "same":
            ints = jax.device_put(host_ints + (i % 3))
        arg_x = out if (mode == "fresh_chain" and out is not None) else x
        t = time.perf_counter()
        out, state = fn(ws, ints, arg_x, state)
        host.append(time.perf_counter() - t)
        if sync:  # the next call starts on an idle device: no queue of calls in flight to wait behind
            out.block_until_ready()
        if i == 19:
            out.block_until_ready()
            t0 = time.perf_counter()
    out.block_until_ready()
    wall = (time.perf_counter() - t0) / calls
    timed = host[20:]
    return dict(
        host_ms_median=round(statistics.median(timed) * 1e3, 4),
        host_ms_p90=round(float(np.percentile(timed, 90)) * 1e3, 4),
        wall_ms_per_call=round(wall * 1e3, 4),
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=150)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--modes", nargs="+", default=["same", "fresh", "fresh_chain", "stable", "same"])
    p.add_argument("--sync", action="store_true", help="wait for each call before the next (host time alone)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")  # the engine's allocator (device_memory.py)
    import jax

    from bench.common import environment, write_result

    rows = []
    for mode in a.modes:
        r = dict(mode=mode, **run_mode(mode, a.layers, a.width, a.calls, a.sync))
        print(r, flush=True)
        rows.append(r)
    out = dict(env=environment(), backend=jax.default_backend(), **vars(a), rows=rows)
    write_result("graph_launch_probe", out, a.out)
    return out


if __name__ == "__main__":
    main()
