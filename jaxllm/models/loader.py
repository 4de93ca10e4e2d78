"""Weights from an HF checkpoint directory (safetensors or pytorch_model.bin, single or sharded) into the
params pytree of jaxllm/models/params.py.

The mapping is a table: each of our weights names its HF tensor (or the tensors fused into it: q/k/v,
gate/up) and a named hook that reshapes them.
Every weight is read on the host, reshaped, and placed with jax.make_array_from_callback, so each device
receives only its own shard and no device ever holds a full unsharded copy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator

import jax
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.models.checkpoint_files import MANIFEST, CheckpointReader, is_jaxllm_checkpoint
from jaxllm.models.params import ParamSpec, abstract_params, dummy_params, is_spec, param_shardings, param_specs
from jaxllm.quantization import SIDE_CONFIG_FILES
from jaxllm.sharding import ParallelConfig, mesh_pp, mesh_tp, named_sharding, remote_array

ORBAX_SUBDIR = "params"
FORMAT = "jaxllm-orbax"
FORMAT_VERSION = 2  # 2: fused w_qkv and w_gate_up; 1 (no longer read): separate wq, wk, wv, w_gate, w_up


# --- hooks: HF tensors (numpy) -> our layout, called as hook(*tensors, cfg). -------------------------------
def _fuse_heads(q, k, v, cfg):  # torch rows [N*H, ..], [K*H, ..] x2 -> [K, G + 2, H, ..]: per kv head q, k, v
    K, H = cfg.num_kv_heads, cfg.head_dim
    return np.concatenate([x.reshape(K, -1, H, *x.shape[1:]) for x in (q, k, v)], axis=1)


def _fuse_qkv(q, k, v, cfg):  # q/k/v_proj Linear weights -> [D, K, G + 2, H]
    return np.moveaxis(_fuse_heads(q, k, v, cfg), -1, 0)


def _w_pack(x, cfg):  # Baichuan W_pack [3*D, D] = rows of q, k, v (MHA)
    return _fuse_qkv(*np.split(x, 3), cfg)


def _fuse_gate_up(gate, up, cfg):  # Linear weights [F, D] x2 -> [D, 2, F]
    return np.stack([gate.T, up.T], axis=1)


def _stack_biases(gate, up, cfg):  # [F] x2 -> [2, F]
    return np.stack([gate, up])


def _out_heads(x, cfg):  # o_proj [D, N*H] -> [N, H, D]
    return x.T.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)


def _transpose(x, cfg):
    return x.T


def _identity(x, cfg):
    return x


def _stack_experts_gate_up(*args):  # (E gate then E up Linear weights [F, D], cfg) -> [E, D, 2, F]
    *xs, cfg = args
    E = cfg.moe.num_experts
    return np.stack([np.stack(xs[:E]), np.stack(xs[E:])], axis=1).transpose(0, 3, 1, 2)


def _stack_experts_down(*args):  # (E down Linear weights [D, F], cfg) -> [E, F, D]
    *xs, _ = args
    return np.stack(xs).transpose(0, 2, 1)


def _flatten(x, cfg):  # Qwen2-MoE's shared_expert_gate Linear [1, D] -> [D]
    return x.reshape(-1)


def _normalized_rows(x, cfg):  # Baichuan2 NormHead: unit-norm rows of lm_head
    x32 = x.astype(np.float32)
    return x32 / np.maximum(np.linalg.norm(x32, axis=-1, keepdims=True), 1e-7)


_QKV = tuple(f"self_attn.{p}_proj" for p in "qkv")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
# our weight -> (HF tensor name, or names fused into it, hook)
LAYER_TABLE: dict[str, tuple[str | tuple[str, ...], Callable]] = {
    "attn_norm": ("input_layernorm.weight", _identity),
    "w_qkv": (tuple(f"{p}.weight" for p in _QKV), _fuse_qkv),
    "b_qkv": (tuple(f"{p}.bias" for p in _QKV), _fuse_heads),
    "wo": ("self_attn.o_proj.weight", _out_heads),
    "bo": ("self_attn.o_proj.bias", _identity),
    "mlp_norm": ("post_attention_layernorm.weight", _identity),
    "w_gate_up": (tuple(f"{p}.weight" for p in _GATE_UP), _fuse_gate_up),
    "b_gate_up": (tuple(f"{p}.bias" for p in _GATE_UP), _stack_biases),
    "w_down": ("mlp.down_proj.weight", _transpose),
    "b_down": ("mlp.down_proj.bias", _identity),
}
FUSED_QKV_TABLE = {"w_qkv": ("self_attn.W_pack.weight", _w_pack)}
QK_NORM_TABLE = {"q_norm": ("self_attn.q_norm.weight", _identity), "k_norm": ("self_attn.k_norm.weight", _identity)}
# Gemma 2/3: post_attention_layernorm norms the attention's output; the MLP's input norm is pre_feedforward.
GEMMA_TABLE = {
    "post_attn_norm": ("post_attention_layernorm.weight", _identity),
    "mlp_norm": ("pre_feedforward_layernorm.weight", _identity),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", _identity),
}


def moe_table(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], Callable]]:
    """A MoE layer's weights: Mixtral's block_sparse_moe.experts.{e}.w1 / w3 / w2 (gate / up / down), Qwen's
    mlp.experts.{e}.gate_proj / up_proj / down_proj and mlp.shared_expert(_gate); each expert separate, as
    the checkpoints on the Hub store them (transformers 5 writes them so too)."""
    from jaxllm.models.moe import expert_linear_names

    E = range(cfg.moe.num_experts)
    p, (gate, up, down) = expert_linear_names(cfg)
    table = {
        "router": ((f"{p}gate.weight",), _transpose),
        "w_experts_gate_up": (
            tuple(f"{p}experts.{e}.{n}.weight" for n in (gate, up) for e in E),
            _stack_experts_gate_up,
        ),
        "w_experts_down": (tuple(f"{p}experts.{e}.{down}.weight" for e in E), _stack_experts_down),
    }
    if cfg.moe.shared_intermediate_size:
        table["w_shared_gate_up"] = (
            (f"{p}shared_expert.gate_proj.weight", f"{p}shared_expert.up_proj.weight"),
            _fuse_gate_up,
        )
        table["w_shared_down"] = ((f"{p}shared_expert.down_proj.weight",), _transpose)
        table["w_shared_expert_gate"] = ((f"{p}shared_expert_gate.weight",), _flatten)
    return table


TOP_TABLE: dict[str, tuple[str, Callable]] = {
    "embed": ("model.embed_tokens.weight", _identity),
    "final_norm": ("model.norm.weight", _identity),
    "lm_head": ("lm_head.weight", _identity),
}


def weight_table(cfg: ModelConfig) -> dict[tuple, tuple[tuple[str, ...], Callable]]:
    """(our path as a tuple of keys) -> (HF tensor names, hook), for every weight of cfg's params."""
    layer_table = dict(LAYER_TABLE, **(FUSED_QKV_TABLE if cfg.fused_qkv else {}), **QK_NORM_TABLE)
    if cfg.sandwich_norm:
        layer_table.update(GEMMA_TABLE)
    if cfg.moe is not None:
        layer_table.update(moe_table(cfg))
    specs = param_specs(cfg)
    table = {}
    for name in specs:
        if name == "layers":
            continue
        hf_name, hook = TOP_TABLE[name]
        if name == "lm_head" and cfg.normalize_lm_head:
            hook = _normalized_rows
        table[(name,)] = ((hf_name,), hook)
    for i, layer in enumerate(specs["layers"]):
        for key in layer:
            hf_names, hook = layer_table[key]
            hf_names = (hf_names,) if isinstance(hf_names, str) else hf_names
            table[("layers", i, key)] = (tuple(f"model.layers.{i}.{n}" for n in hf_names), hook)
    return table


