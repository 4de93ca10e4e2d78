"""Quantized linear layers: weight-only int4 / int8 (GPTQ, AWQ, compressed-tensors W4A16 / W8A16) and FP8 W8A8
(compressed-tensors FP8, quantization="fp8"), each entry point beside its pure-jnp reference.

  quantized_matmul(x [..., K], w: QuantizedWeight, *, split=False, max_kernel_m=MAX_KERNEL_M, backend="auto",
                   interpret=False, **tuning) -> [..., N] in x's dtype (split: a tuple, one array per w.parts)
      Decode and small batches (M = prod(x.shape[:-1]) <= max_kernel_m) run the Pallas kernel (_qmatmul.py),
      which streams the packed weight once and dequantizes in registers; larger batches (offline decode, prefill)
      dequantize the weight to x's dtype (a Pallas pass on a GPU, _qunpack.py; else one XLA fusion) and multiply
      with XLA's GEMM (cuBLAS / Triton). Off GPU (and not interpret), and for inputs the kernel does not take
      (_qmatmul.supported), the dequantize + dot path runs. max_kernel_m (default MAX_KERNEL_M = 128) by
      measurement on an H100 (bench/quant_kernels.py): the kernel is 2-5x faster than dequantize + dot at every
      M <= 64 of the 8B projections and 1.1-1.5x at 128 (128-row blocks, LARGE_M_TILING); at 256 the dense weight
      + GEMM is 1.18x faster summed over the four (both 1.4-2.9x slower than bf16).
      backend: "auto" | "kernel" | "dequant" (tests and benchmarks force one). tuning: the kernel's static options,
      among them dequant="asm" (inline-PTX dequantization, _qdequant.py; "float" by default until measured).
      Fused projections (qkv, gate / up): pack the concatenated [K, N1 + N2 + ...] weight once with
      parts=(N1, N2, ...) and call once; split=True returns the parts (slices of one output).
  fp8_matmul(x [..., K], w [N, K] float8_e4m3fn, w_scale (scalar or [N]), *, x_scale=None, act_scale="token",
             out_dtype=None, widen=None) -> [..., N]
      x quantized to e4m3 in the same jitted function (dynamic per-token scales, or per-tensor, or a static
      x_scale), one fp8 x fp8 dot with float32 accumulation (Hopper's FP8 tensor cores through XLA), its output
      in bfloat16 for a 16-bit result (FP8_DOT_BF16), the scales applied after it in float32. Up to
      FP8_WIDEN_MAX_ROWS rows (widen=None) XLA's GEMM multiplies both fp8 operands widened to bfloat16 instead (x
      before an optimization barrier, the weight inside the GEMM): the same products (exact) and float32 sums, a
      faster GEMV. fp8_matmul_quantized(xq, sx, w, w_scale, out_dtype): the dot for x already in e4m3.
  fp8_silu_mlp(h [T, D], w_gate_up [2F, D], gate_up_scale, w_down [D', F], down_scale) -> [T, D']
      An fp8 W8A8 MLP (dynamic token scales): fp8_matmul's gate / up dot, then its scales, silu(gate) * up and the
      e4m3 rounding of that product for down in one Pallas pass (silu_mul_fp8, _silu_mul_fp8.py), then down's dot.
      The decoder's fp8 MLPs of more than 2 rows run it (jaxllm/models/quant_matmul.py silu_mlp).
  add_rms_norm(x [T, D], parts [S, T, D], weight, eps, *, plus_one=False, fp8=False) -> (r, h)
      The residual add of split-K partials and the norm after it in one Pallas pass (_add_rms_norm.py); fp8: h as
      Fp8Rows for an fp8 W8A8 projection's fp8_gemv.
  rms_norm_fp8(x [T, D], weight, eps, *, plus_one=False) -> (xq [T, D] e4m3, sx [T, 1] float32)
      The decoder's RMSNorm and quantize_activations' per-token e4m3 rounding of its output in one Pallas pass
      (_rms_norm_fp8.py): the input of an fp8 W8A8 qkv or gate / up projection of more than 2 rows, as Fp8Rows
      (fp8_silu_mlp and jaxllm/models/quant_matmul.py qmatmul take them in place of x).
  fp8_gemv(x [..., K] of 1-2 rows, w, w_scale, *, residual=None) -> [..., N]
      The same function (dynamic per-token scales) with the scales' reduction and x's e4m3 rounding inside one
      split-K Pallas GEMV (_fp8_gemv.py), its float32 partials summed (and added to the residual) in the XLA fusion
      after it; fp8_gemv_partials returns the partials for a consumer that sums them (the qkv/RoPE/write kernel).
      The decoder's fp8 W8A8 projections of the batch-1 decode bucket run it (H100, 8B: four kernels a projection
      become two; batch-1 ITL 3.54 vs 3.65 ms, bench/KERNELS_NOTES.md "Measured in stop 47"). x may also be Fp8Rows
      (e4m3 with its token scales: add_rms_norm(fp8=True) writes them) or RowsWithMax (partial maxima of |x| a row);
      the kernel then skips its pass over x's row.
  fp8_gemv_silu(h [T, D] of 1-2 rows, w_gate_up [2F, D], w_scale) -> RowsWithMax (a = silu(gate) * up [T, F], the
      maxima of |a| over each program's columns)
      gate / up's GEMV with silu * up as its epilogue (_fp8_gemv.fp8_gemv_silu_kernel), for down's fp8_gemv.

The weight layout, the act-order permutation and the helpers that build a QuantizedWeight from a checkpoint's
integers are in qlayout.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from . import _add_rms_norm, _fp8_gemv, _qmatmul, _qunpack, _rms_norm_fp8, _silu_mul_fp8, qlayout
from ._common import on_gpu
from .qlayout import QuantizedWeight, padded_k

# Batches above MAX_KERNEL_M rows take the dequantize + GEMM path (see quantized_matmul). H100, int4 g128, the 8B
# shapes (bench/results/quant_kernels_h100_fcdb7d1_max_kernel_m.json), kernel with 128-row blocks / dense weight +
# GEMM, us: M 128 qkv 45.1 / 48.8, o 20.4 / 30.3, gate_up 167.7 / 203.5, down 86.7 / 107.0; M 256 53.9 / 51.5,
# 34.4 / 34.8, 283.1 / 219.4, 120.2 / 111.8 (bf16 at M 256: 30.9 / 21.6 / 98.7 / 52.4).
MAX_KERNEL_M = 128
# The dequantize + GEMM path writes the dense weight with _qunpack's kernel on a GPU (False: XLA's fusion of
# qlayout.dequantize, for A/B runs). H100, 8B GPTQ int4, 500 x 462 / 256 offline: 36.88 against 34.60 req/s (bf16
# 39.57 in the same call; bench/results/throughput_*_h100_ad75e1a*.json): the unpack kernels take 203 us a layer of
# a 500-row decode step where XLA's fusions took 280 (throughput_gptq_h100_ad75e1a_unpack_prof.json).
UNPACK_KERNEL = True
# The kernel's tiling for more than _qmatmul.MAX_BLOCK_M rows (a multiple of 128): 128-row blocks dequantize each
# weight tile once per 128 rows. H100, M = 256 (bench/results/quant_kernels_h100_16d6b33_block_m.json): qkv 54.5,
# o 34.5, gate_up 288.4, down 120.1 us against XLA's dequantize fusion + dot's 63.9 / 43.2 / 332.6 / 134.4 and
# 64-row blocks' 67.9 / 44.6 / 292.5 / 148.9 (bf16: 30.9 / 21.8 / 98.2 / 52.4).
LARGE_M_TILING = dict(block_m=128, block_n=64, num_warps=8)
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor for dynamic scales (an all-zero row stays finite)
# fp8_matmul of up to this many rows (the engine's batch-1 decode bucket) widens its fp8 operands to bfloat16 for
# XLA's GEMM: every e4m3 value is a bfloat16 and their products are exact in the float32 accumulator, so the W8A8
# function is unchanged, and XLA's GEMM reads the fp8 weight widened inside it faster than cuBLASLt's fp8 GEMM reads
# it at 1-2 rows. The widened x passes an optimization barrier: XLA's GEMM rewriter turns a dot of two widened fp8
# operands back into the fp8 GEMM (1ba9c3d: no change). H100, 8B shapes, whole call with the activation scales, us
# (bench/results/quant_kernels_h100_9700915_widened.json): M 2 qkv 15.2 vs 18.1, o 12.0 vs 12.4, gate_up 47.0 vs
# 51.1, down 27.4 vs 31.9; M 64 slower (23.5 vs 18.9, 19.4 vs 16.0, 60.1 vs 55.0, 38.6 vs 34.2). Engine, 8B fp8,
# same call (latency_fp8_h100_9700915_*.json): batch-1 ITL 3.84 vs 4.14 ms; with this at 64 rows batch 64 took
# 16.3 ms against 5.86 (not traced), so only the 2-row bucket widens.
FP8_WIDEN_MAX_ROWS = 2
# fp8_matmul's fp8 x fp8 dot (above FP8_WIDEN_MAX_ROWS rows) returns bfloat16 where the result is 16-bit: the
# GEMM writes half the bytes, and the fusion after it (scales, then the consumer: silu * up, the residual add, the
# next token quantization) reads half. The product is rounded twice (bfloat16 before the scales, x's dtype after),
# against once with a float32 GEMM output; bfloat16 keeps float32's range, so float16 models do not overflow.
# JAXLLM_FP8_DOT_BF16=0 turns it off (A/B runs).
FP8_DOT_BF16 = os.environ.get("JAXLLM_FP8_DOT_BF16", "1") == "1"


def _split(y, w: QuantizedWeight, split: bool):
    if not split:
        return y
    if w.parts is None:
        raise ValueError("split=True needs a weight packed with parts=(...)")
    out, at = [], 0
    for p in w.parts:
        out.append(y[..., at : at + p])
        at += p
    return tuple(out)


def quantized_matmul_ref(x, w: QuantizedWeight, *, split=False):
    """x @ W with W dequantized to x's dtype (float32 accumulation, rounded once to x's dtype): the reference, and
    the large-batch path (one XLA elementwise fusion writes W, then XLA's GEMM)."""
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} features; the weight takes K={w.k}")
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    y = jnp.einsum("...k,kn->...n", x, qlayout.dequantize(w, x.dtype), preferred_element_type=jnp.float32)
    return _split(y.astype(x.dtype), w, split)


