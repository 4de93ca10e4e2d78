"""Quantized expert weights of a mixture-of-experts layer (GPTQ, AWQ, compressed-tensors int4 / int8 and fp8, each
expert's Linear quantized on its own as the formats define them): their layout, their ParamSpecs, and how the
grouped matmul of jaxllm/models/moe.py runs over them.

Layout (the loader writes it, the devices hold it, `python -m jaxllm.convert` stores it): the dense expert weight's
shape [E, I, *O] (w_experts_gate_up [E, D, 2, F], w_experts_down [E, F, D]), each expert in quant.py's checkpoint
layout, stacked on E:
  int    packed  int32 [E, I / pf, *O]   values along I, least-significant first (GPTQ's qweight; AWQ and
                                         compressed-tensors are repacked into it)
         scales  [E, ng, *O]             model dtype; ng = I / group_size (1 per channel)
         zeros   [E, ng, *O] | None      model dtype, values in [0, 2**bits); None: symmetric (z = 2**(bits - 1))
         g_idx   int32 [E, I, *O[:-1]] | None   act-order only: row r's group, rows kept in the checkpoint's order
                                         (gate and up keep their own: [E, D, 2])
  float  packed  float8_e4m3fn [E, I, *O], scales float32 [E, 1, *O] (per output channel)
         act_scale float32 [] | None     static activations: the max of the experts' input scales (vLLM's choice)
No plane layout (quant.py's device layout for the Pallas GEMM): no kernel reads these weights.

Compute (routed_experts, called by moe.py's _experts): the step's distinct routed experts, at most n = min(E', T * k)
of a rank's E' experts, are gathered (their packed words, scales, zeros) and dequantized to the model dtype
([n, I, *O], (q - z) * s in float32 rounded once), then the step runs moe.py's grouped matmul over those n experts
with each pair's index among them. So a decode step dequantizes only the experts its tokens chose (batch 1 of
Qwen3-30B-A3B: 8 of 128), a long prefill at most every expert of the rank once; the dense copies live for one layer
(the gather depends on the layer's routing, so XLA cannot hoist them to the start of the step, where every layer's
would be live at once). At most one layer's experts of the rank are dense at a time: Qwen3-30B-A3B bf16 at tp 1,
1.2 GB (experts of width 768, D 2048), 150 MB per rank with expert parallelism at tp 8. The same code runs on GPUs:
correct, but it writes and reads the dense copy of each routed expert where a grouped int4 GEMM would read only the
packed words (a Pallas grouped kernel over this layout is the next step; bench/moe_matmul.py measures the dense one).
W8A8 schemes (fp8 or int8 activations) round each projection's input rows as the dense W8A8 GEMMs do, per token
(dynamic) or with the static scale, before the grouped matmul.

Tensor parallelism: with expert parallelism every leaf splits on E (whole experts per rank). Without it the gate / up
columns split on F (with their scales and zeros), and the down projection's rows on F: its packed words, and its
scales / zeros with them when each rank holds whole groups (else vLLM's error); act-order down projections keep
every group's scales on each rank and split g_idx with the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.models.quant import INT8_MAX, QuantScheme
from jaxllm.quantization import QuantConfig
from jaxllm.sharding import LOGICAL_RULES, logical_to_spec


@dataclass(frozen=True)
class ExpertsLayout:
    """Static facts of a QuantizedExperts: the logical axes of its leaves (shard_map's specs come from them)."""

    packed_axes: tuple
    group_axes: tuple  # scales / zeros
    g_idx_axes: tuple


@dataclass(frozen=True)
class QuantizedExperts:
    """One projection of all a layer's experts, quantized (or, in spec trees, its ParamSpecs); module docstring."""

    packed: object
    scales: object
    zeros: object = None
    g_idx: object = None
    act_scale: object = None
    scheme: QuantScheme = None
    layout: ExpertsLayout = None

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]


jax.tree_util.register_dataclass(
    QuantizedExperts, data_fields=["packed", "scales", "zeros", "g_idx", "act_scale"], meta_fields=["scheme", "layout"]
)


def num_experts(w) -> int:
    """E (or a rank's E') of a dense or quantized expert weight."""
    return w.num_experts if isinstance(w, QuantizedExperts) else w.shape[0]


