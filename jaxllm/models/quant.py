"""Quantized linear layers: one weight type (QuantizedWeight), one function (qmatmul), one in-memory layout that the
loader repacks every checkpoint format into (GPTQ v1/v2, AWQ GEMM, compressed-tensors, fp8).

    qmatmul(x [T, I], w: QuantizedWeight) -> [T, *O]   (x's dtype; the reference: dequantize, then one matmul)

Canonical layout of a QuantizedWeight for a linear with I input rows and output shape O (our dense layout with its
input axes flattened: w_qkv [D | K, G + 2, H], wo [N * H | D], w_gate_up [D | 2, F], w_down [F | D]):

  int weights (scheme.weight_type "int", bits b in {4, 8}; pf = 32 // b values per word):
    packed   int32 [I / pf, *O]  values q in [0, 2**b), packed along the input dim: row r of the input is bits
                                 [b * (r % pf), b * (r % pf) + b) of word r // pf, least-significant first
                                 (GPTQ's qweight layout; AWQ and compressed-tensors are repacked into it)
    scales   [ng, *O]            model dtype; ng = I / group_size (1 when group_size == -1)
    zeros    uint8 [ng, *O]      the zero point z in [0, 2**b), unpacked; None when symmetric: z = 2**(b-1)
    g_idx    int32 [I]           None: input row r is in group r // group_size. Act-order checkpoints (GPTQ
                                 desc_act, compressed-tensors actorder) keep their rows in checkpoint order and
                                 name each row's group here; their scales / zeros are then not split over tp.
    w[r, o] = (q[r, o] - z[g(r), o]) * scales[g(r), o]
  fp8 weights (weight_type "float"):
    packed   float8_e4m3fn [I, *O]
    scales   float32 [1, *O]     per output channel (per-tensor checkpoint scales are broadcast to their columns)
    w[r, o] = packed[r, o] * scales[0, o]
  activations (scheme.activations): None: weight-only. "dynamic": x is quantized per token (fp8 e4m3, or int8 for int
  weights) with scale amax / qmax; "static": with act_scale (float32 [], per-tensor, the max of the fused layers'
  input scales as vLLM takes it). The reference applies that rounding to x before its matmul, as a W8A8 kernel does.

Sharding: every leaf carries the dense weight's logical axes (jaxllm/sharding.py), the input axis on its first
dimension, so a column-parallel weight splits its output columns and a row-parallel one (wo, w_down) its input
rows in whole groups (quantize_specs checks that tp shards hold whole groups).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.quantization import QuantConfig

FP8_MAX = 448.0  # float8_e4m3fn
INT8_MAX = 127.0

# Our quantizable weights -> how many leading axes of the dense weight are its input (wo [N, H, D]: 2).
QUANT_LINEARS = {"w_qkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}


@dataclass(frozen=True)
class QuantScheme:
    """What qmatmul needs to know statically (hashable: part of the step's tree structure)."""

    weight_type: str  # int | float
    bits: int
    group_size: int  # -1: one group
    activations: str | None  # None | dynamic | static

    @classmethod
    def of(cls, q: QuantConfig) -> QuantScheme:
        return cls(q.weight_type, q.bits, q.group_size, q.activations)


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized linear's arrays (or, in spec trees, their ParamSpecs); see the module docstring for the layout."""

    packed: object
    scales: object
    zeros: object = None
    g_idx: object = None
    act_scale: object = None
    scheme: QuantScheme = None

    @property
    def in_features(self) -> int:
        pf = 32 // self.scheme.bits if self.scheme.weight_type == "int" else 1
        return self.packed.shape[0] * pf

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.packed.shape[1:])


jax.tree_util.register_dataclass(QuantizedWeight, data_fields=["packed", "scales", "zeros", "g_idx", "act_scale"],
                                 meta_fields=["scheme"])


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


# --- the reference -------------------------------------------------------------------------------------------------
def unpack_int(packed, bits: int):
    """int32 [I / pf, *O] -> int32 [I, *O] values in [0, 2**bits) (the canonical packing, any array module)."""
    pf = 32 // bits
    shifts = jnp.arange(pf, dtype=jnp.uint32) * bits
    words = jax.lax.bitcast_convert_type(packed, jnp.uint32)
    q = (words[:, None] >> shifts.reshape(pf, *([1] * (packed.ndim - 1)))) & ((1 << bits) - 1)
    return q.reshape(packed.shape[0] * pf, *packed.shape[1:]).astype(jnp.int32)