# --- loading ------------------------------------------------------------------------------------------------
# Checkpoint tensors that are buffers, not weights (RoPE tables some exports keep); vLLM skips them too.
_IGNORED = re.compile(r"rotary_emb\.(inv_freq|cos_cached|sin_cached)$")


def _path_key(path) -> tuple:
    # dict keys, list indices, and the fields of a QuantizedWeight (GetAttrKey)
    return tuple(p.key if hasattr(p, "key") else p.name if hasattr(p, "name") else p.idx for p in path)


_QUANT_TENSOR = re.compile(
    r"\.(qweight|qzeros|scales|g_idx|weight_packed|weight_scale|weight_zero_point|weight_shape)$"
)


def _unused_message(unused: list[str], reader: CheckpointReader, quantized: bool) -> str:
    """Why the checkpoint's tensors are not all used: a quantized lm_head, quantized tensors without a quantization
    config, or (generally) a config.json that does not belong to these weights."""
    names = ", ".join(map(repr, unused[:3]))
    head = [n for n in unused if n.startswith("lm_head.") and _QUANT_TENSOR.search(n)]
    if head:
        return (
            f"The checkpoint's lm_head is quantized ({', '.join(map(repr, head[:3]))}): a quantized lm_head is not "
            "supported; jaxllm quantizes the decoder layers' linears only (quantize with lm_head ignored)."
        )
    if not quantized and any(_QUANT_TENSOR.search(n) for n in unused):
        folder = os.path.dirname(reader.files[0]) if reader.files else ""
        side = [f for f in SIDE_CONFIG_FILES if os.path.isfile(os.path.join(folder, f))]
        hint = (
            f"; {side[0]} is there: pass --quantization gptq or awq (quantization=...) to read it, as vLLM does"
            if side
            else ""
        )
        return f"Checkpoint has quantized tensors ({names}) but config.json has no quantization_config{hint}."
    return (
        f"Checkpoint has {len(unused)} tensor(s) the model config does not use, e.g. {names}; check that "
        "config.json belongs to these weights."
    )


