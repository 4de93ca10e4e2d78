"""A decode step of the 8B shape compiled for an H100 (sm_90a) without a GPU: the decoder's forward and logits on the
"pallas" backend for a batch-1 bucket (2 token rows), its weights abstract (param_specs' shapes, dummy quantization
config), compiled by XLA's GPU compiler for a compile-only CUDA device (bench/probes/deviceless_compile.py's setup
and target config). Reports the kernels XLA's thunk sequence launches, in order, for one middle layer: what a
GPU trace's layer sequence would list, without the times. The A/B switches are read from the environment as the
engine reads them (JAXLLM_FP8_ADD_NORM_E4M3=1 ...).

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/cudavenv/bin/python bench/probes/deviceless_step.py --quantization fp8 \\
        [--layers 3] [--out /tmp/step.json]

on_gpu() is patched to True while tracing (the kernels' GPU paths); on_hopper() stays False, so attention takes its
Triton kernels (the Mosaic GPU ones compile on the device). Indicative only: jax 0.10.2's XLA, and the kernels
found by name in the thunk sequence XLA dumps.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import environment, write_result  # noqa: E402
from bench.probes.deviceless_compile import device  # noqa: E402

SCRIPT = "deviceless_step"


def abstract_params(cfg, sharding):
    """param_specs' tree as ShapeDtypeStructs on the compile-only device."""
    import jax

    from jaxllm.models.params import ParamSpec, param_specs

    def leaf(s):
        return jax.ShapeDtypeStruct(s.shape, s.dtype or cfg.dtype, sharding=sharding)

    return jax.tree.map(leaf, param_specs(cfg, 1), is_leaf=lambda x: isinstance(x, ParamSpec))


def step_kernels(dump_dir):
    """The kernel names of the thunk sequence XLA dumped, in launch order (its lines: "NNN: kCustomKernel [links] NAME
    grid: ...")."""
    paths = sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")), key=os.path.getsize)
    if not paths:
        return []
    return re.findall(r"^\d+: k\w*Kernel \[[^\]]*\] (\S+)", open(paths[-1]).read(), flags=re.M)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="fp8", help="bench/common.py's dummy configs: fp8, gptq, awq, or none")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--rows", type=int, default=2, help="token rows of the decode bucket (batch 1: 2)")
    p.add_argument("--keep", default=None, help="keep XLA's dump in this folder")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    import kernels_pallas
    from bench.common import DUMMY_QUANT_CONFIGS, LLAMA3_8B
    from jaxllm.config import ModelConfig
    from jaxllm.models import quant_matmul
    from jaxllm.models.attention import AttentionConfig, AttentionMetadata
    from jaxllm.models.decoder import compute_logits, forward
    from kernels_pallas import _common, quant

    for mod in (_common, quant, quant_matmul, kernels_pallas):
        mod.on_gpu = lambda: True
    hf = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    q = None if args.quantization == "none" else args.quantization
    if q in DUMMY_QUANT_CONFIGS:
        hf["quantization_config"] = DUMMY_QUANT_CONFIGS[q]
        q = None
    cfg = ModelConfig.from_hf(hf, dtype="bfloat16", quantization=q)
    sh = SingleDeviceSharding(device())
    params = abstract_params(cfg, sh)
    T, B, pages, page = args.rows, args.rows, 64, 16  # a 1024-token table of 16-token pages
    s = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    kv = [(s((cfg.num_kv_heads, 512, page, cfg.head_dim), jnp.bfloat16),) * 2 for _ in range(cfg.num_layers)]
    attn = AttentionConfig(backend="pallas", interpret=False)

    def step(params, kv, token_ids, positions, slots, seq_lens, qsl, tables):
        meta = AttentionMetadata(positions, slots, seq_lens, qsl, tables, True)
        kv, hidden = forward(params, kv, token_ids, meta, cfg, attn)
        return kv, compute_logits(params, hidden, cfg)

    dump = args.keep or tempfile.mkdtemp(prefix="deviceless_step_")
    res: dict = dict(jax=jax.__version__, quantization=args.quantization, layers=args.layers, rows=T)
    res["env"] = dict(environment(with_jax=False), device="compile-only sm_90a (H100 target config), no GPU")
    res["switches"] = {k: v for k, v in os.environ.items() if k.startswith("JAXLLM_")}
    try:
        lowered = (
            jax.jit(step, donate_argnums=1)
            .trace(params, kv, s((T,)), s((T,)), s((T,)), s((B,)), s((B + 1,)), s((B, pages)))
            .lower(lowering_platforms=("cuda",))
        )
        lowered.compile(compiler_options={"xla_dump_to": dump})
        kernels = step_kernels(dump)
        res.update(ok=True, kernels=kernels, num_kernels=len(kernels))
        res["layer"] = middle_layer(kernels, args.layers)
    except Exception as e:  # noqa: BLE001 - a step that does not compile is this probe's finding
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:3000]}")
    finally:
        if not args.keep:
            shutil.rmtree(dump, ignore_errors=True)
    print(json.dumps({k: v for k, v in res.items() if k != "kernels"}, indent=1))
    if args.out:
        write_result(SCRIPT, res, args.out)
    return res


def middle_layer(kernels, layers):
    """The kernels of one middle layer: the step's sequence between two consecutive launches of the layer's first
    attention kernel (paged decode), rotated to start after it; None if the sequence has no such repeat."""
    starts = [i for i, k in enumerate(kernels) if k.startswith("paged_decode") and "combine" not in k]
    if len(starts) < 3:
        return None
    return kernels[starts[1] : starts[2]]


if __name__ == "__main__":
    main()