def dequantize(w: QuantizedWeight, dtype=jnp.float32):
    """The dense weight [I, *O] in dtype."""
    s = w.scheme
    if s.weight_type == "float":
        return (w.packed.astype(jnp.float32) * w.scales.astype(jnp.float32)).astype(dtype)
    q = unpack_int(w.packed, s.bits).astype(jnp.float32)
    scales = w.scales.astype(jnp.float32)
    zeros = (w.zeros.astype(jnp.float32) if w.zeros is not None
             else jnp.full((1,) * scales.ndim, 2 ** (s.bits - 1), jnp.float32))
    if w.g_idx is not None:  # act-order: each row names its group
        if w.zeros is not None:
            zeros = zeros[w.g_idx]
        return ((q - zeros) * scales[w.g_idx]).astype(dtype)
    I, ng = q.shape[0], scales.shape[0]
    q = q.reshape(ng, I // ng, *q.shape[1:])
    return ((q - zeros[:, None]) * scales[:, None]).reshape(I, *q.shape[2:]).astype(dtype)


def quantize_activations(x, w: QuantizedWeight):
    """x as a W8A8 kernel sees it: rounded to fp8 / int8 with a per-token (dynamic) or per-tensor (static) scale."""
    s = w.scheme
    x32 = x.astype(jnp.float32)
    qmax = FP8_MAX if s.weight_type == "float" else INT8_MAX
    if s.activations == "static":
        scale = w.act_scale.astype(jnp.float32)
    else:
        scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / qmax, 1e-12)
    y = jnp.clip(x32 / scale, -qmax, qmax)
    y = y.astype(jnp.float8_e4m3fn).astype(jnp.float32) if s.weight_type == "float" else jnp.round(y)
    return (y * scale).astype(x.dtype)


