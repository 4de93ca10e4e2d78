"""What the quantized matmul kernel compiles to, without a GPU: lowers kernels_pallas._qmatmul.qmatmul_kernel for
CUDA on the CPU (jax's cross-platform lowering), takes the Triton IR of its pallas_call, compiles it for sm_90 with
the `triton` wheel from PyPI (`pip install triton`: the compiler runs on a CPU; its ptxas assembles the PTX, which
also checks the kernel's inline PTX) and disassembles the cubin: registers per thread, and per loop of the SASS
the instruction mix and instructions per weight (weights a thread dequantizes in one iteration of the loop).

    python bench/probes/qmatmul_sass.py --m 16 --dequant asm [--fma] [--bits 4] [--group-size 128] [--asym]
        [--dtype bfloat16] [--tuning '{"plane_loop": false}'] [--keep DIR]

Indicative only: XLA's GPU compiler runs its own Triton build (jax 0.11.2's on the H100), whose layouts and
register allocation may differ; the GPU's figures are bench/quant_kernels.py's.
Finding (triton 3.9.0 from PyPI, int4 g128 sym bf16, o 4096 x 4096): the MMA variant's main loop takes 6.47
instructions per weight on the float path and 3.36 with dequant="asm" (M = 16; 3.24 at M = 1 with 16 row copies);
the FMA variant 6.49 / 4.25 (down 14336 x 4096, M = 1); at M = 64 (wgmma) 8.47 / 7.44, and 5.42 with
dequant="asm_sub"; table and breakdown in bench/KERNELS_NOTES.md "Quantized matmuls". Every PTX of the asm
variants assembled with ptxas 12.9 and 13.0 for sm_90a.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src.pallas.triton import lowering as triton_lowering  # noqa: E402
from jax._src.pallas.triton import pallas_call_registration as registration  # noqa: E402

from kernels_pallas import _qmatmul  # noqa: E402
from kernels_pallas.qlayout import choose_plane  # noqa: E402


def triton_ir(fn, *args) -> list[str]:
    """The Triton IR text of every pallas_call that lowering fn(*args) for CUDA emits."""
    captured, original = [], triton_lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        res = original(*a, **k)
        captured.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original
    return captured


def compile_ttir(path, num_warps, num_stages):
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise SystemExit(f"this probe needs the triton compiler: pip install triton ({e})") from e
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default (fused multiply-adds)
    return triton.compile(
        path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def tool(name):
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_loops(sass: str):
    """[(start, end, instructions, Counter of opcodes)] for each backward branch of the SASS (a loop's body)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text) in enumerate(ins):
        if "BRA" not in text:
            continue
        t = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        if t and int(t.group(1), 16) < a and int(t.group(1), 16) in at:
            body = ins[at[int(t.group(1), 16)] : i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for _, x in body)
            loops.append((int(t.group(1), 16), a, len(body), ops))
    return loops


def compile_to_sass(ttir: str, out: str, name: str, num_warps: int, num_stages: int):
    """Writes ttir to out/name.ttir, compiles it for sm_90 and writes the .ttgir / .ptx / .cubin / .sass beside it
    -> (compiled kernel, SASS text, registers per thread as a string, "?" if cuobjdump does not say)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    k = compile_ttir(path, num_warps, num_stages)
    for key in ("ttgir", "ptx"):
        with open(os.path.join(out, f"{name}.{key}"), "w") as f:
            f.write(k.asm[key])
    cubin = os.path.join(out, f"{name}.cubin")
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(out, f"{name}.sass"), "w") as f:
        f.write(sass)
    res = subprocess.run([tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    return k, sass, regs.group(1) if regs else "?"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dequant", default="float")
    p.add_argument("--fma", action="store_true")
    p.add_argument("--tuning", default="{}", help="JSON of further qmatmul_kernel options")
    p.add_argument("--keep", default=None, help="write the .ttir / .ttgir / .ptx / .sass here")
    args = p.parse_args(argv)
    dt, P = jnp.dtype(args.dtype), 32 // args.bits
    ng = 1 if args.group_size == -1 else args.k // args.group_size
    tuning = json.loads(args.tuning)
    shapes = [(args.m, args.k), (args.k // P, args.n), (ng, args.n)] + ([(ng, args.n)] if args.asym else [])
    avals = [jax.ShapeDtypeStruct(s, jnp.int32 if i == 1 else dt) for i, s in enumerate(shapes)]
    plane = choose_plane(args.k, args.bits, args.group_size)
    kw = dict(bits=args.bits, group_size=args.group_size, plane=plane, fma=args.fma, dequant=args.dequant, **tuning)
    [ttir] = triton_ir(lambda x, qw, s, *z: _qmatmul.qmatmul_kernel(x, qw, s, z[0] if z else None, **kw), *avals)
    num_warps = tuning.get("num_warps") or (8 if args.fma else 4)
    bn = tuning.get("block_n") or _qmatmul.default_block_n(args.n, args.fma)
    out = args.keep or tempfile.mkdtemp()
    # the PyPI build refuses "-" in symbol names (per channel: "_g-1_")
    k, sass, regs = compile_to_sass(
        ttir.replace("_g-1_", "_gm1_"), out, "qmatmul", num_warps, tuning.get("num_stages", 3)
    )
    per_plane = plane * bn // (32 * num_warps)  # weights of one plane per thread
    print(
        f"{args.dequant} {'fma' if args.fma else 'mma'} M={args.m} int{args.bits} g{args.group_size} "
        f"{'asym' if args.asym else 'sym'} {dt.name} BN={bn} warps={num_warps} {tuning}: "
        f"registers {regs}, shared {k.metadata.shared} B, files in {out}"
    )
    # planes per loop iteration: MMA from its HMMA / HGMMA count (m16n8k16: L / 16 per dot and warp's 8 columns;
    # wgmma: L / 16 per dot; two dots per plane on the int4 asm path); FMA: the innermost loop is one plane with
    # plane_loop, else a tile
    dots = 2 if args.dequant == "asm" and args.bits == 4 else 1
    hmma_per_plane = plane // 16 * dots * max(1, bn // (8 * num_warps))
    hgmma_per_plane = plane // 16 * dots  # M = 64: Hopper's warpgroup MMA, one per K step of 16 and dot
    plane_loop = tuning.get("plane_loop", not args.fma)
    for i, (start, end, n, ops) in enumerate(sass_loops(sass)):
        inner = i == 0
        mmas = ops["HMMA"] / hmma_per_plane + ops["HGMMA"] / hgmma_per_plane
        planes = mmas if not args.fma else (1 if plane_loop and inner else P)
        rate = f", {n / (planes * per_plane):.2f} per weight ({planes:g} planes)" if planes else ""
        print(f"  loop {start:#x}..{end:#x}: {n} instructions{rate}; {dict(ops.most_common(16))}")
    return k


if __name__ == "__main__":
    main()
