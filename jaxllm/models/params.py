"""Each weight declared once: shape, logical axes, initialiser. Abstract shapes, shardings and dummy
weights are all derived from this table, so a loader fills arrays that are created already sharded."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.sharding import (
    LOGICAL_RULES,
    kv_heads_for,
    mesh_pp,
    named_sharding,
    remote_array,
    stage_layers,
    stage_mesh,
)


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, see jaxllm/sharding.py
    init: str = "normal"  # normal | ones | zeros (quantized weights' leaves: see models/quant.py dummy_values)
    kv_repeat: int = 1  # > 1: tp > K, each checkpoint kv head is stored as kv_repeat heads (see expand)
    dtype: str | None = None  # None: the model's dtype (quantized weights' packed values, scales, zeros set it)
    # Quantized leaves: the checkpoint layout's shape and axes, and the function to the device layout (quant.py)
    relayout: object = None

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape in checkpoints (HF, Orbax): before kv heads are repeated, [.., K, G + 2, ..]."""
        if self.relayout is not None:
            return self.relayout.checkpoint_shape
        if self.kv_repeat == 1:
            return self.shape
        i, r = self.axes.index("kv_heads"), self.kv_repeat
        K, G = self.shape[i] // r, (self.shape[i + 1] - 2) * r
        return self.shape[:i] + (K, G + 2) + self.shape[i + 2 :]

    @property
    def checkpoint_dtype(self) -> str | None:
        """The dtype in checkpoints (None: the model's); a quantized leaf's may differ from its device dtype."""
        return self.dtype if self.relayout is None else self.relayout.checkpoint_dtype or self.dtype

    @property
    def checkpoint_axes(self) -> tuple[str | None, ...]:
        return self.axes if self.relayout is None else self.relayout.checkpoint_axes

    def expand(self, x):
        """Checkpoint layout [.., K, G + 2, ..] -> stored layout [.., K * r, G / r + 2, ..] (numpy or jax
        array): copy j of kv head k takes the j-th of r slices of k's q heads and k's k and v, so q head n
        sits in stored kv head n // (G / r), the tp shard that also holds its o columns. A quantized leaf is
        laid out for the kernels first (relayout)."""
        if self.relayout is not None:
            x = self.relayout(x)
        if self.kv_repeat == 1:
            return x
        import numpy as np

        mod = np if isinstance(x, np.ndarray) else jnp
        i, r = self.axes.index("kv_heads"), self.kv_repeat  # axis i + 1 is "qkv"
        x = mod.moveaxis(x, (i, i + 1), (0, 1))
        K, G, rest = x.shape[0], x.shape[1] - 2, x.shape[2:]
        q = x[:, :G].reshape(K, r, G // r, *rest)
        kv = mod.broadcast_to(x[:, None, G:], (K, r, 2, *rest))
        y = mod.concatenate([q, kv], axis=2).reshape(K * r, G // r + 2, *rest)
        return mod.moveaxis(y, (0, 1), (i, i + 1))


def param_specs(cfg: ModelConfig, tp: int = 1) -> dict:
    """The params pytree of the decoder, as ParamSpecs. Layers are a list: one buffer per layer's weights
    (a scan over stacked layers costs 2x per decode step on GPU, see gpu-findings.md). With tp > K the kv
    heads are stored repeated (jaxllm/sharding.py: kv_heads_for).

    q, k, v are one weight and gate, up another, so a decode step runs one GEMV for each (small k and v
    GEMVs run far below memory bandwidth). w_qkv [D, K, G + 2, H] is grouped per kv head: its G q heads
    (HF q head n belongs to kv head n // G), then k, then v; w_gate_up [D, 2, F] holds gate and up
    columns side by side. Splitting K or F over tp then gives every shard matching q, k, v (gate, up)
    columns with no communication."""
    D, N, K, H, F, V = (
        cfg.hidden_size,
        cfg.num_heads,
        kv_heads_for(cfg.num_kv_heads, tp),
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    r = K // cfg.num_kv_heads
    G = N // K
    norm = "zeros" if cfg.norm_plus_one else "ones"  # Gemma's norms scale by (1 + w)
    layer = {
        "attn_norm": ParamSpec((D,), ("embed",), norm),
        "w_qkv": ParamSpec((D, K, G + 2, H), ("embed", "kv_heads", "qkv", "head_dim"), kv_repeat=r),
        "wo": ParamSpec((N, H, D), ("heads", "head_dim", "embed")),
        "mlp_norm": ParamSpec((D,), ("embed",), norm),
        "w_gate_up": ParamSpec((D, 2, F), ("embed", None, "ffn")),
        "w_down": ParamSpec((F, D), ("ffn", "embed")),
    }
    if cfg.qk_norm:  # one weight per head dim, shared by all q (k) heads
        layer["q_norm"] = ParamSpec((H,), ("head_dim",), norm)
        layer["k_norm"] = ParamSpec((H,), ("head_dim",), norm)
    if cfg.sandwich_norm:
        layer["post_attn_norm"] = ParamSpec((D,), ("embed",), norm)
        layer["post_mlp_norm"] = ParamSpec((D,), ("embed",), norm)
    if cfg.qkv_bias:
        layer["b_qkv"] = ParamSpec((K, G + 2, H), ("kv_heads", "qkv", "head_dim"), "zeros", r)
    if cfg.o_bias:
        layer["bo"] = ParamSpec((D,), ("embed",), "zeros")
    if cfg.mlp_bias:
        layer["b_gate_up"] = ParamSpec((2, F), (None, "ffn"), "zeros")
        layer["b_down"] = ParamSpec((D,), ("embed",), "zeros")
    moe = {}
    if cfg.moe is not None:  # MoE layers: experts (and a shared expert) in place of the dense MLP
        from jaxllm.models.moe import moe_param_specs

        moe = moe_param_specs(cfg)
    dense = {k: v for k, v in layer.items() if k not in ("w_gate_up", "w_down", "b_gate_up", "b_down")}
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "layers": [dense | moe if cfg.layer_kind(i).moe else dict(layer) for i in range(cfg.num_layers)],
        "final_norm": ParamSpec((D,), ("embed",), norm),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((V, D), ("vocab", "embed"))
    if cfg.quantization is not None:
        from jaxllm.models.quant import quantize_specs

        specs = quantize_specs(specs, cfg, tp)
    return specs


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_shardings(specs, mesh, rules=LOGICAL_RULES):
    """NamedSharding per weight. With pp > 1 each weight lives on its pipeline stage's row of the mesh:
    layers on their stage, embed on the first, final_norm / lm_head on the last."""
    pp = mesh_pp(mesh)
    if pp == 1:
        return jax.tree.map(lambda s: named_sharding(mesh, s.axes, rules), specs, is_leaf=is_spec)
    rows = [stage_mesh(mesh, s) for s in range(pp)]
    stage_of = {i: s for s, r in enumerate(stage_layers(len(specs["layers"]), pp)) for i in r}
    out = {}
    for name, sub in specs.items():
        if name == "layers":
            out[name] = [
                jax.tree.map(lambda s, m=rows[stage_of[i]]: named_sharding(m, s.axes, rules), layer, is_leaf=is_spec)
                for i, layer in enumerate(sub)
            ]
        else:
            out[name] = named_sharding(rows[0] if name == "embed" else rows[-1], sub.axes, rules)
    return out


def abstract_params(specs, dtype, shardings=None):
    """jax.ShapeDtypeStruct per weight (with its sharding): what a loader fills."""
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype or dtype), specs, is_leaf=is_spec)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype or dtype, sharding=sh), specs, shardings, is_leaf=is_spec
    )


