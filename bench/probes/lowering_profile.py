"""Finding: tracing the 19 steps of the 8B shape takes 11.5 s on the 2-core VM, 5.5 s of it the Pallas kernels'
Triton lowering; sharing lowered kernels between steps would save at most ~0.8 s (HISTORY stop 20).

Where a cold start's tracing goes, without a GPU: traces every step variant of an engine and lowers it for
CUDA (jax's cross-platform lowering) with the Pallas kernels on, under cProfile.

    python bench/probes/lowering_profile.py --num-layers 2 --out bench/results/cpu_vm_step_lowering_profile.json

The kernels' entry points pick the Pallas path when they see a GPU (kernels_pallas._common.on_gpu); here that
check is made to answer yes, so each step's jaxpr holds the same pallas_calls as on the H100 and their Triton
lowering runs on the CPU. The Mosaic GPU prefill kernel is left out (--hopper lowers it too where this jaxlib
can). A decoder layer is traced once per step (decoder._traced_once), so --num-layers 2 gives each step's
tracing cost at a fraction of the 32-layer model's weights. Compiling is not done: on the GPU host it runs in
threads beside the tracing (runner.warm_up). The JSON also counts the Triton lowerings by distinct kernel body:
what a cache of lowered kernels shared between steps could save.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import common  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--hopper", action="store_true", help="also take the Mosaic GPU prefill path")
    p.add_argument(
        "--quantization",
        choices=("gptq", "fp8"),
        default=None,
        help="dummy GPTQ int4 g128 (the quantized matmul kernel in every step) or fp8 weights",
    )
    p.add_argument("--top", type=int, default=25, help="functions kept from the profile")
    p.add_argument("--model-dir", default="/tmp/jaxllm_lowering_profile_model")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


@contextlib.contextmanager
def pretend_gpu(hopper: bool):
    """The kernels' GPU checks answer yes (on_hopper: `hopper`) inside the block."""
    import kernels_pallas
    from kernels_pallas import _common, _decode, _prefill_mgpu, quant

    saved = [
        (mod, name, getattr(mod, name))
        for mod in (_common, kernels_pallas, _decode, _prefill_mgpu, quant)
        for name in ("on_gpu", "on_hopper")
        if hasattr(mod, name)
    ]
    for mod, name, _ in saved:
        setattr(mod, name, (lambda: True) if name == "on_gpu" else (lambda: hopper))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextlib.contextmanager
def counting_kernel_bodies(counts: collections.Counter):
    """Counts the Triton lowerings by kernel body (its jaxpr's text) inside the block: how many a cache of
    lowered kernels shared between steps could save."""
    from jax._src.pallas.triton import lowering

    lower = lowering.lower_jaxpr_to_triton_module

    def counted(jaxpr, *a, **kw):
        counts[str(jaxpr)] += 1
        return lower(jaxpr, *a, **kw)

    lowering.lower_jaxpr_to_triton_module = counted
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = lower


def main(argv=None):
    args = parse(argv)
    bodies: collections.Counter = collections.Counter()
    with pretend_gpu(args.hopper), counting_kernel_bodies(bodies):
        result = _profile(args)
    result["triton_lowerings"] = dict(calls=sum(bodies.values()), distinct_kernel_bodies=len(bodies))
    print(f"Triton lowerings: {sum(bodies.values())}, distinct kernel bodies {len(bodies)}", flush=True)
    common.write_result("lowering_profile", result, args.out)
    return result


def _profile(args) -> dict:
    from jaxllm import LLM

    shape = dict(common.LLAMA3_8B, num_hidden_layers=args.num_layers, vocab_size=args.vocab_size)
    if args.quantization == "gptq":
        shape["quantization_config"] = common.DUMMY_QUANT_CONFIGS["gptq"]
    model = common.make_model_dir(shape, args.model_dir)
    llm = LLM(
        model,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        quantization=args.quantization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=True,
        compilation_cache_dir=None,
        num_gpu_blocks_override=512,
    )
    r = llm.llm_engine.runner
    r.attn = dataclasses.replace(r.attn, backend="pallas")
    rows, prof = [], cProfile.Profile()
    for v in r.programs.variants():
        step_args = r.programs.dummy_args(v, r.params, r.prev_tokens)
        t0 = time.perf_counter()
        prof.enable()
        traced = r.programs._jit.trace(*step_args, cfg=r.cfg, attn=r.attn, flags=v.flags, prompt_k=v.prompt_logprobs)
        t1 = time.perf_counter()
        traced.lower(lowering_platforms=("cuda",))
        prof.disable()
        rows.append(dict(variant=v.shape_name, trace_s=t1 - t0, lower_s=time.perf_counter() - t1))
    stats = pstats.Stats(prof)
    total = sum(x["trace_s"] + x["lower_s"] for x in rows)

    def cumulative(suffix):  # the profile's cumulative seconds and calls of functions ending in suffix
        hits = [(v[3], v[1]) for k, v in stats.stats.items() if f"{k[0]}:{k[2]}".endswith(suffix)]
        return dict(seconds=max((h[0] for h in hits), default=0.0), calls=max((h[1] for h in hits), default=0))

    parts = {
        name: cumulative(suffix)
        for name, suffix in [
            ("pallas_triton_lowering", "pallas/triton/pallas_call_registration.py:pallas_call_lowering"),
            ("pallas_kernel_tracing", "pallas/pallas_call.py:_trace_kernel_to_jaxpr"),
            ("model_trace", "jaxllm/engine/step_fns.py:packed_step_fn"),
            ("lower_to_module", "interpreters/mlir.py:lower_jaxpr_to_module"),
        ]
    }
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(args.top)
    result = dict(
        env=common.environment(),
        workload=vars(args),
        rows=rows,
        total_s=total,
        trace_s=sum(x["trace_s"] for x in rows),
        lower_s=sum(x["lower_s"] for x in rows),
        parts=parts,
        profile_top=text.getvalue().splitlines()[-args.top - 2 :],
    )
    print(
        f"{len(rows)} variants: trace {result['trace_s']:.1f} s + lower {result['lower_s']:.1f} s; "
        + ", ".join(f"{k} {p['seconds']:.1f} s ({p['calls']} calls)" for k, p in parts.items()),
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