def dequantized_bytes(cfg, tp: int, max_tokens: int) -> int:
    """One device's peak bytes of one layer's experts dequantized inside a step (routed_experts): at most
    min(E', max_tokens * top_k) experts' gate / up and down in the model dtype (the unpacking and scaling are fused
    into the one pass that writes them). 0 unless cfg's experts are quantized. The engine reserves it beside the
    activations when it sizes the KV cache (engine/setup.py; warm-up then checks the compiled steps' temporaries)."""
    from jaxllm.models.quant import EXPERT_LINEARS, quantized_keys

    m = cfg.moe
    if cfg.quantization is None or m is None:
        return 0
    if not any(k in EXPERT_LINEARS for i in range(cfg.num_layers) for k in quantized_keys(cfg, i)):
        return 0
    E, F = (
        (m.num_experts // tp, m.intermediate_size)
        if cfg.expert_parallel
        else (m.num_experts, m.intermediate_size // tp)
    )
    return min(E, max_tokens * m.top_k) * 3 * cfg.hidden_size * F * jnp.dtype(cfg.dtype).itemsize


# --- specs ----------------------------------------------------------------------------------------------------------
def quantized_experts_spec(dense, q: QuantConfig, dtype: str, tp: int, name: str) -> QuantizedExperts:
    """The QuantizedExperts of ParamSpecs replacing one dense expert ParamSpec ([E, I, *O], moe_param_specs)."""
    from jaxllm.models.params import ParamSpec

    E, I, O = dense.shape[0], dense.shape[1], dense.shape[2:]
    e_axis, in_axis, out_axes = dense.axes[0], dense.axes[1], dense.axes[2:]
    scheme = QuantScheme.of(q)
    split = tp if LOGICAL_RULES.get(in_axis) == "tp" else 1  # the down projection's rows without expert parallelism
    if q.weight_type == "float":
        lay = ExpertsLayout(dense.axes, (e_axis, None, *out_axes), ())
        return QuantizedExperts(
            packed=ParamSpec(dense.shape, dense.axes, "fp8", dtype="float8_e4m3fn"),
            scales=ParamSpec((E, 1, *O), lay.group_axes, f"scale:{0.02 / 64}", dtype="float32"),
            act_scale=ParamSpec((), (), "ones", dtype="float32") if q.activations == "static" else None,
            scheme=scheme,
            layout=lay,
        )
    pf, g = q.pack_factor, I if q.group_size == -1 else q.group_size
    if I % g or I % pf:
        raise ValueError(
            f"{name}: input size {I} is not a multiple of quantization_config group_size {g} ({q.source})."
        )
    k = I // split
    # Each rank's rows must be whole packed words, and whole groups unless their scales stay whole (act-order,
    # per channel) -- vLLM's MoE methods refuse the same splits.
    if split > 1 and k % (pf if q.act_order or q.group_size == -1 else g):
        raise ValueError(
            f"The input size is not aligned with the quantized weight shape: {name} has {I} input rows "
            f"per expert, {k} per shard at tensor_parallel_size={tp}, not a multiple of group_size {g}. "
            "This can be caused by too large tensor parallel size; --enable-expert-parallel keeps "
            "experts whole."
        )
    group_axis = in_axis if not q.act_order and q.group_size != -1 else None
    lay = ExpertsLayout(dense.axes, (e_axis, group_axis, *out_axes), (e_axis, in_axis, *out_axes[:-1]))
    spread = 2 ** (q.bits - 1) / math.sqrt(3)  # as quant.quantized_spec: dequantized dummies spread ~0.02
    ng = I // g
    return QuantizedExperts(
        packed=ParamSpec((E, I // pf, *O), dense.axes, f"int{q.bits}", dtype="int32"),
        scales=ParamSpec((E, ng, *O), lay.group_axes, f"scale:{0.02 / spread}", dtype=dtype),
        zeros=None if q.symmetric else ParamSpec((E, ng, *O), lay.group_axes, f"zp{q.bits}", dtype=dtype),
        g_idx=ParamSpec((E, I, *O[:-1]), lay.g_idx_axes, f"gidx:{g}", dtype="int32") if q.act_order else None,
        scheme=scheme,
        layout=lay,
    )


def shard_specs(w: QuantizedExperts) -> QuantizedExperts:
    """shard_map's in_specs for w's leaves (the PartitionSpecs of their logical axes)."""
    lay = w.layout
    group = logical_to_spec(lay.group_axes)
    return QuantizedExperts(
        packed=logical_to_spec(lay.packed_axes),
        scales=group,
        zeros=None if w.zeros is None else group,
        g_idx=None if w.g_idx is None else logical_to_spec(lay.g_idx_axes),
        act_scale=None if w.act_scale is None else logical_to_spec(()),
        scheme=w.scheme,
        layout=lay,
    )


# --- compute --------------------------------------------------------------------------------------------------------
def dequantize_experts(w: QuantizedExperts, idx, dtype):
    """Experts idx [n] of w (this rank's shard) as dense weights [n, I, *O] in dtype: (q - z) * s in float32."""
    s = w.scheme
    scales = w.scales[idx].astype(jnp.float32)
    if s.weight_type == "float":  # per output channel: scales [n, 1, *O] broadcast over the rows
        return (w.packed[idx].astype(jnp.float32) * scales).astype(dtype)
    packed = jax.lax.bitcast_convert_type(w.packed[idx], jnp.uint32)  # [n, I / pf, *O]
    pf = 32 // s.bits
    shifts = (jnp.arange(pf, dtype=jnp.uint32) * s.bits).reshape(1, 1, pf, *([1] * (packed.ndim - 2)))
    q = (packed[:, :, None] >> shifts) & jnp.uint32((1 << s.bits) - 1)
    q = q.reshape(packed.shape[0], -1, *packed.shape[2:]).astype(jnp.float32)  # [n, I, *O]
    zeros = None if w.zeros is None else w.zeros[idx].astype(jnp.float32)
    if w.g_idx is not None:  # act-order: each row's own group, rows in the checkpoint's order
        rows = jnp.broadcast_to(w.g_idx[idx][..., None], q.shape)

        def expand(a):
            return jnp.take_along_axis(a, rows, axis=1)
    else:  # consecutive groups of I / ng rows (this shard's rows: whole groups), or one group per column
        group = q.shape[1] // scales.shape[1]

        def expand(a):
            return jnp.repeat(a, group, axis=1) if a.shape[1] > 1 else a

    z = float(1 << (s.bits - 1)) if zeros is None else expand(zeros)
    return ((q - z) * expand(scales)).astype(dtype)


def _fake_quantize_rows(x, w: QuantizedExperts):
    """x [rows, I] as w's W8A8 GEMM sees it: rounded to fp8 / int8 with a per-row (per-token) or the static scale,
    back in x's dtype; x itself for weight-only schemes."""
    s = w.scheme
    if s.activations is None:
        return x
    x32 = x.astype(jnp.float32)
    if s.weight_type == "float":
        from kernels_pallas.quant import quantize_activations

        xq, scale = quantize_activations(x32, x_scale=w.act_scale if s.activations == "static" else None)
        return (xq.astype(jnp.float32) * scale).astype(x.dtype)
    scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / INT8_MAX, 1e-12)  # INT8 W8A8: dynamic
    return (jnp.round(jnp.clip(x32 / scale, -INT8_MAX, INT8_MAX)) * scale).astype(x.dtype)


def routed_experts(ids, w_gate_up, w_down, first_expert: int, dtype):
    """The quantized experts' part of the grouped matmul: (slot ids [T, k], dense gate_up [n, D, 2, F'], dense down
    [n, F', D], input quantizers (gate_up's, down's) or None) for moe.expert_mlp. n = min(E', T * k) (static): the
    step's distinct experts among this rank's E' (from first_expert), in ascending order; a pair's slot is its
    expert's index among them, n for pairs of other ranks' experts. Slots past the distinct experts hold copies of
    the last expert and no pairs."""
    T, k = ids.shape
    E = num_experts(w_gate_up)
    n = min(E, T * k)
    local = ids - first_expert
    mine = (local >= 0) & (local < E)
    local = jnp.where(mine, local, E)
    used = jnp.unique(local, size=n, fill_value=E)  # ascending; E (other ranks' pairs) sorts last and is cut first
    slots = jnp.where(mine, jnp.searchsorted(used, local), n)
    idx = jnp.minimum(used, E - 1)

    def dense(w):
        return dequantize_experts(w, idx, dtype) if isinstance(w, QuantizedExperts) else w[idx]

    quantizers = None
    if any(isinstance(w, QuantizedExperts) and w.scheme.activations for w in (w_gate_up, w_down)):
        quantizers = tuple(
            (lambda x, w=w: _fake_quantize_rows(x, w)) if isinstance(w, QuantizedExperts) else (lambda x: x)
            for w in (w_gate_up, w_down)
        )
    return slots.astype(jnp.int32), dense(w_gate_up), dense(w_down), quantizers