def dummy_params(specs, dtype, shardings, seed: int = 0, std: float = 0.02):
    """Random weights of the right shapes, created directly on the devices in their shardings (one jit per
    weight keeps peak memory at one weight; no host copy, no full copy on one device)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    sh_leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    cache = {}
    for spec, sharding, key in zip(leaves, sh_leaves, keys, strict=True):
        if not sharding.addressable_devices:
            out.append(remote_array(spec.shape, sharding, spec.dtype or dtype))  # another process's stage
            continue
        sig = (spec, sharding)
        if sig not in cache:
            cache[sig] = jax.jit(_init_fn(spec, dtype, std), out_shardings=sharding)
        out.append(cache[sig](key))
    return jax.tree.unflatten(treedef, out)


def _init_fn(spec: ParamSpec, dtype, std: float):
    dtype = spec.dtype or dtype

    def init(key):
        shape = spec.checkpoint_shape  # repeated kv heads are copies, as when loading a checkpoint
        if spec.init not in ("ones", "zeros", "normal"):  # a quantized weight's packed values, scales, zeros
            from jaxllm.models.quant import dummy_values

            return spec.expand(dummy_values(spec, key))
        if spec.init == "ones":
            x = jnp.ones(shape, dtype)
        elif spec.init == "zeros":
            x = jnp.zeros(shape, dtype)
        else:
            x = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        return spec.expand(x)

    return init
