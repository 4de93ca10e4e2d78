"""The fp8 GEMV kernels compiled for an H100 (sm_90a) on a machine without a GPU: XLA's own GPU compiler (its Triton
build, as the GPU runs it) compiles each jitted call for a compile-only CUDA device made from a target config, and
ptxas -v reports each kernel's registers per thread and spill bytes. What a GPU run would refuse to compile shows
here, and so does register pressure (a kernel over 128 registers a thread at 4 warps fits fewer programs an SM).

Setup (a venv of its own: the CUDA wheels are ~4 GB; jax's version is the CPU tests', 0.10.2):
    python -m venv /tmp/cudavenv && /tmp/cudavenv/bin/pip install "jax==0.10.2" "jaxlib==0.10.2" \\
        "jax-cuda13-plugin[with-cuda]==0.10.2"
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/cudavenv/bin/python bench/probes/deviceless_compile.py \\
        --out /tmp/compile.json [--rows 1,2] [--cases gemv,gemv_e4m3,gemv_amax,silu,silu_e4m3,add_norm_e4m3] \\
        [--silu-configs '[{"layout": "paired"}, {"layout": "interleaved"}, {"layout": "split"}]']
(JAX_SKIP_CUDA_CONSTRAINTS_CHECK: the plugin's version checks load CUPTI, which needs a driver.)

Indicative only: jax 0.10.2's XLA, not the GPU image's 0.11.2; registers are ptxas's for the PTX XLA wrote.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# An H100 SXM's device description, the fields XLA's GPU compiler reads (xla.GpuTargetConfigProto, text format)
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
SCRIPT = "deviceless_compile"
CASES = ("gemv", "gemv_e4m3", "gemv_amax", "silu", "silu_e4m3", "add_norm_e4m3")
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)


def device():
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=H100_TARGET, topology="1x1x1")
    return topo.devices[0]


def calls(case, M, cfg):
    """(name, fn, shapes) of one case: the 8B shapes its form of x meets in the decoder."""
    import jax.numpy as jnp

    from kernels_pallas import _add_rms_norm, _fp8_gemv, quant

    ms, f8, bf, f32 = quant.FP8_MIN_SCALE, jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32
    gemv, silu = _fp8_gemv.fp8_gemv_kernel, _fp8_gemv.fp8_gemv_silu_kernel
    out = []
    if case.startswith("gemv"):
        mode = {"gemv": "row", "gemv_e4m3": "e4m3", "gemv_amax": "amax"}[case]
        shapes = {"row": SHAPES, "e4m3": ("qkv", "gate_up"), "amax": ("down",)}[mode]
        for shape in shapes:
            K, N = SHAPES[shape]
            x = ((M, K), f8 if mode == "e4m3" else bf)
            xs = {"row": None, "e4m3": ((M, 1), f32), "amax": ((M, K // 16), f32)}[mode]
            fn = lambda x, w, s, xs, mode=mode: gemv(x, w, s, xs, min_scale=ms, x_mode=mode, **cfg)  # noqa: E731
            out.append((f"{case} {shape}", fn, (x, ((N, K), f8), ((N,), f32), xs)))
    elif case.startswith("silu"):
        mode = "e4m3" if case == "silu_e4m3" else "row"
        K, N = SHAPES["gate_up"]
        x, xs = (((M, K), f8), ((M, 1), f32)) if mode == "e4m3" else (((M, K), bf), None)

        def fn(x, w, s, xs, mode=mode):
            return silu(x, w, s, xs, min_scale=ms, x_mode=mode, out_dtype=bf, **cfg)

        out.append((f"{case} gate_up", fn, (x, ((N, K), f8), ((N,), f32), xs)))
    else:
        for S in (7, 8):
            fn = lambda x, p, w: _add_rms_norm.add_rms_norm_kernel(x, p, w, eps=1e-5, min_scale=ms, **cfg)  # noqa: E731
            out.append((f"{case} S{S}", fn, (((M, 4096), bf), ((S, M, 4096), f32), ((4096,), bf))))
    return out


# PTX instructions counted per kernel (static counts in its text, not executions): two forms of a kernel with the
# same counts move the same data the same way, whatever their address arithmetic
PTX_OPS = ("ld.global", "cp.async", "ldmatrix", "ld.shared", "st.shared", "mma.sync", "bar.sync", "shfl")


def ptxas_report(dump_dir, ptxas):
    """{kernel: {registers, spill_bytes, ptx_ops}} of every PTX entry XLA wrote (the largest register count of its
    two compiles: XLA dumps the PTX it autotunes and the final one; ptx_ops: PTX_OPS counted in the last one read)."""
    kernels: dict = {}
    for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
        ptx = open(path).read()
        names = re.findall(r"\.entry (\w+)", ptx)
        if not names or ptxas is None:
            continue
        text = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True)
        regs = [int(r) for r in re.findall(r"Used (\d+) registers", text.stderr)]
        spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", text.stderr)]
        for name in names:
            row = kernels.setdefault(name, dict(registers=0, spill_bytes=0))
            row["registers"] = max([row["registers"], *regs])
            row["spill_bytes"] = max([row["spill_bytes"], *spills])
            if len(names) == 1:
                row["ptx_ops"] = {op: len(re.findall(r"\b" + re.escape(op), ptx)) for op in PTX_OPS}
    return kernels


def compile_case(name, fn, shapes, dev, ptxas):
    import jax
    from jax.sharding import SingleDeviceSharding

    sh = SingleDeviceSharding(dev)
    args = [None if s is None else jax.ShapeDtypeStruct(s[0], s[1], sharding=sh) for s in shapes]
    dump = tempfile.mkdtemp(prefix="deviceless_")
    row: dict = dict(case=name)
    try:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        lowered.compile(compiler_options={"xla_dump_to": dump})
        row.update(ok=True, kernels=ptxas_report(dump, ptxas))
    except Exception as e:  # noqa: BLE001 - a case that does not compile is this probe's finding
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--silu-configs", default="[{}]", help="JSON list of fp8_gemv_silu_kernel tunings for silu cases")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import jax

    from bench.common import environment, write_result

    ptxas = shutil.which("ptxas") or next(
        iter(glob.glob(os.path.join(sys.prefix, "lib/*/site-packages/nvidia/*/bin/ptxas"))), None
    )
    dev = device()
    rows = []
    for case in args.cases.split(","):
        for M in (int(m) for m in args.rows.split(",")):
            for cfg in json.loads(args.silu_configs) if case.startswith("silu") else [{}]:
                for name, fn, shapes in calls(case, M, cfg):
                    row = dict(compile_case(name, fn, shapes, dev, ptxas), M=M, cfg=cfg)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    res = dict(jax=jax.__version__, target="sm_90a (H100 target config)", ptxas=ptxas, rows=rows)
    res["env"] = dict(environment(with_jax=False), device="compile-only sm_90a (H100 target config), no GPU")
    if args.out:
        write_result(SCRIPT, res, args.out)
    return res


if __name__ == "__main__":
    main()
