"""qmatmul: the one place that decides how x multiplies a QuantizedWeight (device layout: jaxllm/models/quant.py).

    qmatmul(x [T, I], w, *, kernels=False, interpret=False, mesh=None) -> [T, *O] in x's dtype

                   kernels=True (the decoder's "pallas" backend: GPUs)            kernels=False (reference: CPU)
  int4 / int8      kernels_pallas.quantized_matmul: the Pallas GEMM for T <= 128   qlayout.dequantize to x's dtype,
                   rows (decode), the dense weight (a Pallas pass) + XLA's GEMM     one float32 dot
                   above (offline decode, prefill); T <=
                   2 weight-only: split_k gives the decoder's qkv as the kernel's
                   split-K partials
  fp8 W8A8         kernels_pallas.fp8_matmul: x quantized per token (dynamic) or   fp8_matmul_ref: the same values,
                   with the static scale, one fp8 x fp8 dot (FP8 tensor cores;     the dot in float32
                   T <= 2: the fp8 values widened to bfloat16 in XLA's GEMM);
                   dynamic scales and T <= 2: kernels_pallas.fp8_gemv, the scales
                   and x's rounding inside one split-K Pallas GEMV (split_k:
                   its partials, for the decoder's qkv)
  fp8 weight-only  dequantize + dot (both)
  int4 nk layout   (sm_90, tp 1) the Mosaic GPU kernel (kernels_pallas/         the nk weight dequantized,
                   _qmatmul_mgpu.py) for T <= NK_KERNEL_MAX_ROWS, above: its wide   one float32 dot
                   variant (x's rows tiled; NK_WIDE)

The decoder's MLP of fp8 W8A8 gate / up and down weights (dynamic scales) on the kernels path, more than 2 rows:
silu_mlp (kernels_pallas.fp8_silu_mlp: silu(gate) * up and its e4m3 rounding for down in one Pallas pass between
the two fp8 dots; reference and other weights: qmatmul, silu * up, qmatmul). The same steps' inputs of such qkv and
gate / up weights come from the norm already in e4m3 (norm_fp8: RMSNorm and the token quantization in one Pallas
pass); qmatmul and silu_mlp take those Fp8Rows for column-parallel fp8 W8A8 weights. At fp8_gemv's 1-2 rows two
switches, off until measured on a GPU, do the same through the add + norm pass (add_norm_fp8_applies) and run gate /
up with silu * up in one kernel whose output (RowsWithMax) down's GEMV takes (gemv_silu_applies).

Every dequantized weight is computed only once x is (kernels_pallas.quant.tie_to_input: an optimization barrier
over both), so a step holds one projection's dequantized weight at a time, not every layer's.

INT8 W8A8 rounds x to int8 per token first, then multiplies like a weight-only int8 weight. The fused projections
(qkv, gate / up) are one weight each, so one call and one kernel launch each.

Tensor parallelism (mesh with tp > 1): every leaf of the weight is already split on the devices as its logical axes
say, and each tp shard multiplies its own slice inside shard_map (XLA cannot partition a Pallas call): a
column-parallel weight's shard gives its output columns, a row-parallel one's a partial product over its input rows,
summed over tp (psum; XLA's own row-parallel dot ends in the same all-reduce). The reference takes the same path so
CPU tests exercise it. Act-order row-parallel weights need the whole of x (their rows are sorted by group over all
of I, perm names the columns each shard multiplies): x is gathered for them, one all-gather of [T, I] per call.
Dynamic activation scales of a row-parallel weight are each shard's own (per token over its columns), as in vLLM.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.models.quant import QuantizedWeight, quantize_activations
from jaxllm.sharding import logical_to_spec
from kernels_pallas import _qmatmul_mgpu, qlayout
from kernels_pallas._common import on_gpu
from kernels_pallas.quant import (
    FP8_WIDEN_MAX_ROWS,
    Fp8Rows,
    RowsWithMax,
    fp8_gemv,
    fp8_gemv_partials,
    fp8_gemv_silu,
    fp8_gemv_silu_supported,
    fp8_gemv_supported,
    fp8_matmul,
    fp8_matmul_quantized,
    fp8_matmul_ref,
    fp8_silu_mlp,
    quantized_matmul,
    rms_norm_fp8,
    tie_to_input,
    uses_kernel,
)

# fp8 W8A8 (dynamic scales) of 1-2 rows on the kernels path: kernels_pallas.quant.fp8_gemv (the activation
# quantization inside the GEMV's kernel) instead of fp8_matmul; JAXLLM_FP8_GEMV=0 / 1 overrides it for A/B runs
FP8_GEMV = os.environ.get("JAXLLM_FP8_GEMV", "1") == "1"


def qmatmul(x, w: QuantizedWeight, *, kernels: bool = False, interpret: bool = False, mesh=None):
    """See the module docstring. kernels: the GPU implementations (else the pure-jnp references); interpret: the
    Pallas kernel in interpret mode (CPU tests of the kernel path); mesh: the weights' ("pp", "tp") mesh."""
    local = functools.partial(_local_qmatmul, kernels=kernels, interpret=interpret)
    if mesh is None or mesh.shape.get("tp", 1) == 1:
        return local(x, w)
    lay = w.layout
    row_parallel = lay.shards > 1
    if row_parallel and isinstance(x, Fp8Rows):  # its token scales span all of I, a row shard's are its own
        raise ValueError("Fp8Rows feed column-parallel weights only")
    x_spec = P(None, "tp") if row_parallel and w.perm is None else P()
    out_spec = P() if row_parallel else logical_to_spec((None, *lay.out_axes))
    return jax.shard_map(
        functools.partial(local, psum=row_parallel),
        mesh=mesh,
        in_specs=(x_spec, _weight_specs(w)),
        out_specs=out_spec,
        check_vma=False,
    )(x, w)


