"""Each weight declared once: shape, logical axes, initialiser. Abstract shapes, shardings and dummy
weights are all derived from this table, so a loader fills arrays that are created already sharded."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.sharding import LOGICAL_RULES, named_sharding


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, see jaxllm/sharding.py
    init: str = "normal"  # normal | ones | zeros


def param_specs(cfg: ModelConfig) -> dict:
    """The params pytree of the decoder, as ParamSpecs. Layers are a list: one buffer per layer's weights
    (a scan over stacked layers costs 2x per decode step on GPU, see gpu-findings.md)."""
    D, N, K, H, F, V = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    layer = {
        "attn_norm": ParamSpec((D,), ("embed",), "ones"),
        "wq": ParamSpec((D, N, H), ("embed", "heads", "head_dim")),
        "wk": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim")),
        "wv": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim")),
        "wo": ParamSpec((N, H, D), ("heads", "head_dim", "embed")),
        "mlp_norm": ParamSpec((D,), ("embed",), "ones"),
        "w_gate": ParamSpec((D, F), ("embed", "ffn")),
        "w_up": ParamSpec((D, F), ("embed", "ffn")),
        "w_down": ParamSpec((F, D), ("ffn", "embed")),
    }
    if cfg.qkv_bias:
        layer["bq"] = ParamSpec((N, H), ("heads", "head_dim"), "zeros")
        layer["bk"] = ParamSpec((K, H), ("kv_heads", "head_dim"), "zeros")
        layer["bv"] = ParamSpec((K, H), ("kv_heads", "head_dim"), "zeros")
    if cfg.o_bias:
        layer["bo"] = ParamSpec((D,), ("embed",), "zeros")
    if cfg.mlp_bias:
        layer["b_gate"] = ParamSpec((F,), ("ffn",), "zeros")
        layer["b_up"] = ParamSpec((F,), ("ffn",), "zeros")
        layer["b_down"] = ParamSpec((D,), ("embed",), "zeros")
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "layers": [dict(layer) for _ in range(cfg.num_layers)],
        "final_norm": ParamSpec((D,), ("embed",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((V, D), ("vocab", "embed"))
    return specs


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_shardings(specs, mesh, rules=LOGICAL_RULES):
    return jax.tree.map(lambda s: named_sharding(mesh, s.axes, rules), specs, is_leaf=is_spec)


def abstract_params(specs, dtype, shardings=None):
    """jax.ShapeDtypeStruct per weight (with its sharding): what a loader fills."""
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=is_spec)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh), specs, shardings, is_leaf=is_spec
    )


def dummy_params(specs, dtype, shardings, seed: int = 0, std: float = 0.02):
    """Random weights of the right shapes, created directly on the devices in their shardings (one jit per
    weight keeps peak memory at one weight; no host copy, no full copy on one device)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    sh_leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    cache = {}
    for spec, sharding, key in zip(leaves, sh_leaves, keys):
        sig = (spec.shape, spec.init, sharding)
        if sig not in cache:
            cache[sig] = jax.jit(_init_fn(spec, dtype, std), out_shardings=sharding)
        out.append(cache[sig](key))
    return jax.tree.unflatten(treedef, out)


def _init_fn(spec: ParamSpec, dtype, std: float):
    def init(key):
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return (std * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)

    return init
