"""What the fused paged decode attention kernel compiles to, without a GPU: lowers
kernels_pallas._decode.fused_decode_attention_kernel for CUDA on the CPU, compiles the Triton IR of its attention
pallas_call for sm_90 with the PyPI `triton` wheel (as bench/probes/qmatmul_sass.py does; `pip install triton`) and
prints registers, shared memory, the global load widths of the whole kernel and the instruction mix of its loops,
with instructions per KV byte (the main loop's instructions per warp x warps / the block's K + V bytes).

    python bench/probes/decode_sass.py --kv-dtype float8_e4m3fn [--batch 512 --ctx 600 --tuning '{"block_k": 64}']
        [--keep DIR]

Indicative only (XLA's own Triton build compiles the kernel on the GPU); bench/kernels.py's decode stages time it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from qmatmul_sass import compile_to_sass, sass_loops, triton_ir  # noqa: E402

from kernels_pallas import _decode  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--ctx", type=int, default=600)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--kv-dtype", default="float8_e4m3fn")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tuning", default="{}", help="JSON of the kernel's tuning kwargs (block_k, num_warps, ...)")
    p.add_argument("--keep", default=None)
    args = p.parse_args(argv)
    B, K, G, H, S = args.batch, args.kv_heads, args.group, args.head_dim, args.page
    dt, kdt = jnp.dtype(args.dtype), jnp.dtype(args.kv_dtype)
    tuning = json.loads(args.tuning)
    M = -(-args.ctx // S) + 2
    P = B * M
    avals = [
        jax.ShapeDtypeStruct((B, K, G + 2, H), dt),
        jax.ShapeDtypeStruct((B,), jnp.int32),
        jax.ShapeDtypeStruct((H // 2,), jnp.float32),
        jax.ShapeDtypeStruct((K, P, S, H), kdt),
        jax.ShapeDtypeStruct((K, P, S, H), kdt),
        jax.ShapeDtypeStruct((B,), jnp.int32),
        jax.ShapeDtypeStruct((B,), jnp.int32),
        jax.ShapeDtypeStruct((B, M), jnp.int32),
    ]

    def f(qkv, pos, freq, kp, vp, slots, lens, bt):
        return _decode.fused_decode_attention_kernel(
            qkv, pos, freq, kp, vp, slots, lens, bt, scale=H**-0.5, k_scale=1.0, v_scale=1.0, **tuning
        )

    irs = triton_ir(f, *avals)
    ttir = irs[0]  # the attention kernel (a split-K plan adds the combine kernel after it)
    warps = tuning.get("num_warps", 4)
    out = args.keep or tempfile.mkdtemp()
    k, sass, regs = compile_to_sass(ttir, out, "decode", warps, tuning.get("num_stages", 1))
    bk = tuning.get("block_k") or _decode.default_block_k(B, K)
    kv_bytes = 2 * bk * H * kdt.itemsize
    print(
        f"decode {kdt.name} pages, {dt.name} q, B={B} ctx={args.ctx} {tuning}: block_k {bk} ({kv_bytes} KV bytes a "
        f"block), registers {regs}, shared {k.metadata.shared} B, {len(irs)} kernel(s), "
        f"files in {out}"
    )
    loads = collections.Counter(re.findall(r"\b(LDG(?:STS)?\.E[.A-Z0-9_]*|LDS[.A-Z0-9_]*|LDSM[.A-Z0-9_]*)", sass))
    print(f"  loads in the kernel: {dict(loads)}")
    for start, end, n, ops in sass_loops(sass):
        print(
            f"  loop {start:#x}..{end:#x}: {n} instructions, {n * warps / kv_bytes:.3f} per KV byte; "
            f"{dict(ops.most_common(18))}"
        )
    return k


if __name__ == "__main__":
    main()