def _weight_specs(w: QuantizedWeight) -> QuantizedWeight:
    """The PartitionSpecs of w's leaves (its logical axes on the mesh)."""
    lay = w.layout
    input_last = w.scheme.weight_type == "float" or lay.nk
    packed_axes = (*lay.out_axes, lay.in_axis) if input_last else (lay.in_axis, *lay.out_axes)
    group = logical_to_spec((lay.group_axis, *lay.out_axes))
    return QuantizedWeight(
        packed=logical_to_spec(packed_axes),
        scales=group,
        zeros=None if w.zeros is None else group,
        perm=None if w.perm is None else logical_to_spec((lay.in_axis,)),
        act_scale=None if w.act_scale is None else P(),
        scheme=w.scheme,
        layout=lay,
    )


def _local_qmatmul(x, w: QuantizedWeight, *, kernels: bool, interpret: bool, psum: bool = False):
    """One device's product: x [T, k] (or all of I for an act-order weight) times its slice of w."""
    s = w.scheme
    if isinstance(x, RowsWithMax) and s.weight_type != "float":  # the maxima serve fp8_gemv only
        x = x.x
    if w.perm is not None:  # act-order: the stored rows are the checkpoint's rows perm
        x = jnp.take(x, w.perm, axis=1)
    if s.weight_type == "float":
        out = w.packed.shape[:-1]
        y = _fp8(x, w, kernels, interpret)
    elif w.layout.nk:
        out = w.packed.shape[:-1]
        y = _nk(x, w, kernels, interpret)
    else:
        out = w.packed.shape[1:]
        if s.activations is not None:  # INT8 W8A8
            x = quantize_activations(x, w)
        qw = _int_weight(w)
        if kernels:
            y = quantized_matmul(x, qw, interpret=interpret)
        else:
            x, qw = tie_to_input(x, qw)
            y = _dot_f32(x, qlayout.dequantize(qw, x.dtype))
    if psum:
        y = jax.lax.psum(y, "tp")
    return y.reshape(x.shape[0], *out)


# An MLP of fp8 W8A8 gate / up and down weights (dynamic scales) of more than 2 rows on the kernels path runs
# kernels_pallas.fp8_silu_mlp: the gate / up GEMM's product unscaled in bfloat16, its scales, silu * up and the e4m3
# rounding in one Pallas pass, instead of XLA's fusions (H100, 8B fp8, 500-row decode steps: 26.0 + 9.6 us a layer;
# bench/results/throughput_fp8_h100_ffc8213_bf16out_prof.json). JAXLLM_FP8_SILU_MLP=0 turns it off (A/B runs).
FP8_SILU_MLP = os.environ.get("JAXLLM_FP8_SILU_MLP", "1") == "1"


def _dynamic_fp8(w) -> bool:
    """An fp8 W8A8 weight with dynamic (per-token) activation scales."""
    return isinstance(w, QuantizedWeight) and w.scheme.weight_type == "float" and w.scheme.activations == "dynamic"