def iter_host_weights(reader: CheckpointReader, cfg: ModelConfig) -> Iterator[tuple[tuple, np.ndarray]]:
    """(our path, host array in our layout), checked against the declared shapes. Checkpoint layout: kv
    heads are not repeated (tp = 1 specs). Fused weights are fused here, on the host, one at a time."""
    reader.use_names_of(cfg)
    specs = param_specs(cfg)
    table = weight_table(cfg)
    quant = quant_loader(reader, cfg, table)
    if quant is not None:  # the quantized linears' tensors replace their dense names
        table = {k: v for k, v in table.items() if not (k[0] == "layers" and (k[1], k[2]) in quant.keys)}
    used = {n for names, _ in table.values() for n in names} | (quant.tensor_names() if quant else set())
    unused = [
        n
        for n in reader.keys()
        if n not in used and not _IGNORED.search(n) and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    ]
    if unused:  # the config and the checkpoint disagree (layer count, biases): loading would run another model
        raise ValueError(_unused_message(unused, reader, quant is not None))
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        key = _path_key(path)
        if quant is not None and quant.owns(key):
            x = quant.get(key)
            if tuple(x.shape) != spec.checkpoint_shape:
                raise ValueError(
                    f"{'/'.join(map(str, key))}: the quantized tensors give shape {tuple(x.shape)}; "
                    f"expected {spec.checkpoint_shape}."
                )
            yield key, x
            continue
        hf_names, hook = table[key]
        for hf_name in hf_names:
            if hf_name not in reader:
                raise ValueError(f"Checkpoint is missing tensor {hf_name!r} (needed for {'/'.join(map(str, key))}).")
        raw = [reader.get(n) for n in hf_names]
        got = ("Tensors " if len(raw) > 1 else "Tensor ") + ", ".join(
            f"{n!r} has shape {tuple(r.shape)}" for n, r in zip(hf_names, raw, strict=True)
        )
        try:
            x = hook(*raw, cfg)
        except ValueError as e:
            raise ValueError(
                f"{got}, which does not fit the expected shape {spec.shape} for {'/'.join(map(str, key))}: {e}"
            ) from None
        if tuple(x.shape) != spec.shape:
            raise ValueError(f"{got} -> {tuple(x.shape)}; expected {spec.shape}.")
        yield key, x


def quant_loader(reader: CheckpointReader, cfg: ModelConfig, table: dict | None = None):
    """A checked QuantLoader for cfg's quantized linears (None for an unquantized model): a missing or misshapen
    quantized tensor is a ValueError here, before any weight is read."""
    if cfg.quantization is None:
        return None
    from jaxllm.models.quant_loader import QuantLoader

    reader.use_names_of(cfg)
    loader = QuantLoader(reader, cfg, weight_table(cfg) if table is None else table)
    loader.check()
    return loader