def qmatmul(x, w: QuantizedWeight):
    """x [T, I] @ w -> [T, *O] in x's dtype. The pure-jnp reference: dequantize the whole weight, then one matmul
    (the Pallas int4 / int8 / fp8 GEMMs of kernels_pallas replace this body, same signature and layout)."""
    if w.scheme.activations is not None:
        x = quantize_activations(x, w)
    dense = dequantize(w, x.dtype)
    y = jnp.dot(x, dense.reshape(dense.shape[0], -1), preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(x.shape[0], *dense.shape[1:])


# --- specs ----------------------------------------------------------------------------------------------------------
def quantized_spec(dense, n_in: int, q: QuantConfig, dtype: str, tp: int, name: str):
    """The QuantizedWeight of ParamSpecs replacing the dense ParamSpec of one linear (n_in leading input axes)."""
    from jaxllm.models.params import ParamSpec

    I, O = math.prod(dense.shape[:n_in]), dense.shape[n_in:]
    in_axis, out_axes, r = dense.axes[0], dense.axes[n_in:], dense.kv_repeat
    row_parallel = in_axis is not None and tp > 1 and in_axis in ("heads", "ffn")
    scheme = QuantScheme.of(q)
    if q.weight_type == "float":
        return QuantizedWeight(
            packed=ParamSpec((I, *O), (in_axis, *out_axes), "fp8", r, "float8_e4m3fn"),
            scales=ParamSpec((1, *O), (None, *out_axes), f"scale:{0.02 / 64}", r, "float32"),
            act_scale=ParamSpec((), (), "ones", 1, "float32") if q.activations == "static" else None,
            scheme=scheme)
    pf, g = q.pack_factor, I if q.group_size == -1 else q.group_size
    if I % g or I % pf:
        raise ValueError(f"{name}: input size {I} is not a multiple of quantization_config group_size {g} "
                         f"({q.source}).")
    if row_parallel and (I // tp) % (pf if q.act_order or q.group_size == -1 else g):
        raise ValueError(f"The input size is not aligned with the quantized weight shape: {name} has {I} input rows, "
                         f"{I // tp} per shard at tensor_parallel_size={tp}, not a multiple of group_size {g}. This "
                         f"can be caused by too large tensor parallel size.")
    # Groups split over tp with their rows, except act-order rows (any group anywhere) and a single group.
    group_axis = in_axis if row_parallel and not q.act_order and q.group_size != -1 else None
    spread = 2 ** (q.bits - 1) / math.sqrt(3)  # std of uniform random values around the zero (dummy weights)
    group = ParamSpec((I // g, *O), (group_axis, *out_axes), f"scale:{0.02 / spread}", r, dtype)
    return QuantizedWeight(
        packed=ParamSpec((I // pf, *O), (in_axis, *out_axes), f"int{q.bits}", r, "int32"),
        scales=group,
        zeros=None if q.symmetric else dataclasses.replace(group, init=f"zp{q.bits}", dtype="uint8"),
        g_idx=ParamSpec((I,), (in_axis,), f"g_idx{g}", 1, "int32") if q.act_order else None,
        scheme=scheme)


def hf_modules(cfg, key: str) -> tuple[str, ...]:
    """The HF Linear modules (relative to a decoder layer) fused into our weight `key`."""
    if key == "w_qkv":
        return ("self_attn.W_pack",) if cfg.fused_qkv else tuple(f"self_attn.{p}_proj" for p in "qkv")
    return {"wo": ("self_attn.o_proj",), "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
            "w_down": ("mlp.down_proj",)}[key]


def quantized_keys(cfg, layer: int) -> tuple[str, ...]:
    """Our weights of decoder layer `layer` that the checkpoint stores quantized (the rest stay dense)."""
    q = cfg.quantization
    out = []
    for key in QUANT_LINEARS:
        modules = [f"model.layers.{layer}.{m}" for m in hf_modules(cfg, key)]
        ignored = [q.is_ignored(m) for m in modules]
        if any(ignored) and not all(ignored):
            raise ValueError(f"{q.source} keeps {[m for m, i in zip(modules, ignored, strict=True) if i]} unquantized but "
                             f"quantizes {[m for m, i in zip(modules, ignored, strict=True) if not i]}; jaxllm fuses them into "
                             "one weight, so they must be quantized alike.")
        if not any(ignored):
            out.append(key)
    return tuple(out)


def quantize_specs(specs: dict, cfg, tp: int) -> dict:
    """param_specs with each quantized linear's ParamSpec replaced by its QuantizedWeight of ParamSpecs."""
    layers = []
    for i, layer in enumerate(specs["layers"]):
        layer = dict(layer)
        for key in quantized_keys(cfg, i):
            layer[key] = quantized_spec(layer[key], QUANT_LINEARS[key], cfg.quantization, cfg.dtype, tp,
                                        f"layers.{i}.{key}")
        layers.append(layer)
    return dict(specs, layers=layers)


def dummy_values(spec, key):
    """Random values of a quantized leaf (load_format="dummy"): the right shapes and dtypes, and a dequantized
    scale near the dense dummies' 0.02 so activations stay finite."""
    shape = spec.checkpoint_shape
    if spec.init.startswith("int"):
        return jax.random.bits(key, shape, jnp.uint32).view(jnp.int32)
    if spec.init.startswith("zp"):
        bits = int(spec.init[2:])
        return jax.random.randint(key, shape, 0, 2**bits, jnp.int32).astype(jnp.uint8)
    if spec.init.startswith("g_idx"):
        return (jnp.arange(shape[0], dtype=jnp.int32) // int(spec.init[5:])).astype(jnp.int32)
    if spec.init == "fp8":
        return (jax.random.normal(key, shape, jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    if spec.init.startswith("scale:"):  # chosen so that dequantized values spread ~0.02, as the dense dummies
        return jnp.full(shape, float(spec.init[6:]), spec.dtype)
    raise ValueError(spec.init)


def pack_int(q: np.ndarray, bits: int) -> np.ndarray:
    """Host values [I, *O] in [0, 2**bits) -> the canonical int32 [I / pf, *O] (inverse of unpack_int)."""
    pf = 32 // bits
    q = q.astype(np.uint32).reshape(q.shape[0] // pf, pf, *q.shape[1:])
    shifts = (np.arange(pf, dtype=np.uint32) * bits).reshape(1, pf, *([1] * (q.ndim - 2)))
    return np.bitwise_or.reduce(q << shifts, axis=1).view(np.int32)