def fp8_silu_mlp_applies(h, w_gate_up, w_down, *, kernels: bool) -> bool:
    """Whether silu_mlp runs fp8_silu_mlp: the kernels path, fp8 W8A8 gate / up and down with dynamic scales, more
    rows than fp8_gemv takes (1-2: its kernel rounds x itself)."""
    return (
        kernels
        and FP8_SILU_MLP
        and _dynamic_fp8(w_gate_up)
        and _dynamic_fp8(w_down)
        and h.shape[0] > FP8_WIDEN_MAX_ROWS
    )


# The norm in front of an fp8 W8A8 qkv or gate / up weight (dynamic scales, column-parallel) of more than 2 rows on the
# kernels path: kernels_pallas.rms_norm_fp8 (the norm and the e4m3 rounding in one Pallas pass, Fp8Rows) in place
# of XLA's norm fusion and the token quantization's two. JAXLLM_FP8_NORM=0 turns it off (A/B runs).
FP8_NORM = os.environ.get("JAXLLM_FP8_NORM", "1") == "1"


def norm_fp8_applies(x, w, *, kernels: bool) -> bool:
    """Whether norm_fp8 serves x's norm as w's input: the kernels path with FP8_NORM on, w fp8 W8A8 with dynamic
    scales and column-parallel (one token scale over all of its input), more rows than fp8_gemv takes."""
    return kernels and FP8_NORM and _dynamic_fp8(w) and w.layout.shards == 1 and x.shape[0] > FP8_WIDEN_MAX_ROWS


def norm_fp8(x, weight, eps, *, plus_one: bool = False, interpret: bool = False, mesh=None) -> Fp8Rows:
    """RMSNorm of the residual stream x [T, D] in e4m3 with its token scales (kernels_pallas.rms_norm_fp8): the
    input qmatmul and silu_mlp take for the weight norm_fp8_applies names. Under tp every shard computes the whole
    (replicated) rows inside shard_map, as the other Pallas calls run."""
    norm = functools.partial(rms_norm_fp8, eps=eps, plus_one=plus_one, interpret=interpret)
    if mesh is not None and mesh.shape.get("tp", 1) > 1:
        norm = jax.shard_map(norm, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False)
    q, scale = norm(x, weight)
    return Fp8Rows(q, scale, x.dtype)


# The o / down projections of 1-2-row decode steps as split-K partials (split_k) that the residual add and the norm
# after it sum in one Pallas pass (kernels_pallas.quant.add_rms_norm; decoder._partials_into_residual); JAXLLM_ADD_NORM=0 turns it off (A/B).
ADD_NORM = os.environ.get("JAXLLM_ADD_NORM", "1") == "1"


def residual_partials(x, w, *, interpret: bool = False):
    """split_k's partials of x [T, I] times w for the add + norm pass (ADD_NORM on), or None."""
    return split_k(x, w, interpret=interpret) if ADD_NORM else None


# fp8 W8A8 (dynamic scales) at fp8_gemv's 1-2 rows on the kernels path, tp 1: the add + norm pass in front of qkv and
# gate / up writes the norm in e4m3 with its token scales (add_norm_fp8_applies), so that their GEMVs skip the pass
# over x's row that each of their programs makes; and gate / up's GEMV computes silu(gate) * up with the maxima of
# its pieces (gemv_silu_applies), in place of XLA's silu * up fusion, so that down's GEMV reads those maxima for its
# token scales instead of the row. The e4m3 rows are on by default since stop 71 (H200, traced 8B batch 1: a layer
# 81.18 against 81.86 us, bench/results/latency_fp8_{norm,off}_prof_h200_6a858ca.json; gpu_parity fp8 passes with
# them, gpu_parity_fp8_norm_e4m3_h200_aa6297b.json); JAXLLM_FP8_ADD_NORM_E4M3=0 turns them off. The silu epilogue
# (its "paired" layout: gate's and up's rows as one tile of the weight as stored, the PTX of the interleaved form that
# took 30.4 us against the GEMV and XLA's fusion's 33.4 on an H200; kernels_pallas/_fp8_gemv.py) stays off until an
# engine A/B and gpu_parity on a GPU; JAXLLM_FP8_GEMV_SILU=1 turns it on.
FP8_ADD_NORM_E4M3 = os.environ.get("JAXLLM_FP8_ADD_NORM_E4M3", "1") != "0"
FP8_GEMV_SILU = os.environ.get("JAXLLM_FP8_GEMV_SILU", "0") == "1"


