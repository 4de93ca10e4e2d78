"""Quantized linear layers: one weight type (QuantizedWeight), one function (qmatmul, in quant_matmul.py), one
in-memory layout per scheme: the one the GPU kernels read (kernels_pallas.qlayout's planes for int weights, the
[N, K] fp8 operand of kernels_pallas.fp8_matmul), laid out once while the weights are placed on the devices.

Two layouts, one of them in memory:
  checkpoint layout  what the loader reads every checkpoint format into (quant_loader.py), what the conversion CLI
                     writes to Orbax and what dummy weights are drawn in; independent of tensor parallelism.
  device layout      what the devices hold and qmatmul reads; ParamSpec.expand (Relayout below) turns the first into
                     it on the host or on the devices, per leaf, for the tp the model runs with.

Checkpoint layout of a linear with I input rows and output shape O (our dense layout with its input axes flattened:
w_qkv [D | K, G + 2, H], wo [N * H | D], w_gate_up [D | 2, F], w_down [F | D]):
  int weights (scheme.weight_type "int", bits b in {4, 8}; pf = 32 // b values per word):
    packed   int32 [I / pf, *O]  values q in [0, 2**b), packed along the input dim: row r of the input is bits
                                 [b * (r % pf), b * (r % pf) + b) of word r // pf, least-significant first
                                 (GPTQ's qweight layout; AWQ and compressed-tensors are repacked into it)
    scales   [ng, *O]            model dtype; ng = I / group_size (1 when group_size == -1)
    zeros    [ng, *O]            the zero point z in [0, 2**b), model dtype; None when symmetric: z = 2**(b-1)
    perm     int32 [I]           act-order checkpoints only (GPTQ desc_act, compressed-tensors actorder): the loader
                                 sorts the rows by their group once (qlayout.act_order_perm), so stored row i is the
                                 checkpoint's row perm[i] and the groups are contiguous; x's columns are gathered by
                                 perm before the product (x @ W = x[:, perm] @ W[perm])
    w[r, o] = (q[r, o] - z[r // group_size, o]) * scales[r // group_size, o]
  fp8 weights (weight_type "float"):
    packed   float8_e4m3fn [I, *O]
    scales   float32 [1, *O]     per output channel (per-tensor checkpoint scales are broadcast to their columns)
  activations (scheme.activations): None: weight-only; "dynamic": x is quantized per token (fp8 e4m3, or int8 for int
  weights) with scale amax / qmax; "static": with act_scale (float32 [], per-tensor, the max of the fused layers'
  input scales as vLLM takes it).

Device layout (QuantLayout, static in the weight's tree):
  int: qlayout's planes, one plane layout per row shard: a row-parallel weight (wo, w_down) under tensor
    parallelism is tp independent plane layouts stacked on the rows, each padded to whole tiles on its own, so a tp
    shard holds whole tiles whatever the model's widths (a single layout's tiles of up to 1024 rows would not split
    Llama-8B's down_proj 4 ways, nor any tiny test model 2 ways). Per shard: packed [Kp / P, *O] int32 words,
    scales / zeros [ceil(Kp / g), *O] (zero rows past the shard's groups), Kp its rows padded to whole tiles. The
    plane height L is the largest of 128 / 64 / 32 that divides the group and, if one does, tiles the shard.
    Shards of fewer rows than the smallest tile (32 * P: only tiny test models) are one tile of k / P-row planes,
    unpadded, which only the dequantize path reads. Act-order shards that hold parts of groups (tp row splits not on group boundaries, which issue 28 allows for
    act-order checkpoints) are stored with groups of gcd(group_size, rows per shard): each such group's scale is
    its checkpoint group's, repeated.
  fp8: packed [*O, I] (K-major, the layout cuBLASLt's FP8 GEMM takes for both operands), scales [1, *O].

Why repack at load instead of the kernel reading GPTQ's packing: GPTQ's word holds P consecutive rows, so L words
hold L * P consecutive rows; that is the plane layout with K permuted inside each tile (a permutation x's columns
could absorb), but a tile of L = 128 words then spans 8 groups of 128 rows and the kernel's one-scale-per-plane MMA
(the scale applied once to the MMA's float32 result) would need L <= group_size / P = 16 rows per MMA: 32-row
planes already measured 1.3x slower than 128-row ones on an H100 (bench/KERNELS_NOTES.md). Repacking costs one pass
over the packed words at load time and nothing per step.

Sharding: every leaf carries the dense weight's logical axes (jaxllm/sharding.py). Column-parallel weights split
their output columns; row-parallel ones their input rows, a row shard per tp rank.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.quantization import QuantConfig
from kernels_pallas._qmatmul_mgpu import nk_permute
from kernels_pallas.qlayout import PLANES, choose_plane, num_groups, padded_k

FP8_MAX = 448.0  # float8_e4m3fn
INT8_MAX = 127.0

# Our quantizable weights -> how many leading axes of the dense weight are its input (wo [N, H, D]: 2).
QUANT_LINEARS = {"w_qkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1, "w_shared_gate_up": 1, "w_shared_down": 1}
EXPERT_LINEARS = ("w_experts_gate_up", "w_experts_down")  # a MoE layer's experts (jaxllm/models/moe_quant.py)
ROW_PARALLEL_AXES = ("heads", "ffn")  # logical input axes that tp splits (wo, w_down)
# int4 weight-only linears in the "nk" device layout (kernels_pallas/_qmatmul_mgpu.py: int4 [*O, I] holding q - 8,
# I permuted within each 64 inputs by _qmatmul_mgpu.nk_permute into the order the kernel's registers take, read by
# the Mosaic GPU kernel for up to quant_matmul.NK_KERNEL_MAX_ROWS rows) instead of qlayout's planes, where
# nk_layout_fits: the default on Hopper GPUs (sm_90, where those kernels run; nk_layout_on) without tensor parallelism
# (the kernel inside tp's shard_map has not run on a GPU yet), planes elsewhere.
# JAXLLM_INT4_NK=1 / 0 forces it on / off (A/B runs; None: unset). Measured on one H200 at 3f6aa5b (call 70), GPTQ
# g128 8B batch-1 ITL nk 2.87 ms against planes 3.20, gpu_parity gptq_int4 passing with it; offline (nk + the wide
# kernel) 36.4 against 35.9 req/s on an H100 (stop 54).
NK_LAYOUT: bool | None = {"1": True, "0": False}.get(os.environ.get("JAXLLM_INT4_NK", ""))
NK_BLOCK = 128  # the nk kernel's K block: groups and each shard's rows are multiples of it


@dataclass(frozen=True)
class QuantScheme:
    """What qmatmul needs to know statically (hashable: part of the step's tree structure)."""

    weight_type: str  # int | float
    bits: int
    group_size: int  # -1: one group (the checkpoint's; QuantLayout.group_size is the device layout's)
    activations: str | None  # None | dynamic | static

    @classmethod
    def of(cls, q: QuantConfig) -> QuantScheme:
        return cls(q.weight_type, q.bits, q.group_size, q.activations)


@dataclass(frozen=True)
class QuantLayout:
    """Static facts of one weight's device layout (module docstring)."""

    in_axis: str | None  # logical axis of the input rows
    out_axes: tuple  # logical axes of the outputs
    k: int  # input rows per row shard (I unless the weight is row-parallel under tp)
    shards: int  # row shards: tp for a row-parallel weight, else 1
    plane: int = 0  # int weights: the plane height L (qlayout); 0 in the nk layout
    group_size: int = -1  # int weights: rows per scale row in the device layout (-1: one per shard)
    nk: bool = False  # int4: the nk layout (NK_LAYOUT) instead of planes

    @property
    def group_axis(self):
        """Logical axis of the scales' / zeros' rows: split with the input rows when they hold whole groups."""
        return self.in_axis if self.shards > 1 and self.group_size != -1 else None


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized linear's arrays (or, in spec trees, their ParamSpecs); see the module docstring for the layouts."""

    packed: object
    scales: object
    zeros: object = None
    perm: object = None
    act_scale: object = None
    scheme: QuantScheme = None
    layout: QuantLayout = None


jax.tree_util.register_dataclass(
    QuantizedWeight, data_fields=["packed", "scales", "zeros", "perm", "act_scale"], meta_fields=["scheme", "layout"]
)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


# --- checkpoint layout -> device layout -------------------------------------------------------------------------
def _xp(x):
    return np if isinstance(x, np.ndarray) else jnp


def _as_uint32(words):
    return words.view(np.uint32) if isinstance(words, np.ndarray) else jax.lax.bitcast_convert_type(words, jnp.uint32)


def _as_int32(words):
    return words.view(np.int32) if isinstance(words, np.ndarray) else jax.lax.bitcast_convert_type(words, jnp.int32)


def unpack_int(packed, bits: int):
    """Checkpoint-layout words int32 [I / pf, *O] -> uint32 values [I, *O] in [0, 2**bits) (numpy or jax)."""
    xp, pf = _xp(packed), 32 // bits
    shifts = (xp.arange(pf, dtype=xp.uint32) * bits).reshape(1, pf, *([1] * (packed.ndim - 1)))
    q = (_as_uint32(packed)[:, None] >> shifts) & xp.uint32((1 << bits) - 1)
    return q.reshape(packed.shape[0] * pf, *packed.shape[1:])


def pack_int(q: np.ndarray, bits: int) -> np.ndarray:
    """Host values [I, *O] in [0, 2**bits) -> checkpoint-layout int32 [I / pf, *O] (inverse of unpack_int)."""
    pf = 32 // bits
    q = q.astype(np.uint32).reshape(q.shape[0] // pf, pf, *q.shape[1:])
    shifts = (np.arange(pf, dtype=np.uint32) * bits).reshape(1, pf, *([1] * (q.ndim - 2)))
    return np.bitwise_or.reduce(q << shifts, axis=1).view(np.int32)


def _shard_rows(x, shards: int, rows: int, padded: int):
    """[shards * rows, *O] -> [shards, padded, *O]: each shard's rows, zero-padded on its own."""
    xp = _xp(x)
    x = x.reshape(shards, rows, *x.shape[1:])
    if padded == rows:
        return x
    return xp.pad(x, [(0, 0), (0, padded - rows)] + [(0, 0)] * (x.ndim - 2))


@dataclass(frozen=True)
class Relayout:
    """ParamSpec.relayout of a quantized leaf: its checkpoint-layout shape / axes / dtype, and the function from that
    layout to the device layout (numpy on the host, jax on the devices; traced or not)."""

    field: str  # packed | scales | zeros
    scheme: QuantScheme
    layout: QuantLayout
    checkpoint_shape: tuple
    checkpoint_axes: tuple
    dtype: str  # the device layout's dtype
    checkpoint_dtype: str | None = None  # the checkpoint layout's, where it differs (nk: int32 words -> int4)

    def __call__(self, x):
        s, lay, xp = self.scheme, self.layout, _xp(x)
        if s.weight_type == "float":  # [I, *O] -> [*O, I]
            return xp.moveaxis(x, 0, -1).astype(jnp.dtype(self.dtype))
        P = 32 // s.bits
        kp = lay.k if lay.nk else padded_k(lay.k, s.bits, lay.plane)
        if lay.nk and self.field == "packed":  # [I, *O] values -> [*O, I] int4 q - 8 (row shards stay contiguous)
            q = xp.moveaxis(unpack_int(x, s.bits), 0, -1).astype(xp.int32) - 8
            return nk_permute(q).astype(jnp.int4)  # the kernel's order within each 64 inputs
        if self.field == "packed":
            q = _shard_rows(unpack_int(x, s.bits), lay.shards, lay.k, kp)
            q = q.reshape(lay.shards, kp // (lay.plane * P), P, lay.plane, *q.shape[2:])
            words = q[:, :, 0]
            for j in range(1, P):  # bit field j of a tile's words is its plane j
                words = words | (q[:, :, j] << xp.uint32(s.bits * j))
            return _as_int32(words.reshape(lay.shards * kp // P, *words.shape[3:]))
        if lay.nk and self.field == "zeros":  # the nk kernel's zeros: z - 8, as its values are q - 8
            x = x.astype(jnp.float32) - 8
        x = x.astype(jnp.dtype(self.dtype))  # scales / zeros
        if lay.group_size == -1:
            return x
        if s.group_size != lay.group_size:  # act-order shards holding parts of groups: smaller groups, same scales
            x = xp.repeat(x, s.group_size // lay.group_size, axis=0)
        return _shard_rows(x, lay.shards, lay.k // lay.group_size, num_groups(kp, lay.group_size)).reshape(
            -1, *x.shape[1:]
        )


# --- specs ----------------------------------------------------------------------------------------------------------
def quantized_spec(dense, n_in: int, q: QuantConfig, dtype: str, tp: int, name: str):
    """The QuantizedWeight of ParamSpecs replacing the dense ParamSpec of one linear (n_in leading input axes)."""
    from jaxllm.models.params import ParamSpec

    I, O, ckpt_O = math.prod(dense.shape[:n_in]), dense.shape[n_in:], dense.checkpoint_shape[n_in:]
    in_axis, out_axes, r = dense.axes[0], dense.axes[n_in:], dense.kv_repeat
    row_parallel = in_axis in ROW_PARALLEL_AXES and tp > 1
    shards = tp if row_parallel else 1
    scheme = QuantScheme.of(q)

    def leaf(field, shape, axes, init, dtype_, lay, ckpt_shape, ckpt_axes, ckpt_dtype=None):
        relayout = Relayout(field, scheme, lay, ckpt_shape, ckpt_axes, dtype_, ckpt_dtype)
        return ParamSpec(shape, axes, init, r, dtype_, relayout)

    if q.weight_type == "float":
        lay = QuantLayout(in_axis, out_axes, I // shards, shards)
        return QuantizedWeight(
            packed=leaf(
                "packed", (*O, I), (*out_axes, in_axis), "fp8", "float8_e4m3fn", lay, (I, *ckpt_O), (in_axis, *out_axes)
            ),
            scales=ParamSpec((1, *O), (None, *out_axes), f"scale:{0.02 / 64}", r, "float32"),
            act_scale=ParamSpec((), (), "ones", 1, "float32") if q.activations == "static" else None,
            scheme=scheme,
            layout=lay,
        )
    pf, g = q.pack_factor, I if q.group_size == -1 else q.group_size
    if I % g or I % pf:
        raise ValueError(
            f"{name}: input size {I} is not a multiple of quantization_config group_size {g} ({q.source})."
        )
    k = I // shards
    if row_parallel and k % (pf if q.act_order or q.group_size == -1 else g):
        raise ValueError(
            f"The input size is not aligned with the quantized weight shape: {name} has {I} input rows, "
            f"{k} per shard at tensor_parallel_size={tp}, not a multiple of group_size {g}. This "
            f"can be caused by too large tensor parallel size."
        )
    group = -1 if q.group_size == -1 else math.gcd(g, k)  # == g unless act-order shards split groups
    # No plane divides the group: the kernel declines the weight. Shards smaller than the kernel's smallest tile
    # (tiny test models) are one exact tile of k / P-row planes instead of a mostly padded one; the kernel declines
    # those too.
    P = 32 // q.bits
    nk = nk_layout_fits(q, k, group, tp)
    if nk:
        plane, kp = 0, k
    else:
        plane = (choose_plane(k, q.bits, group) or PLANES[-1]) if k >= PLANES[-1] * P else k // P
        kp = padded_k(k, q.bits, plane)
    lay = QuantLayout(in_axis, out_axes, k, shards, plane, group, nk)
    # per-channel scales (group -1) are one row every shard reads whole (group_axis None); groups split with the rows
    ng_dev = 1 if group == -1 else shards * num_groups(kp, group)
    # The checkpoint layout splits groups over tp with their rows, except act-order ones (issue 28's layout).
    ckpt_group_axis = in_axis if row_parallel and not q.act_order and q.group_size != -1 else None
    spread = 2 ** (q.bits - 1) / math.sqrt(3)  # std of uniform random values around the zero (dummy weights)
    scale_init = f"scale:{0.02 / spread}"
    group_axes, ckpt_group_axes = (lay.group_axis, *out_axes), (ckpt_group_axis, *out_axes)
    if nk:  # int4 [*O, I], the input last (as fp8's [*O, I])
        packed_shape, packed_axes, packed_dtype = (*O, shards * kp), (*out_axes, in_axis), "int4"
    else:
        packed_shape, packed_axes, packed_dtype = (shards * kp // P, *O), (in_axis, *out_axes), "int32"
    return QuantizedWeight(
        packed=leaf(
            "packed",
            packed_shape,
            packed_axes,
            f"int{q.bits}",
            packed_dtype,
            lay,
            (I // pf, *ckpt_O),
            (in_axis, *out_axes),
            "int32",
        ),
        scales=leaf("scales", (ng_dev, *O), group_axes, scale_init, dtype, lay, (I // g, *ckpt_O), ckpt_group_axes),
        zeros=None
        if q.symmetric
        else leaf("zeros", (ng_dev, *O), group_axes, f"zp{q.bits}", dtype, lay, (I // g, *ckpt_O), ckpt_group_axes),
        perm=ParamSpec((I,), (in_axis,), "arange", 1, "int32") if q.act_order else None,
        scheme=scheme,
        layout=lay,
    )


def nk_layout_on(tp: int = 1) -> bool:
    """Whether int4 weights take the nk layout where they fit: JAXLLM_INT4_NK if set, else on a Hopper GPU at tp 1."""
    if NK_LAYOUT is not None:
        return NK_LAYOUT
    from kernels_pallas import on_hopper

    return tp == 1 and on_hopper()


def nk_layout_fits(q: QuantConfig, k: int, group: int, tp: int = 1) -> bool:
    """Whether an int weight of k rows per shard (device groups of `group` rows) takes the nk layout: nk_layout_on(tp),
    int4 weight-only without act-order, groups (or per channel) and k whole NK_BLOCKs."""
    return (
        nk_layout_on(tp)
        and q.weight_type == "int"
        and q.bits == 4
        and q.activations is None
        and not q.act_order
        and k % NK_BLOCK == 0
        and (group == -1 or group % NK_BLOCK == 0)
    )


def hf_modules(cfg, key: str) -> tuple[str, ...]:
    """The HF Linear modules (relative to a decoder layer) fused into our weight `key` (a MoE layer's experts: every
    expert's, gate projections before up projections as the loader stacks them)."""
    if key == "w_qkv":
        return ("self_attn.W_pack",) if cfg.fused_qkv else tuple(f"self_attn.{p}_proj" for p in "qkv")
    if key in EXPERT_LINEARS:
        from jaxllm.models.moe import expert_linear_names

        p, (gate, up, down) = expert_linear_names(cfg)
        names = (gate, up) if key == "w_experts_gate_up" else (down,)
        return tuple(f"{p}experts.{e}.{n}" for n in names for e in range(cfg.moe.num_experts))
    return {
        "wo": ("self_attn.o_proj",),
        "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
        "w_down": ("mlp.down_proj",),
        "w_shared_gate_up": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
        "w_shared_down": ("mlp.shared_expert.down_proj",),
    }[key]


def layer_linears(cfg, layer: int) -> tuple[str, ...]:
    """Our weights of decoder layer `layer` that a checkpoint may quantize. A MoE layer's router (and Qwen2-MoE's
    shared expert gate) stay unquantized, as vLLM builds them without a quantization method."""
    if cfg.moe is None or not cfg.layer_kind(layer).moe:
        return ("w_qkv", "wo", "w_gate_up", "w_down")
    shared = ("w_shared_gate_up", "w_shared_down") if cfg.moe.shared_intermediate_size else ()
    return ("w_qkv", "wo", *EXPERT_LINEARS, *shared)


def quantized_keys(cfg, layer: int) -> tuple[str, ...]:
    """Our weights of decoder layer `layer` that the checkpoint stores quantized (the rest stay dense)."""
    q = cfg.quantization
    out = []
    for key in layer_linears(cfg, layer):
        modules = [f"model.layers.{layer}.{m}" for m in hf_modules(cfg, key)]
        ignored = [q.is_ignored(m) for m in modules]
        if any(ignored) and not all(ignored):
            kept = [m for m, i in zip(modules, ignored, strict=True) if i]
            quantized = [m for m, i in zip(modules, ignored, strict=True) if not i]
            raise ValueError(
                f"{q.source} keeps {_some(kept)} unquantized but quantizes {_some(quantized)}; jaxllm "
                "fuses them into one weight, so they must be quantized alike."
            )
        if not any(ignored):
            out.append(key)
    return tuple(out)


def _some(names: list[str], n: int = 4) -> str:
    return str(names) if len(names) <= n else f"{names[:n]} and {len(names) - n} more"


def quantize_specs(specs: dict, cfg, tp: int) -> dict:
    """param_specs with each quantized linear's ParamSpec replaced by its QuantizedWeight of ParamSpecs (a MoE
    layer's experts: a QuantizedExperts, jaxllm/models/moe_quant.py)."""
    from jaxllm.models.moe_quant import quantized_experts_spec

    layers = []
    for i, layer in enumerate(specs["layers"]):
        layer = dict(layer)
        for key in quantized_keys(cfg, i):
            name = f"layers.{i}.{key}"
            if key in EXPERT_LINEARS:
                layer[key] = quantized_experts_spec(layer[key], cfg.quantization, cfg.dtype, tp, name)
            else:
                layer[key] = quantized_spec(layer[key], QUANT_LINEARS[key], cfg.quantization, cfg.dtype, tp, name)
        layers.append(layer)
    return dict(specs, layers=layers)


def dummy_values(spec, key):
    """Random values of a quantized leaf in its checkpoint layout (load_format="dummy"; ParamSpec.expand lays them
    out): the right shapes and dtypes, and a dequantized scale near the dense dummies' 0.02 so activations stay
    finite."""
    shape = spec.checkpoint_shape
    if spec.init.startswith("int"):
        return jax.random.bits(key, shape, jnp.uint32).view(jnp.int32)
    if spec.init.startswith("zp"):
        bits = int(spec.init[2:])
        return jax.random.randint(key, shape, 0, 2**bits, jnp.int32).astype(spec.dtype)
    if spec.init == "arange":
        return jnp.arange(shape[0], dtype=jnp.int32)
    if spec.init.startswith("gidx:"):  # quantized experts' act-order g_idx [E, I, ...]: plain groups
        rows = jnp.arange(shape[1], dtype=jnp.int32) // int(spec.init[5:])
        return jnp.broadcast_to(rows.reshape(1, -1, *[1] * (len(shape) - 2)), shape)
    if spec.init == "fp8":
        return (jax.random.normal(key, shape, jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    if spec.init.startswith("scale:"):  # chosen so that dequantized values spread ~0.02, as the dense dummies
        return jnp.full(shape, float(spec.init[6:]), spec.dtype)
    raise ValueError(spec.init)


def quantize_activations(x, w: QuantizedWeight):
    """x as an int8 W8A8 kernel sees it: rounded to int8 with a per-token (dynamic) scale amax / 127, in x's dtype
    (the int weight path then multiplies it as a weight-only product does)."""
    x32 = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / INT8_MAX, 1e-12)
    return (jnp.round(jnp.clip(x32 / scale, -INT8_MAX, INT8_MAX)) * scale).astype(x.dtype)