def check_checkpoint(model_dir: str, cfg: ModelConfig, load_format: str = "auto") -> None:
    """Reads only file headers: a quantized checkpoint whose tensors disagree with its config raises ValueError
    (the engine calls this before it loads weights or compiles steps)."""
    if cfg.quantization is None or load_format == "dummy" or is_jaxllm_checkpoint(model_dir):
        return
    quant_loader(CheckpointReader(model_dir, load_format), cfg)


def _weights_layout(cfg: ModelConfig, mesh):
    """(dtype, ParamSpec tree, sharding tree) of cfg's weights on mesh."""
    import jax.numpy as jnp

    ParallelConfig(mesh_tp(mesh), mesh_pp(mesh)).validate(cfg)
    specs = param_specs(cfg, tp=mesh_tp(mesh))
    return jnp.dtype(cfg.dtype), specs, param_shardings(specs, mesh)


def abstract_weights(cfg: ModelConfig, mesh):
    """What load_params returns, as jax.ShapeDtypeStructs with their shardings (no memory): the step programs
    are lowered against it while the weights load."""
    dtype, specs, shardings = _weights_layout(cfg, mesh)
    return abstract_params(specs, dtype, shardings)


def load_params(model_dir: str, cfg: ModelConfig, mesh, load_format: str = "auto", seed: int = 0):
    """The params pytree, created sharded over mesh. load_format="dummy" makes random weights on device.
    A directory written by `python -m jaxllm.convert` (it holds MANIFEST) is restored from Orbax straight
    into mesh's shardings, whatever mesh it was converted for."""
    dtype, specs, shardings = _weights_layout(cfg, mesh)
    if load_format == "dummy":
        return dummy_params(specs, dtype, shardings, seed=seed)
    if load_format == "auto" and is_jaxllm_checkpoint(model_dir):
        return restore_orbax(model_dir, cfg, specs, shardings, dtype)
    reader = CheckpointReader(model_dir, load_format)
    flat_spec = dict((_path_key(p), s) for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0])
    flat_sh = dict(
        (_path_key(p), s)
        for p, s in jax.tree_util.tree_flatten_with_path(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )[0]
    )
    loaded = {}
    for key, x in iter_host_weights(reader, cfg):
        # Host copy only: each device receives just its slice from the callback.
        spec = flat_spec[key]
        host = spec.expand(np.asarray(x).astype(spec.checkpoint_dtype or dtype))
        # dtype: a process holding none of its shards (a pipeline stage of another host) still makes the array
        loaded[key] = jax.make_array_from_callback(
            host.shape, flat_sh[key], lambda idx, h=host: h[idx], dtype=host.dtype
        )
    treedef = jax.tree.structure(specs, is_leaf=is_spec)
    paths = [_path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]]
    return jax.tree.unflatten(treedef, [loaded[k] for k in paths])


def _is_int(dtype) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(jnp.dtype(str(dtype)), jnp.integer))