def add_norm_fp8_applies(x, w, *, kernels: bool) -> bool:
    """Whether the add + norm pass in front of w hands it e4m3 rows (quant.add_rms_norm(fp8=True)): FP8_ADD_NORM_E4M3
    on and w a weight fp8_gemv multiplies whole on one device for x's rows (_fp8_gemv_operands, column-parallel)."""
    return FP8_ADD_NORM_E4M3 and _fp8_gemv_operands(x, w, kernels) is not None and w.layout.shards == 1


def gemv_silu_applies(h, w_gate_up, w_down, *, kernels: bool, mesh=None) -> bool:
    """Whether decoder.mlp runs gemv_silu: FP8_GEMV_SILU on at tp 1, gate / up a weight fp8_gemv_silu takes for h's
    rows (1-2; 16-bit or Fp8Rows) and down an fp8 W8A8 weight with dynamic scales."""
    if not FP8_GEMV_SILU or (mesh is not None and mesh.shape.get("tp", 1) > 1) or not _dynamic_fp8(w_down):
        return False
    gemv = _fp8_gemv_operands(h, w_gate_up, kernels)
    return gemv is not None and fp8_gemv_silu_supported(h, gemv[0])


def gemv_silu(h, w_gate_up: QuantizedWeight, *, interpret: bool = False) -> RowsWithMax:
    """silu(gate) * up for h [T, D] (gemv_silu_applies) in one kernel (kernels_pallas.quant.fp8_gemv_silu), as
    RowsWithMax for down's fp8_gemv. The weight's rows [2F, D]: gate's, then up's."""
    return fp8_gemv_silu(h, *_fp8_gemv_operands(h, w_gate_up, kernels=True), interpret=interpret)


def silu_mlp(h, w_gate_up: QuantizedWeight, w_down: QuantizedWeight, *, interpret: bool = False, mesh=None):
    """down(silu(gate) * up) of fp8 W8A8 weights through kernels_pallas.fp8_silu_mlp (fp8_silu_mlp_applies), h [T, D]
    -> [T, D]. Under tp, gate / up is column-parallel and down row-parallel: each shard runs its slice and the
    outputs are summed (psum), with each shard's own token scales for down's input (as qmatmul's row-parallel fp8)."""

    def local(h, wgu, wd, psum=False):
        y = fp8_silu_mlp(
            h,
            wgu.packed.reshape(-1, wgu.packed.shape[-1]),
            wgu.scales.reshape(-1),
            wd.packed.reshape(-1, wd.packed.shape[-1]),
            wd.scales.reshape(-1),
            interpret=interpret,
        )
        return (jax.lax.psum(y, "tp") if psum else y).reshape(h.shape[0], *wd.packed.shape[:-1])

    if mesh is None or mesh.shape.get("tp", 1) == 1:
        return local(h, w_gate_up, w_down)
    return jax.shard_map(
        functools.partial(local, psum=w_down.layout.shards > 1),
        mesh=mesh,
        in_specs=(P(), _weight_specs(w_gate_up), _weight_specs(w_down)),
        out_specs=P(),
        check_vma=False,
    )(h, w_gate_up, w_down)


def _int_weight(w: QuantizedWeight) -> qlayout.QuantizedWeight:
    """One device's int weight as the kernels' [K, N] layout (its output axes flattened; act-order already applied
    to x by the caller)."""
    flat = lambda a: None if a is None else a.reshape(a.shape[0], -1)  # noqa: E731
    return qlayout.QuantizedWeight(
        qweight=flat(w.packed),
        scales=flat(w.scales),
        zeros=flat(w.zeros),
        perm=None,
        bits=w.scheme.bits,
        group_size=w.layout.group_size,
        k=w.layout.k,
        plane=w.layout.plane,
    )


