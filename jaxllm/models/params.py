"""Each weight declared once: shape, logical axes, initialiser. Abstract shapes, shardings and dummy
weights are all derived from this table, so a loader fills arrays that are created already sharded."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.sharding import LOGICAL_RULES, kv_heads_for, mesh_pp, named_sharding, stage_layers, stage_mesh


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, see jaxllm/sharding.py
    init: str = "normal"  # normal | ones | zeros
    kv_repeat: int = 1  # > 1: the "kv_heads" axis is stored with each checkpoint head repeated (tp > K)

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape in checkpoints (HF, Orbax): before kv heads are repeated."""
        if self.kv_repeat == 1:
            return self.shape
        i = self.axes.index("kv_heads")
        return self.shape[:i] + (self.shape[i] // self.kv_repeat,) + self.shape[i + 1 :]

    def expand(self, x):
        """Checkpoint layout -> stored layout (numpy or jax array)."""
        if self.kv_repeat == 1:
            return x
        import numpy as np

        mod = np if isinstance(x, np.ndarray) else jnp
        return mod.repeat(x, self.kv_repeat, axis=self.axes.index("kv_heads"))


def param_specs(cfg: ModelConfig, tp: int = 1) -> dict:
    """The params pytree of the decoder, as ParamSpecs. Layers are a list: one buffer per layer's weights
    (a scan over stacked layers costs 2x per decode step on GPU, see gpu-findings.md). With tp > K the kv
    heads are stored repeated (jaxllm/sharding.py: kv_heads_for)."""
    D, N, K, H, F, V = (
        cfg.hidden_size,
        cfg.num_heads,
        kv_heads_for(cfg.num_kv_heads, tp),
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    r = K // cfg.num_kv_heads
    layer = {
        "attn_norm": ParamSpec((D,), ("embed",), "ones"),
        "wq": ParamSpec((D, N, H), ("embed", "heads", "head_dim")),
        "wk": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim"), kv_repeat=r),
        "wv": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim"), kv_repeat=r),
        "wo": ParamSpec((N, H, D), ("heads", "head_dim", "embed")),
        "mlp_norm": ParamSpec((D,), ("embed",), "ones"),
        "w_gate": ParamSpec((D, F), ("embed", "ffn")),
        "w_up": ParamSpec((D, F), ("embed", "ffn")),
        "w_down": ParamSpec((F, D), ("ffn", "embed")),
    }
    if cfg.qkv_bias:
        layer["bq"] = ParamSpec((N, H), ("heads", "head_dim"), "zeros")
        layer["bk"] = ParamSpec((K, H), ("kv_heads", "head_dim"), "zeros", r)
        layer["bv"] = ParamSpec((K, H), ("kv_heads", "head_dim"), "zeros", r)
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
            out[name] = [jax.tree.map(lambda s, m=rows[stage_of[i]]: named_sharding(m, s.axes, rules), layer,
                                      is_leaf=is_spec) for i, layer in enumerate(sub)]
        else:
            out[name] = named_sharding(rows[0] if name == "embed" else rows[-1], sub.axes, rules)
    return out


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
        sig = (spec, sharding)
        if sig not in cache:
            cache[sig] = jax.jit(_init_fn(spec, dtype, std), out_shardings=sharding)
        out.append(cache[sig](key))
    return jax.tree.unflatten(treedef, out)


def _init_fn(spec: ParamSpec, dtype, std: float):
    def init(key):
        shape = spec.checkpoint_shape  # repeated kv heads are copies, as when loading a checkpoint
        if spec.init == "ones":
            x = jnp.ones(shape, dtype)
        elif spec.init == "zeros":
            x = jnp.zeros(shape, dtype)
        else:
            x = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        return spec.expand(x)

    return init
