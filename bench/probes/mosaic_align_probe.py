"""Finding: Mosaic GPU kernels refuse inputs off 256-byte boundaries and XLA passes a static slice as its buffer
at the slice's offset, so pack_host_args starts every array on a 256-byte boundary (KERNELS_NOTES, 29176ac).

Do Mosaic GPU kernels get 256-byte-aligned inputs when an input is a static slice of a step argument?

Mosaic GPU's custom call refuses any input whose address is not a multiple of 256 bytes ("Input buffer i is
not 256-byte aligned"). The engine packs its host arrays into one int32 buffer and slices them back out in the
step (packing.pack_host_args), so a kernel input may be a slice that starts anywhere in that buffer. This calls
the Mosaic decode kernel with seq_lens and the block table as slices of one int32 argument at several
offsets (and through an elementwise op, which makes a buffer of its own), and records which calls fail.

    python bench/probes/mosaic_align_probe.py --out $OUT/mosaic_align_probe.json
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.common import environment, write_result  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    from kernels_pallas._decode_mgpu import paged_decode_mgpu

    B, N, K, H, S, M = 4, 32, 8, 128, 16, 64
    P = B * M + 1
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.bfloat16)
    kp = jnp.asarray(rng.standard_normal((K, P, S, H)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((K, P, S, H)), jnp.bfloat16)
    lens = np.full(B, 700, np.int32)
    table = rng.permutation(P - 1)[: B * M].astype(np.int32) + 1
    rows = []
    for off in (0, 1, 16, 32, 64, 100, 128):
        for how in ("slice", "slice_then_max"):
            ints = np.zeros(off + B + B * M + 7, np.int32)
            ints[off : off + B] = lens
            ints[off + B : off + B + B * M] = table

            def f(ints, q, kp, vp, off=off, how=how):
                sl = jax.lax.slice(ints, (off,), (off + B,))
                bt = jax.lax.slice(ints, (off + B,), (off + B + B * M,)).reshape(B, M)
                if how == "slice_then_max":
                    sl, bt = jnp.maximum(sl, 0), jnp.maximum(bt, 0)
                return paged_decode_mgpu(q, kp, vp, sl, bt, scale=H**-0.5)

            row = dict(offset_ints=off, seq_lens_byte_offset=4 * off, table_byte_offset=4 * (off + B), how=how)
            try:
                comp = jax.jit(f).lower(ints, q, kp, vp).compile()
                hlo = comp.as_text()
                row["hlo_has_dynamic_slice_fusion"] = "dynamic_slice_fusion" in hlo or "address_computation" in hlo
                jax.block_until_ready(comp(ints, q, kp, vp))
                row["ok"] = True
            except Exception as e:  # noqa: BLE001 - the failure is the measurement
                row["ok"] = False
                row["error"] = str(e)[:300]
            print(row, flush=True)
            rows.append(row)
    write_result("mosaic_align_probe", dict(env=environment(), rows=rows), args.out)


if __name__ == "__main__":
    main()