# int4 nk-layout weights (jaxllm/models/quant.py nk_layout_on) of up to this many rows run the Mosaic GPU kernel
# (kernels_pallas/_qmatmul_mgpu.py); above, its wide variant or the dequantized weight + XLA's GEMM (below). H100, 8B GPTQ, batch-1 TTFT of a
# 128-token prompt: 13.0 ms at 128 against 19.5 at 64 (planes 15.3; bench/results/int4_nk_ab_h100_5f8d838.json).
NK_KERNEL_MAX_ROWS = 128
# Above NK_KERNEL_MAX_ROWS: the wide Mosaic GPU kernel (qmatmul_mgpu_wide: x's rows tiled, the scale on the weight
# block) instead of the dequantized weight + XLA's GEMM. JAXLLM_INT4_NK_WIDE=0 turns it off.
NK_WIDE = os.environ.get("JAXLLM_INT4_NK_WIDE", "1") == "1"
# Above this many rows (prefill chunks) the dense weight + XLA's GEMM again: its dequantization is shared by the rows,
# and the wide kernel took 1.37x bf16's GEMM time at 512 rows (bench/results/quant_kernels_h100_1a39a82_wide.json).
NK_WIDE_MAX_ROWS = 1024
# The narrow kernel without a memory warpgroup (qmatmul_mgpu's inline_copies): by default where it measured faster
# (_qmatmul_mgpu.default_inline); JAXLLM_INT4_NK_INLINE=0 / 1 turns it off / on for every shape (an A/B switch).
NK_INLINE = {"0": False, "1": True}.get(os.environ.get("JAXLLM_INT4_NK_INLINE", ""))


def _nk_operands(w: QuantizedWeight):
    """An nk-layout weight as the kernel's 2-D operands: (wt int4 [N, k], scales [ng, N], zeros [ng, N] or None,
    group size)."""
    flat = lambda a: None if a is None else a.reshape(a.shape[0], -1)  # noqa: E731
    return w.packed.reshape(-1, w.packed.shape[-1]), flat(w.scales), flat(w.zeros), w.layout.group_size


