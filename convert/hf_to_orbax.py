"""convert_checkpoint(model_dir, out_dir, tp, pp, dtype): read every weight through the loader's table, place
it on CPU devices sharded the way a tp-way mesh will read it (Orbax writes one chunk per shard, so a restore
onto that mesh reads each device's slice and nothing else), write into a temporary directory beside out_dir
and rename it into place only when everything is written: a failed conversion leaves nothing behind.

Layout of the output directory:
    params/                    Orbax (StandardCheckpointer) pytree, checkpoint layout (fused w_qkv and
                               w_gate_up as in jaxllm/models/params.py, kv heads not repeated)
    jaxllm_manifest.json       format + format_version (the loader refuses others), jaxllm version, dtype,
                               tp/pp it was written for, every param's shape, axes and dtype, the quantization
                               scheme (quantized linears stay packed in their checkpoint layout, jaxllm/models/quant.py)
    config.json                the HF config, torch_dtype set to the written dtype
    tokenizer files, generation_config.json   copied as they are
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np

from jaxllm.models.checkpoint_files import MANIFEST
from jaxllm.models.loader import FORMAT, FORMAT_VERSION, ORBAX_SUBDIR

COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)


class ConversionError(ValueError):
    """A bad input to the converter; the message says which and what to do."""


def convert_checkpoint(
    model_dir: str,
    out_dir: str,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "auto",
    load_format: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
) -> str:
    import jax
    import jax.numpy as jnp

    import jaxllm
    from jaxllm.config import ModelConfig, read_hf_config, stored_dtype
    from jaxllm.models.checkpoint_files import CheckpointReader, is_jaxllm_checkpoint
    from jaxllm.models.loader import iter_host_weights
    from jaxllm.models.params import is_spec, param_specs
    from jaxllm.sharding import ParallelConfig

    model_dir, out_dir = os.path.abspath(os.path.expanduser(model_dir)), os.path.abspath(os.path.expanduser(out_dir))
    if not os.path.isdir(model_dir):
        raise ConversionError(f"--model {model_dir}: no such directory.")
    if is_jaxllm_checkpoint(model_dir):
        raise ConversionError(f"--model {model_dir} is already a jaxllm checkpoint (it has {MANIFEST}).")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ConversionError(f"--model {model_dir} has no config.json; point it at an HF model directory.")
    if os.path.commonpath([model_dir, out_dir]) == out_dir:
        raise ConversionError(
            f"--out {out_dir} is --model {model_dir} or contains it: writing there would delete "
            "the checkpoint being converted."
        )
    _check_out_dir(out_dir, overwrite)
    try:
        hf = read_hf_config(model_dir)
        keep_scales = dtype == "auto"  # quantization scales / zeros keep their own float dtype (GPTQ: float16)
        if dtype == "auto":  # storage keeps the checkpoint's dtype (vLLM's float32 -> bf16 rule is for running)
            dtype = stored_dtype(hf)
        cfg = ModelConfig.from_hf(hf, dtype=dtype)
        ParallelConfig(tp, pp).validate(cfg)
        reader = CheckpointReader(model_dir, load_format)
    except ValueError as e:
        raise ConversionError(str(e)) from None

    specs = param_specs(cfg)  # checkpoint layout: tp = 1 specs (kv heads as in the HF checkpoint)
    flat_specs = {_key(p): s for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]}
    devices = jax.devices("cpu")
    width = max(d for d in range(1, min(tp, len(devices)) + 1) if tp % d == 0)
    mesh = jax.sharding.Mesh(np.array(devices[:width]).reshape(1, width), ("pp", "tp"))
    np_dtype = np.dtype(_jnp_dtype(cfg.dtype))

    parent = os.path.dirname(out_dir)
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    except OSError as e:
        raise ConversionError(f"--out {out_dir}: cannot write in {parent} ({e.strerror}).") from None
    try:
        arrays, stored = {}, {}
        bar = _progress(len(flat_specs), progress, "Converting weights")
        try:
            for key, x in iter_host_weights(reader, cfg):
                host, spec = np.asarray(x), flat_specs[key]
                own = keep_scales and spec.relayout is not None and spec.relayout.field in ("scales", "zeros")
                if not (own and jnp.issubdtype(host.dtype, jnp.floating)):  # a bfloat16 copy of float16 scales
                    host = host.astype(spec.dtype or np_dtype)  # would round them: they stay as stored
                stored[key] = str(host.dtype)
                sharding = _chunk_sharding(mesh, flat_specs[key], width)
                arrays[key] = jax.make_array_from_callback(host.shape, sharding, lambda idx, h=host: h[idx])
                bar.update(1)
        except ValueError as e:  # missing / unused tensor, shape that does not fit the config: the loader's message
            raise ConversionError(f"{model_dir}: {e}") from None
        finally:
            bar.close()
        tree = jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_spec), [arrays[k] for k in flat_specs])
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, ORBAX_SUBDIR), tree)
            ckptr.wait_until_finished()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "jaxllm_version": jaxllm.__version__,
            "source": model_dir,
            "architecture": cfg.architecture,
            "dtype": cfg.dtype,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "params": {
                "/".join(map(str, k)): {
                    "shape": list(s.checkpoint_shape),
                    "axes": list(s.checkpoint_axes),
                    "dtype": stored[k],
                }
                for k, s in flat_specs.items()
            },
            # the scheme of the packed weights (jaxllm/models/quant.py); config.json keeps quantization_config
            "quantization": None if cfg.quantization is None else dataclasses.asdict(cfg.quantization),
        }
        hf = dict(hf, torch_dtype=cfg.dtype)
        if "dtype" in hf:  # transformers 5 writes "dtype"; both must name what the arrays hold
            hf["dtype"] = cfg.dtype
        _write_json(os.path.join(tmp, "config.json"), hf)
        # with the remote code config.json's / tokenizer_config.json's auto_map names (Baichuan's tokenizer)
        code = [n for n in sorted(os.listdir(model_dir)) if n.endswith(".py")]
        for name in (*COPIED_FILES, *code):
            src = os.path.join(model_dir, name)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(tmp, name))
        _write_json(os.path.join(tmp, MANIFEST), manifest)  # last: its presence marks a complete checkpoint
        if os.path.isdir(out_dir) and (overwrite or not os.listdir(out_dir)):
            shutil.rmtree(out_dir)  # an empty --out, or --overwrite: replaced only now, once the new one is whole
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ConversionError(f"--out {out_dir} exists and is not a directory.")
        if os.listdir(out_dir) and not overwrite:
            raise ConversionError(f"--out {out_dir} exists and is not empty; pass --overwrite to replace it.")
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise ConversionError(f"--out {out_dir}: the parent directory {parent} does not exist.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConversionError(f"--out {out_dir}: the directory {parent} is not writable.")


def _chunk_sharding(mesh, spec, width: int):
    """Shard over "tp" like serving will, except axes that do not split evenly (kv heads when tp > K)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxllm.sharding import LOGICAL_RULES

    axes = []
    for name, n in zip(spec.checkpoint_axes, spec.checkpoint_shape, strict=True):  # quantized: checkpoint layout
        mesh_axis = LOGICAL_RULES.get(name) if name else None
        axes.append("tp" if mesh_axis == "tp" and n % width == 0 and "tp" not in axes else None)
    return NamedSharding(mesh, PartitionSpec(*axes))


def _key(path) -> tuple:
    return tuple(p.key if hasattr(p, "key") else p.name if hasattr(p, "name") else p.idx for p in path)


def _jnp_dtype(name: str):
    import jax.numpy as jnp

    return jnp.dtype(name)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _progress(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="weight", disable=not enabled, dynamic_ncols=True)
