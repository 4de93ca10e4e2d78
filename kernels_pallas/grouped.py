"""The mixture-of-experts grouped GEMM, entry point beside its pure-jnp reference.

grouped_matmul(rows [M, K], sizes [E] int32, w [E, K, N], *, out_dtype=None, backend="auto", interpret=False,
               **tuning) -> [M, N] in out_dtype (default rows' dtype)
    rows sorted by expert: rows[sum(sizes[:e]) : sum(sizes[:e + 1])] times w[e]; rows past sum(sizes) are zeros.
    On GPU the Pallas kernel (_grouped.py: tiles of one expert's rows, only the experts with rows read);
    off GPU (and not interpret), and for inputs the kernel does not take (_grouped.supported), the reference.
    backend: "auto" | "kernel" | "reference" (tests and benchmarks force one).
grouped_matmul_ref: jax.lax.ragged_dot, float32 accumulation, the rows past the groups set to zero. XLA's GPU
    lowering of ragged_dot is one dense dot over all E experts (E times the FLOPs: bench/moe_matmul.py), which
    is why the kernel exists; on CPU it computes each group on its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _grouped
from ._common import on_gpu


def grouped_matmul_ref(rows, sizes, w, *, out_dtype=None):
    M = rows.shape[0]
    out = jax.lax.ragged_dot(rows, w.astype(rows.dtype), sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    live = jnp.arange(M) < jnp.minimum(jnp.sum(sizes), M)
    return jnp.where(live[:, None], out, 0.0).astype(out_dtype or rows.dtype)


def grouped_matmul(rows, sizes, w, *, out_dtype=None, backend="auto", interpret=False, **tuning):
    if backend not in ("auto", "kernel", "reference"):
        raise ValueError(f"backend={backend!r} is not one of 'auto', 'kernel', 'reference'.")
    ok = _grouped.supported(rows.dtype, rows.shape[1], w.shape[2])
    if backend == "kernel" and not ok:
        raise ValueError(
            f"the grouped GEMM kernel does not take {rows.dtype} rows [{rows.shape[0]}, {rows.shape[1]}] "
            f"times weights {w.shape} (see _grouped.supported)"
        )
    if backend == "reference" or not (ok and (interpret or on_gpu() or backend == "kernel")):
        return grouped_matmul_ref(rows, sizes, w, out_dtype=out_dtype)
    # backend="kernel" off GPU runs in interpret mode (the Triton lowering needs a GPU)
    return _grouped.grouped_matmul_kernel(
        rows, sizes.astype(jnp.int32), w, out_dtype=out_dtype, interpret=interpret or not on_gpu(), **tuning
    )