def tie_to_input(x, w):
    """(x, w) through one optimization barrier: whatever is computed from the returned w (its dequantization)
    waits for x, so the large-batch path's dequantized weight lives from its matmul's input to the matmul, not
    longer. w: a QuantizedWeight or any pytree of arrays.

    Dequantizing a weight depends on the weight alone, so in a model's step (every layer inlined into one program)
    XLA may schedule every layer's dequantization before the first layer runs, all of the model's dequantized
    weights live at once: an 8B GPTQ int4 engine's prefill step asked for a 9.3 GiB temporary buffer on an H100
    and ran out of memory (bench/results/quant_h100_23c93ec_log.txt); the CPU schedule of the same step
    dequantized all of its layers up front (tests/test_quant_memory.py). The barrier makes w's uses wait for x,
    which is this layer's activation. It aliases its operands: no copy, no cost. The dequantization itself stays
    after it (not inside), so XLA may still fuse it into the GEMM's operand."""
    return jax.lax.optimization_barrier((x, w))


def _dequant_matmul(x, w, interpret=False):
    x, w = tie_to_input(x, w)
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    if UNPACK_KERNEL and (interpret or on_gpu()) and _qunpack.supported(w.n, w.group_size, w.plane, w.kp, w.bits):
        dense = _qunpack.unpack_kernel(
            w.qweight,
            w.scales,
            w.zeros,
            bits=w.bits,
            group_size=w.group_size,
            plane=w.plane,
            dtype=jnp.dtype(x.dtype),
            interpret=interpret,
        )
        if w.kp != w.k:  # the layout's zero rows meet zero columns of x (cheaper than slicing the weight)
            x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, w.kp - w.k)])
    else:
        dense = qlayout.dequantize(w, x.dtype)
    return jnp.einsum("...k,kn->...n", x, dense)