def restore_orbax(model_dir: str, cfg: ModelConfig, specs, shardings, dtype):
    """Orbax restore with the target shardings: each device reads only its own slices from disk, and a process
    nothing of other processes' pipeline stages. Weights whose kv heads are repeated (tp > K) are restored one
    checkpoint kv head per device, then expanded there."""
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    with open(os.path.join(model_dir, MANIFEST)) as f:
        manifest = json.load(f)
    fmt = (manifest.get("format"), manifest.get("format_version"))
    if fmt != (FORMAT, FORMAT_VERSION):
        raise ValueError(
            f"{model_dir} is a jaxllm checkpoint of format {fmt[0]!r} version {fmt[1]}, but this jaxllm reads "
            f"{FORMAT!r} version {FORMAT_VERSION} (fused qkv and gate_up weights). Convert the HF checkpoint "
            f"again: python -m jaxllm.convert --model HF_DIR --out DIR."
        )
    saved = manifest.get("params", {})
    want = None if cfg.quantization is None else json.loads(json.dumps(dataclasses.asdict(cfg.quantization)))
    if manifest.get("quantization") != want:
        raise ValueError(
            f"{model_dir} was converted with quantization {manifest.get('quantization')}, but its "
            f"config.json (and the quantization argument) give {want}; convert it again."
        )

    def target(spec, sh):
        dt = spec.checkpoint_dtype or dtype
        if spec.kv_repeat == 1 and spec.relayout is None:
            return jax.ShapeDtypeStruct(spec.shape, dt, sharding=sh)
        if spec.kv_repeat == 1:  # a quantized leaf: its checkpoint layout, laid out for the kernels in finish
            return jax.ShapeDtypeStruct(
                spec.checkpoint_shape, dt, sharding=named_sharding(sh.mesh, spec.checkpoint_axes)
            )
        # tp > K: tp shard t = k * r + j reads checkpoint kv head k whole, then keeps its copy j (finish).
        ckpt_axes = spec.checkpoint_axes
        K, r = spec.checkpoint_shape[ckpt_axes.index("kv_heads")], spec.kv_repeat
        mesh = Mesh(sh.mesh.devices.reshape(K, r), ("kv", "copy"))
        axes = PartitionSpec(*("kv" if a == "kv_heads" else None for a in ckpt_axes))
        return jax.ShapeDtypeStruct(spec.checkpoint_shape, dt, sharding=NamedSharding(mesh, axes))

    abstract = jax.tree.map(target, specs, shardings, is_leaf=is_spec)
    flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
    for (path, a), spec in zip(jax.tree_util.tree_flatten_with_path(abstract)[0], flat_specs, strict=True):
        name = "/".join(map(str, _path_key(path)))
        if name in saved and tuple(saved[name]["shape"]) != a.shape:
            raise ValueError(
                f"Checkpoint {model_dir} stores {name} with shape {tuple(saved[name]['shape'])}; "
                f"the config expects {a.shape}."
            )
        # quantized leaves of an older layout: act-order g_idx (now perm), integer zeros (now the scales' dtype)
        stored = saved.get(name, {}).get("dtype")
        if stored is None or spec.relayout is not None and _is_int(stored) != _is_int(a.dtype):
            raise ValueError(
                f"Checkpoint {model_dir} was written by an older jaxllm ({name}: {stored or 'missing'}, "
                f"expected {a.dtype}); convert it again: python -m jaxllm.convert --model HF_DIR --out DIR."
            )

    # Another process's pipeline stage (no device here) is not read: this process needs none of its data, and Orbax
    # cannot make an array with no local shard (it leaves out the dtype). A PyTreeCheckpointer, as the
    # StandardCheckpointer that wrote it refuses placeholders.
    def read_here(a):
        if not a.sharding.addressable_devices:
            return ocp.PLACEHOLDER
        return ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype)

    args = jax.tree.map(read_here, abstract)
    local = jax.tree.map(lambda a, r: r if r is ocp.PLACEHOLDER else a, abstract, args)
    with ocp.PyTreeCheckpointer() as ckptr:
        params = ckptr.restore(
            os.path.join(os.path.realpath(model_dir), ORBAX_SUBDIR),  # ("//x" is a path Orbax refuses)
            args=ocp.args.PyTreeRestore(item=local, restore_args=args),
        )

    def finish(spec, sh, a, x):
        if not sh.addressable_devices:  # its global array, holding no data; no jit placed only there (remote_array)
            out = jax.eval_shape(spec.expand, a)
            return remote_array(out.shape, sh, out.dtype)
        if spec.kv_repeat == 1:
            return x if spec.relayout is None else jax.jit(spec.expand, out_shardings=sh)(x)
        i, index = spec.axes.index("kv_heads"), sh.devices_indices_map(spec.shape)
        local = [
            jax.lax.index_in_dim(spec.expand(s.data), index[s.device][i].start % spec.kv_repeat, i)
            for s in x.addressable_shards
        ]  # on each device, from its own data: no communication
        return jax.make_array_from_single_device_arrays(spec.shape, sh, local, dtype=x.dtype)

    return jax.tree.map(finish, specs, shardings, abstract, params, is_leaf=is_spec)


__all__ = ["CheckpointReader", "load_params", "abstract_weights", "weight_table", "abstract_params", "ParamSpec"]