def _nk(x, w: QuantizedWeight, kernels: bool, interpret: bool):
    """x [T, k] times an nk-layout int4 weight (packed int4 [*O, k] of q - 8, scales / zeros - 8 [ng, *O])."""
    wt, scales, zeros, group = _nk_operands(w)
    if kernels and (interpret or on_gpu()):
        narrow = x.shape[0] <= NK_KERNEL_MAX_ROWS
        if (narrow and _qmatmul_mgpu.supported(x.dtype, wt.shape[0], wt.shape[1], 4, group)) or (
            not narrow
            and NK_WIDE
            and x.shape[0] <= NK_WIDE_MAX_ROWS
            and _qmatmul_mgpu.wide_supported(x.dtype, wt.shape[0], wt.shape[1], 4, group)
        ):
            zeros = None if zeros is None else zeros.astype(x.dtype)
            tuning = dict(inline_copies=NK_INLINE) if narrow else {}
            return _qmatmul_mgpu.matmul(
                x, wt, scales.astype(x.dtype), zeros, group_size=group, wide=not narrow, interpret=interpret, **tuning
            )
    x, (wt, scales, zeros) = tie_to_input(x, (wt, scales, zeros))
    dense = nk_dequantize(wt, scales, zeros, group, x.dtype)  # [N, k]
    if kernels:
        return jax.lax.dot_general(x, dense, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(
            x.dtype
        )
    return _dot_f32(x, dense.T)


def _nk_partials(x, w: QuantizedWeight, interpret: bool):
    """The nk kernel's float32 split-K partials [S, T, N] of x [T, k] times w where _nk runs that kernel (the narrow
    one); else None."""
    wt, scales, zeros, group = _nk_operands(w)
    if not (interpret or on_gpu()) or not _qmatmul_mgpu.supported(x.dtype, wt.shape[0], wt.shape[1], 4, group):
        return None
    zeros = None if zeros is None else zeros.astype(x.dtype)
    return _qmatmul_mgpu.matmul(
        x,
        wt,
        scales.astype(x.dtype),
        zeros,
        group_size=group,
        partials=True,
        interpret=interpret,
        inline_copies=NK_INLINE,
    )


def nk_dequantize(wt, scales, zeros, group_size: int, dtype):
    """The nk layout's [N, k] weight in dtype: (q - z) * s computed in float32 and rounded once (as
    qlayout.dequantize), from wt int4 [N, k] (q - 8 in nk_permute's order), scales / zeros (z - 8) [ng, N]."""
    N, k = wt.shape
    g = k if group_size == -1 else group_size

    def rows(a):  # [ng, N] -> [N, k]
        a = a.astype(jnp.float32).T
        return jnp.broadcast_to(a[:, :, None], (N, k // g, g)).reshape(N, k)

    q = _qmatmul_mgpu.nk_unpermute(wt).astype(jnp.float32)
    if zeros is not None:
        q = q - rows(zeros)
    return (q * rows(scales)).astype(dtype)


def _fp8(x, w: QuantizedWeight, kernels: bool, interpret: bool):
    if (gemv := _fp8_gemv_operands(x, w, kernels)) is not None:  # the decode bucket's 1-2 rows
        return fp8_gemv(x, *gemv, interpret=interpret)
    if isinstance(x, Fp8Rows):  # rounded to e4m3 with the norm (norm_fp8)
        return fp8_matmul_quantized(
            x.q, x.scale, w.packed.reshape(-1, w.packed.shape[-1]), w.scales.reshape(-1), x.dtype
        )
    if isinstance(x, RowsWithMax):
        x = x.x
    wq = w.packed.reshape(-1, w.packed.shape[-1])  # [N, K]
    scale = w.scales.reshape(-1)
    if w.scheme.activations is None:  # fp8 weights, 16-bit activations: dequantize (next to the dot), then one dot
        x, (wq, scale) = tie_to_input(x, (wq, scale))
        return _dot_f32(x, (wq.astype(jnp.float32) * scale[:, None]).astype(x.dtype).T)
    x_scale = w.act_scale if w.scheme.activations == "static" else None
    fn = fp8_matmul if kernels else fp8_matmul_ref
    return fn(x, wq, scale, x_scale=x_scale, act_scale="token")


def _fp8_gemv_operands(x, w: QuantizedWeight, kernels: bool):
    """(w [N, K] e4m3, scales [N] or [1]) where x times w runs fp8_gemv: the kernels path with FP8_GEMV on, an fp8
    W8A8 weight with dynamic activation scales, and x as fp8_gemv_supported takes it (1-2 rows); else None."""
    if not (kernels and FP8_GEMV) or not _dynamic_fp8(w):
        return None
    wq = w.packed.reshape(-1, w.packed.shape[-1])
    return (wq, w.scales.reshape(-1)) if fp8_gemv_supported(x, wq) else None


def _dot_f32(x, dense):
    """x [T, K] @ dense [K, N] (the weight already rounded to x's dtype) with both widened to float32: the
    reference's float32 accumulation, which XLA's CPU dot does not take from 16-bit operands directly."""
    return jnp.dot(x.astype(jnp.float32), dense.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST).astype(
        x.dtype
    )


# int weight-only projections of up to this many rows give the decoder's qkv as the kernel's split-K partials
INT_SPLIT_K_MAX_ROWS = 2


def split_k(x, w, *, interpret: bool = False):
    """x [T, I] times w on one device as float32 split-K partials [S, T, *O] where qmatmul's kernels path makes them:
    fp8 W8A8 of 1-2 rows (fp8_gemv, _fp8_gemv_operands) and int weight-only weights of up to INT_SPLIT_K_MAX_ROWS rows
    (the int kernel's own split-K, the nk layout's included); else None. For the decoder's qkv, whose partials the
    attention kernel sums (decoder.qkv_partials) instead of an XLA reduce of their own."""
    if not isinstance(w, QuantizedWeight):
        return None
    if w.perm is not None:  # act-order (int weights only): the stored rows are x's columns perm, as in _local_qmatmul
        x = jnp.take(x, w.perm, axis=1)
    s = w.scheme
    if w.layout.nk:
        parts = _nk_partials(x, w, interpret) if x.shape[0] <= INT_SPLIT_K_MAX_ROWS else None
        return None if parts is None else parts.reshape(parts.shape[0], x.shape[0], *w.packed.shape[:-1])
    if s.weight_type == "int" and s.activations is None and x.shape[0] <= INT_SPLIT_K_MAX_ROWS:
        qw = _int_weight(w)
        if not uses_kernel(x, qw, interpret=interpret):
            return None
        parts = quantized_matmul(x, qw, interpret=interpret, partials=True)
        return parts.reshape(parts.shape[0], x.shape[0], *w.packed.shape[1:])
    if (gemv := _fp8_gemv_operands(x, w, kernels=True)) is None:
        return None
    parts = fp8_gemv_partials(x, *gemv, interpret=interpret)
    return parts.reshape(parts.shape[0], x.shape[0], *w.packed.shape[:-1])