def kernel_m(m: int, fma: bool, dequant: str = "float") -> int:
    """Rows the kernel runs for m rows: a power of two up to 64 (at least MMA_MIN_ROWS for the float path's MMA
    variant, which stacks copies of x's rows in registers; the asm path loads its copies by row index and takes
    any power of two), else a multiple of 64."""
    if m <= _qmatmul.MAX_BLOCK_M:
        least = 1 if fma or dequant != "float" else _qmatmul.MMA_MIN_ROWS
        return max(1 << max(0, (m - 1).bit_length()), least)
    return -(-m // _qmatmul.MAX_BLOCK_M) * _qmatmul.MAX_BLOCK_M


def uses_kernel(x, w: QuantizedWeight, *, max_kernel_m=MAX_KERNEL_M, backend="auto", interpret=False) -> bool:
    """Whether quantized_matmul runs the Pallas kernel for x times w (else dequantize + XLA's GEMM): backend
    "kernel", or "auto" with inputs _qmatmul.supported takes, on a GPU or in interpret mode, at most max_kernel_m
    rows. ValueError for backend "kernel" with inputs the kernel does not take."""
    if backend not in ("auto", "kernel", "dequant"):
        raise ValueError(f"backend={backend!r} is not one of 'auto', 'kernel', 'dequant'")
    ok = _qmatmul.supported(x.dtype, w.n, w.bits, w.group_size, w.plane)
    if backend == "kernel" and not ok:
        raise ValueError(
            f"the quantized matmul kernel does not take these inputs (x {x.dtype}, N={w.n}, "
            f"bits={w.bits}, group_size={w.group_size}, plane={w.plane}); see _qmatmul.supported"
        )
    rows = math.prod(x.shape[:-1])
    return backend == "kernel" or (backend == "auto" and ok and (interpret or on_gpu()) and rows <= max_kernel_m)


def quantized_matmul(
    x,
    w: QuantizedWeight,
    *,
    split=False,
    max_kernel_m=MAX_KERNEL_M,
    backend="auto",
    interpret=False,
    partials=False,
    **tuning,
):
    """See the module docstring. tuning: _qmatmul.qmatmul_kernel's block_n, block_m, splits, plane_loop, fma,
    dequant (_qmatmul.DEQUANT: "float", "asm", "asm_sub"), num_warps, num_stages. partials: the kernel's float32
    split-K partials [S, ..., N] unsummed (S = 1 where the plan does not split K), for a consumer that sums them (the
    qkv/RoPE/write kernel); the kernel path only (ValueError where the call would dequantize)."""
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} features; the weight takes K={w.k}")
    lead = x.shape[:-1]
    M = math.prod(lead)
    use_kernel = uses_kernel(x, w, max_kernel_m=max_kernel_m, backend=backend, interpret=interpret)
    if partials and (split or not use_kernel):
        raise ValueError("partials=True needs the kernel path and split=False")
    if not use_kernel:
        return _split(_dequant_matmul(x, w, interpret), w, split)
    x2 = x.reshape(M, w.k)
    if w.perm is not None:
        x2 = jnp.take(x2, w.perm, axis=1)
    fma = tuning.pop("fma", None)
    fma = M <= _qmatmul.FMA_MAX_M if fma is None else fma
    if fma and M > 4:  # checked here: the kernel sees the rows padded to its block
        raise ValueError(f"fma=True takes at most 4 rows (one [L, BN] accumulator each), got {M}")
    Mp, Kp = kernel_m(M, fma, tuning.get("dequant", "float")), padded_k(w.k, w.bits, w.plane)
    if not tuning.keys() - {"dequant"} and Mp > _qmatmul.MAX_BLOCK_M and Mp % 128 == 0 and w.n % 64 == 0:
        tuning = dict(LARGE_M_TILING, **tuning)
    if (Mp, Kp) != (M, w.k):  # rows up to the kernel's block, K's zero padding (the layout's padded rows)
        x2 = jnp.pad(x2, ((0, Mp - M), (0, Kp - w.k)))
    y = _qmatmul.qmatmul_kernel(
        x2,
        w.qweight,
        w.scales,
        w.zeros,
        bits=w.bits,
        group_size=w.group_size,
        plane=w.plane,
        fma=fma,
        interpret=interpret,
        **tuning,
    )
    if partials:
        y = (y if y.ndim == 3 else y[None]).astype(jnp.float32)[:, :M]
        return y.reshape(y.shape[0], *lead, w.n)
    if y.ndim == 3:  # split-K partials
        y = y.sum(0).astype(x.dtype)
    if Mp != M:
        y = y[:M]
    return _split(y.reshape(*lead, w.n), w, split)


# ---- FP8 W8A8 -------------------------------------------------------------------------------------------------
def quantize_fp8(w, *, per_channel=True):
    """A float weight [N, K] (torch Linear's layout: out x in) -> (w_fp8 [N, K] float8_e4m3fn, scale [N] float32, or a
    scalar per tensor), scale = max|w| / 448 over each row (over the whole tensor). For quantization="fp8" (16-bit
    checkpoints quantized at load) and tests; compressed-tensors FP8 checkpoints bring their own."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.abs(w).max(axis=1) if per_channel else jnp.abs(w).max()
    scale = jnp.maximum(amax / FP8_MAX, FP8_MIN_SCALE)
    s = scale[:, None] if per_channel else scale
    return jnp.clip(w / s, -FP8_MAX, FP8_MAX).astype(FP8), scale


def quantize_activations(x, *, x_scale=None, act_scale="token"):
    """x [M, K] -> (x_fp8, scale [M, 1] or [1, 1] float32): a static x_scale, or dynamic per token ("token": one
    scale per row, max|x_m| / 448) or per tensor ("tensor")."""
    x32 = x.astype(jnp.float32)
    if x_scale is not None:
        s = jnp.asarray(x_scale, jnp.float32).reshape(1, 1)
    elif act_scale == "token":
        s = jnp.maximum(jnp.abs(x32).max(axis=1, keepdims=True) / FP8_MAX, FP8_MIN_SCALE)
    elif act_scale == "tensor":
        s = jnp.maximum(jnp.abs(x32).max().reshape(1, 1) / FP8_MAX, FP8_MIN_SCALE)
    else:
        raise ValueError(f"act_scale={act_scale!r} is not 'token' or 'tensor'")
    return jnp.clip(x32 / s, -FP8_MAX, FP8_MAX).astype(FP8), s


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scale"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """Activations already rounded to e4m3 per token (rms_norm_fp8's output): q [T, K] float8_e4m3fn, scale [T, 1]
    float32; dtype: the 16-bit dtype they stand for (the product's). fp8_silu_mlp takes them in place of h, and
    jaxllm.models.quant_matmul.qmatmul for a column-parallel fp8 W8A8 weight."""

    q: jax.Array
    scale: jax.Array
    dtype: Any

    @property
    def shape(self):
        return self.q.shape


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "amax"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RowsWithMax:
    """16-bit activations x [T, K] with partial maxima of |x| per row, amax [T, P] float32 (their max over P is the
    row's): fp8_gemv_silu's output, whose programs each saw P-th of a row. fp8_gemv takes them in place of x and
    reads P values a row for its token scales instead of K."""

    x: jax.Array
    amax: jax.Array

    @property
    def shape(self):
        return self.x.shape

    @property
    def dtype(self):
        return self.x.dtype


def _fp8_check(x, w, w_scale):
    if w.ndim != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"fp8 weight must be [N, K] with K = x's {x.shape[-1]} features; got {w.shape}")
    if jnp.dtype(w.dtype) != jnp.dtype(FP8):
        raise ValueError(f"fp8 weight must be float8_e4m3fn, got {w.dtype}")
    if jnp.ndim(w_scale) not in (0, 1) or (jnp.ndim(w_scale) == 1 and jnp.shape(w_scale)[0] not in (1, w.shape[0])):
        raise ValueError(f"w_scale must be a scalar or [N={w.shape[0]}]; got shape {jnp.shape(w_scale)}")


def _fp8(x, w, w_scale, x_scale, act_scale, out_dtype, dot):
    _fp8_check(x, w, w_scale)
    lead, K = x.shape[:-1], x.shape[-1]
    xq, sx = quantize_activations(x.reshape(-1, K), x_scale=x_scale, act_scale=act_scale)
    return _scaled(dot(xq, w), sx, w_scale, out_dtype or x.dtype).reshape(*lead, w.shape[0])


def _scaled(y, sx, w_scale, out_dtype):
    return (y.astype(jnp.float32) * sx * jnp.asarray(w_scale, jnp.float32).reshape(1, -1)).astype(out_dtype)


def _fp8_dot(widen: bool, narrow_out: bool):
    def dot(a, b):
        if widen:
            a, b = jax.lax.optimization_barrier(a.astype(jnp.bfloat16)), b.astype(jnp.bfloat16)
        out = jnp.bfloat16 if narrow_out else jnp.float32
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out)

    return dot


def fp8_matmul(x, w, w_scale, *, x_scale=None, act_scale="token", out_dtype=None, widen=None):
    """See the module docstring: one fp8 x fp8 dot ([M, K] . [N, K]^T, the layout cuBLASLt's FP8 GEMM wants:
    both operands K-major), bfloat16 out for a 16-bit result (FP8_DOT_BF16; else float32), scaled by the token and
    channel scales in the fusion after it. widen: multiply the fp8 operands widened to bfloat16 (None: for up to
    FP8_WIDEN_MAX_ROWS rows; float32 out)."""
    if widen is None:
        widen = math.prod(x.shape[:-1]) <= FP8_WIDEN_MAX_ROWS
    narrow_out = FP8_DOT_BF16 and not widen and jnp.dtype(out_dtype or x.dtype).itemsize == 2
    return _fp8(x, w, w_scale, x_scale, act_scale, out_dtype, _fp8_dot(widen, narrow_out))


def fp8_matmul_quantized(xq, sx, w, w_scale, out_dtype):
    """fp8_matmul's product for x already rounded to e4m3: xq [M, K] float8_e4m3fn, sx [M, 1] float32 (its token
    scales, e.g. silu_mul_fp8's) -> [M, N] in out_dtype. The fp8 x fp8 dot at every M (no widening)."""
    _fp8_check(xq, w, w_scale)
    if jnp.dtype(xq.dtype) != jnp.dtype(FP8) or sx.shape != (xq.shape[0], 1):
        raise ValueError(f"xq must be float8_e4m3fn [M, K] with sx [M, 1]; got {xq.dtype} {xq.shape}, {sx.shape}")
    narrow_out = FP8_DOT_BF16 and jnp.dtype(out_dtype).itemsize == 2
    return _scaled(_fp8_dot(False, narrow_out)(xq, w), sx, w_scale, out_dtype)


def silu_mul_fp8(gu, row_scale=None, col_scale=None, *, interpret=False, **tuning):
    """gu [T, 2, F] (gate, up; 16-bit) -> (xq [T, F] e4m3, sx [T, 1] float32): silu(gate) * up in float32 rounded
    to e4m3 with dynamic per-token scales (quantize_activations' "token"), one Pallas pass (_silu_mul_fp8.py) where
    silu_mul_fp8_supported, else the jnp reference. row_scale [T, 1] / col_scale [2, F]: gu is an fp8 GEMM's
    unscaled product (fp8_silu_mlp), gate / up = gu * row_scale * col_scale in float32."""
    if not silu_mul_fp8_supported(gu) or not (interpret or on_gpu()):
        return silu_mul_fp8_ref(gu, row_scale, col_scale)
    return _silu_mul_fp8.silu_mul_fp8_kernel(
        gu, row_scale, col_scale, min_scale=FP8_MIN_SCALE, interpret=interpret, **tuning
    )


def rms_norm_fp8(x, weight, eps, *, plus_one=False, interpret=False, **tuning):
    """RMSNorm of x [T, D] (16-bit) rounded to e4m3 with dynamic per-token scales: (xq [T, D] e4m3, sx [T, 1]
    float32), quantize_activations(norm(x)) in one Pallas pass (_rms_norm_fp8.py) where rms_norm_fp8_supported,
    else the jnp reference. plus_one: Gemma's norm (x scaled by 1 + weight in float32)."""
    if not rms_norm_fp8_supported(x) or not (interpret or on_gpu()):
        return rms_norm_fp8_ref(x, weight, eps, plus_one=plus_one)
    return _rms_norm_fp8.rms_norm_fp8_kernel(
        x, weight, eps=float(eps), min_scale=FP8_MIN_SCALE, plus_one=plus_one, interpret=interpret, **tuning
    )


def add_rms_norm(x, parts, weight, eps, *, plus_one=False, fp8=False, interpret=False, **tuning):
    """The residual add of split-K partials and the RMSNorm after it: x [T, D] (16-bit), parts [S, T, D] float32 ->
    (r = x + sum(parts) [T, D], h = norm(r) [T, D]) in one Pallas pass (_add_rms_norm.py) where add_rms_norm_supported,
    else add_rms_norm_ref. plus_one: Gemma's norm (r scaled by 1 + weight in float32). fp8: h as Fp8Rows (rounded
    to e4m3 with its token scales in the same pass, rms_norm_fp8's values) for an fp8 W8A8 projection's GEMV."""
    if not add_rms_norm_supported(x, parts) or not (interpret or on_gpu()):
        r, h = add_rms_norm_ref(x, parts, weight, eps, plus_one=plus_one)
        return (r, Fp8Rows(*quantize_activations(h), x.dtype)) if fp8 else (r, h)
    min_scale = FP8_MIN_SCALE if fp8 else None
    out = _add_rms_norm.add_rms_norm_kernel(
        x, parts, weight, eps=float(eps), plus_one=plus_one, min_scale=min_scale, interpret=interpret, **tuning
    )
    return (out[0], Fp8Rows(out[1], out[2], x.dtype)) if fp8 else out


def add_rms_norm_supported(x, parts) -> bool:
    return x.ndim == 2 and parts.ndim == 3 and _add_rms_norm.supported(x.dtype, x.shape[1], parts.shape[0])


def add_rms_norm_ref(x, parts, weight, eps, *, plus_one=False):
    """The decoder's residual add of a projection summed from its partials (rounded to x's dtype, as the kernels'
    wrappers sum them) and its RMSNorm (HF's rounding; Gemma's with plus_one)."""
    r = x + parts.sum(0).astype(x.dtype)
    return r, _rms_norm_ref(r, weight, eps, plus_one)


def _rms_norm_ref(x, weight, eps, plus_one):
    """The decoder's RMSNorm: n in float32, rounded to x's dtype, times the weight (HF); plus_one: times 1 + weight in
    float32, rounded once (Gemma)."""
    x32 = x.astype(jnp.float32)
    n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (n * (1.0 + weight.astype(jnp.float32))).astype(x.dtype) if plus_one else weight * n.astype(x.dtype)


def rms_norm_fp8_supported(x) -> bool:
    return x.ndim == 2 and _rms_norm_fp8.supported(x.dtype, x.shape[1])


def rms_norm_fp8_ref(x, weight, eps, *, plus_one=False):
    """The decoder's RMSNorm (HF's rounding: n in float32 rounded to x's dtype, times the weight; Gemma's: times
    1 + weight in float32, rounded once), then quantize_activations' per-token e4m3."""
    return quantize_activations(_rms_norm_ref(x, weight, eps, plus_one))


def silu_mul_fp8_supported(gu) -> bool:
    return gu.ndim == 3 and gu.shape[1] == 2 and _silu_mul_fp8.supported(gu.dtype, gu.shape[2])


def silu_mul_fp8_ref(gu, row_scale=None, col_scale=None):
    gu = gu.astype(jnp.float32)
    if row_scale is not None:
        gu = gu * row_scale[:, :, None] * col_scale[None]
    g, u = gu[:, 0], gu[:, 1]
    return quantize_activations(jax.nn.silu(g) * u)


def fp8_silu_mlp(h, w_gate_up, gate_up_scale, w_down, down_scale, *, out_dtype=None, interpret=False):
    """An fp8 W8A8 MLP with dynamic token scales: down(silu(gate) * up) for h [T, D] (16-bit, or Fp8Rows: h already
    rounded to e4m3 with its token scales), w_gate_up [2F, D] / w_down [D', F] e4m3 with channel scales [2F] / [D']
    (or per tensor) -> [T, D'] in out_dtype (h's).
    h rounded to e4m3 by XLA (token scales) unless given so, its fp8 GEMM's product in bfloat16 unscaled, the scales,
    silu * up and the e4m3 rounding of its result in one Pallas pass (silu_mul_fp8), the down projection's fp8 GEMM.
    Against fp8_matmul, silu * up, fp8_matmul: gate / up stay float32 between the GEMM and silu * up (XLA's fusion of
    the three keeps them so too where it fuses them)."""
    T = h.shape[0]
    out_dtype = out_dtype or h.dtype
    _fp8_check(h, w_gate_up, gate_up_scale)
    xq, sx = (h.q, h.scale) if isinstance(h, Fp8Rows) else quantize_activations(h)
    p = _fp8_dot(False, True)(xq, w_gate_up)  # [T, 2F] unscaled, bfloat16
    F = w_gate_up.shape[0] // 2
    cs = jnp.broadcast_to(jnp.asarray(gate_up_scale, jnp.float32).reshape(-1), (2 * F,)).reshape(2, F)
    aq, sa = silu_mul_fp8(p.reshape(T, 2, F), sx, cs, interpret=interpret)
    return fp8_matmul_quantized(aq, sa, w_down, down_scale, out_dtype)


def fp8_matmul_ref(x, w, w_scale, *, x_scale=None, act_scale="token", out_dtype=None):
    """The same function with the fp8 values widened to float32 before the dot (the reference)."""
    return _fp8(
        x,
        w,
        w_scale,
        x_scale,
        act_scale,
        out_dtype,
        lambda a, b: jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST),
    )


def fp8_gemv_supported(x, w, *, x_scale=None, act_scale="token") -> bool:
    """Whether fp8_gemv's kernel takes this call: dynamic per-token scales, x of at most _fp8_gemv.MAX_ROWS rows
    (after flattening its leading axes; 16-bit, or Fp8Rows / RowsWithMax of 2-D rows), N a multiple of 16 and K of
    128."""
    if isinstance(x, (Fp8Rows, RowsWithMax)) and len(x.shape) != 2:
        return False
    return (
        x_scale is None
        and act_scale == "token"
        and w.ndim == 2
        and jnp.dtype(w.dtype) == jnp.dtype(FP8)
        and _fp8_gemv.supported(x.dtype, math.prod(x.shape[:-1]), w.shape[0], x.shape[-1])
    )


def fp8_gemv(x, w, w_scale, *, residual=None, interpret=False, **tuning):
    """residual + fp8_matmul(x, w, w_scale) (dynamic per-token scales; residual optional) with the activation
    quantization inside the GEMM's Pallas kernel (_fp8_gemv.py), for the decode step's few rows (fp8_gemv_supported):
    the kernel's float32 split-K partials are summed, rounded to x's dtype and added to the residual in one XLA
    fusion after it. Same rounding as fp8_matmul then `residual + y`; the float32 sums run in another order.
    x: 16-bit, Fp8Rows (already in e4m3) or RowsWithMax (the kernel takes the token scales from its maxima).
    tuning: _fp8_gemv.fp8_gemv_kernel's block_n, block_k, splits, num_warps, num_stages."""
    parts = fp8_gemv_partials(x, w, w_scale, interpret=interpret, **tuning)
    y = parts.sum(0).astype(x.dtype)
    return y if residual is None else residual.astype(x.dtype) + y


def _gemv_x(x):
    """(x [M, K], xs, x_mode) as the _fp8_gemv kernels take x (16-bit, Fp8Rows or RowsWithMax), its leading axes
    flattened."""
    if isinstance(x, Fp8Rows):
        return x.q, x.scale, "e4m3"
    if isinstance(x, RowsWithMax):
        return x.x, x.amax, "amax"
    return x.reshape(-1, x.shape[-1]), None, "row"


def fp8_gemv_partials(x, w, w_scale, *, interpret=False, **tuning):
    """fp8_gemv's kernel output: float32 split-K partials [S, *x.shape[:-1], N] whose sum is fp8_matmul's product
    before its rounding to x's dtype (for a consumer that sums split-K partials itself: the fused qkv/RoPE/write
    kernel, the add + norm pass)."""
    _fp8_check(x, w, w_scale)
    if not fp8_gemv_supported(x, w):
        raise ValueError(f"fp8_gemv does not take x {x.dtype} {x.shape} with w {w.dtype} {w.shape}")
    x2, xs, x_mode = _gemv_x(x)
    parts = _fp8_gemv.fp8_gemv_kernel(
        x2,
        w,
        jnp.asarray(w_scale, jnp.float32),
        xs=xs,
        min_scale=FP8_MIN_SCALE,
        x_mode=x_mode,
        interpret=interpret,
        **tuning,
    )
    return parts.reshape(parts.shape[0], *x.shape[:-1], w.shape[0])


def fp8_gemv_silu(h, w_gate_up, w_scale, *, interpret=False, **tuning) -> RowsWithMax:
    """silu(gate) * up of an fp8 W8A8 gate / up weight w_gate_up [2F, D] (gate's rows, then up's; dynamic token
    scales) for h [T, D] of fp8_gemv's 1-2 rows (16-bit or Fp8Rows), as RowsWithMax: a [T, F] in h's dtype with the
    maxima of |a| over each program's columns, for down's fp8_gemv. One Pallas kernel
    (_fp8_gemv.fp8_gemv_silu_kernel) in place of fp8_gemv's and XLA's silu * up fusion after it; the same values as
    fp8_gemv_silu_ref (gate / up summed in another order). tuning: its block_n, block_k, num_warps, num_stages."""
    _fp8_check(h, w_gate_up, w_scale)
    if not fp8_gemv_silu_supported(h, w_gate_up):
        raise ValueError(
            f"fp8_gemv_silu does not take h {h.dtype} {h.shape} with w {w_gate_up.dtype} {w_gate_up.shape}"
        )
    x2, xs, x_mode = _gemv_x(h)
    a, amax = _fp8_gemv.fp8_gemv_silu_kernel(
        x2,
        w_gate_up,
        jnp.asarray(w_scale, jnp.float32),
        xs=xs,
        min_scale=FP8_MIN_SCALE,
        x_mode=x_mode,
        out_dtype=h.dtype,
        interpret=interpret,
        **tuning,
    )
    return RowsWithMax(a, amax)


def fp8_gemv_silu_supported(h, w_gate_up) -> bool:
    """fp8_gemv_supported for h [T, D] (16-bit or Fp8Rows, not RowsWithMax) with gate / up's rows a multiple of 32."""
    return (
        not isinstance(h, RowsWithMax)
        and len(h.shape) == 2
        and w_gate_up.ndim == 2
        and w_gate_up.shape[0] % 32 == 0
        and fp8_gemv_supported(h, w_gate_up)
    )


def fp8_gemv_silu_ref(h, w_gate_up, w_scale):
    """fp8_gemv_silu's function unfused: fp8_matmul_ref's gate / up rounded to h's dtype, silu(gate) rounded, times up
    (HF's ops in that dtype), and the row's max of |a| as one partial maximum."""
    dtype = h.dtype
    if isinstance(h, Fp8Rows):
        y = jnp.dot(h.q.astype(jnp.float32), w_gate_up.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
        gu = _scaled(y, h.scale, w_scale, dtype).astype(jnp.float32)
    else:
        gu = fp8_matmul_ref(h, w_gate_up, w_scale, out_dtype=dtype).astype(jnp.float32)
    F = w_gate_up.shape[0] // 2
    g, u = gu[:, :F], gu[:, F:]
    a = (jax.nn.silu(g).astype(dtype).astype(jnp.float32) * u).astype(dtype)
    return RowsWithMax(a, jnp.abs(a.astype(jnp.float32)).max(axis=1, keepdims=True))


def fp8_gemv_ref(x, w, w_scale, *, residual=None):
    """fp8_gemv's function unfused: fp8_matmul_ref, then residual + y in x's dtype."""
    y = fp8_matmul_ref(x, w, w_scale)
    return y if residual is None else (residual.astype(x.dtype) + y)
