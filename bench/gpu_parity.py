"""The whole engine on the device against HF transformers on the same weights: greedy tokens and their
logprobs through the code paths that only run on a GPU (the Pallas prefill / fused decode / split-K kernels,
decode steps of 32+ sequences on cuBLAS GEMMs, the cuda_async allocator), with chunked prefill, prefix
caching, preemption and an fp8 KV cache.

    python bench/gpu_parity.py --out bench/results/gpu_parity_h100_<commit>.json

Quantized weights (issue 28): "gptq_int4" loads the checkpoint written as GPTQ v1 int4 (group 128) and "fp8"
quantizes it to fp8 while loading; each is checked against HF on the weights it holds, dequantized (fp8: with
the decoder linears' inputs rounded per token to fp8 too, as the engine's W8A8 path does). On a GPU they run the
fast paths (issue 29: the Pallas int4 GEMM for decode steps of <= 64 tokens, dequantize + GEMM above; XLA's fp8
dot; the Pallas fp8 GEMV for decode steps of 1-2 tokens): quant_kernel_traces counts the step programs' calls of
them (0 on the CPU's reference path).
the decoder linears' inputs rounded per token to fp8 too, as the engine's W8A8 path does). That reference holds
the engine's own weights, so the engine must also match it as closely as HF's bf16 run on them does: mean
logprob error at most --lp-err-ratio times HF bf16's. A dequantization bug (a zero point off by one) shows
there even where random-weight logits are too flat for any gap to reach --gap-tol (the tiny CPU check: 25x
HF's error, every gap under 0.02).

A random Llama checkpoint with Llama-3-8B's widths (32 q / 8 kv heads of 128, MLP 14336) and --num-layers
layers is saved as bf16 safetensors. Each configuration builds LLM(...) on it and generates greedy tokens
with their logprobs. HF transformers then scores every generated sequence teacher-forced, in float32 with
TF32 off (the reference) and in bfloat16 (the baseline: what HF's own 16-bit run does against the same
reference). Per generated position:
  gap    = reference max logprob - reference logprob of the engine's token (0 where the tokens agree),
  lp_err = |engine logprob - reference logprob| of that token.
A configuration passes when no position's gap exceeds its tolerance (--gap-tol, --gap-tol-fp8, --gap-tol-f32):
the engine may pick another token only where the reference itself nearly ties, and a wrong page, slot or
position makes gaps of whole nats. Random-weight logits tie often, so exact-token agreement is reported beside
it, with HF's own bf16 agreement as the baseline.

fp8 KV pages store every key and value rounded to float8 (scale 1, clipped to the format's range), a loss of
its own: for those configurations the reference and the baseline are the same HF models with their keys and
values rounded alike (attention implementation "jaxllm_fp8_kv"), and the gaps against the plain float32
reference are reported beside them as what the fp8 pages cost. 16-bit compute next to fp8 rounding still
moves some keys and values across a rounding boundary (an fp8 step is 2^-3 relative, bf16's 2^-8), which
HF's own bf16 run shows as well (H100, 8B widths: gap max 0.30 against the rounded reference, the engine
0.23; gpu_parity_h100_9da7efd_fp8.json), hence --gap-tol-fp8.

The fp8 (W8A8) configuration rounds every linear's input per token to fp8 as well: an input that bf16 compute
moves across an fp8 rounding boundary (a step of 2^-3 relative) changes the product by far more than bf16
rounding does, so HF's own bf16 run of the same rounded math lands far from the float32 reference (H200, 8B
widths: gap max 0.50, tokens equal 0.73; gpu_parity_quant_h200_3eb41d6_fp8_abs_tol.json). There the gap
tolerance is the larger of --gap-tol and --gap-ratio-act times HF bf16's own gap max, with the mean logprob
error within --lp-err-ratio of HF bf16's: a wrong scale or layout gives errors of whole nats at most positions.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    SHAPES,
    engine_summary,
    environment,
    random_token_prompts,
    setup_logging,
    write_result,
    write_token_id_tokenizer,
)

# name -> (LLM kwargs, what it exercises); each also has "dtype" and gets the shared ones in run_config.
CONFIGS = {
    "batch": (
        dict(dtype="bfloat16"),
        "64 prompts of 16-600 tokens and 4 of 1,500-3,000 (chunked at "
        "512 tokens a step), then 3 long ones alone (small decode buckets, split-K decode)",
    ),
    "prefix_cache": (
        dict(dtype="bfloat16", enable_prefix_caching=True),
        "16 prompts sharing a 800-token prefix, generated twice (the second time from the cache)",
    ),
    "preemption": (
        dict(dtype="bfloat16"),
        "64 prompts of 100-400 tokens with KV blocks for a third of their tokens: sequences preempted",
    ),
    "fp8_kv": (dict(dtype="bfloat16", kv_cache_dtype="fp8"), "16 prompts, fp8 (e4m3) KV pages"),
    "float32": (dict(dtype="float32"), "16 prompts, float32 weights and KV"),
    "gptq_int4": (
        dict(dtype="bfloat16"),
        "16 prompts, the checkpoint as GPTQ v1 int4 (group 128, sym; round to "
        "nearest), against HF on its dequantized weights",
    ),
    "fp8": (
        dict(dtype="bfloat16", quantization="fp8"),
        "16 prompts, quantization='fp8' (per-tensor fp8 weights, "
        "per-token fp8 activations), against HF on the fp8-rounded weights with its linears' inputs rounded alike",
    ),
}
QUANTIZED = ("gptq_int4", "fp8")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", choices=sorted(SHAPES), default="llama3-8b", help="hidden / heads / MLP widths")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--scale", type=float, default=1.0, help="prompt counts and lengths times this (CPU checks)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--gap-tol", type=float, default=0.1, help="16-bit weights and KV (nats)")
    p.add_argument("--gap-tol-fp8", type=float, default=0.5, help="fp8 KV pages, against the rounded reference")
    p.add_argument("--gap-tol-f32", type=float, default=0.02, help="the Pallas kernels' f32 dots may use TF32")
    p.add_argument(
        "--lp-err-ratio",
        type=float,
        default=2.0,
        help="quantized configurations: mean logprob error against HF bf16's on the same weights",
    )
    p.add_argument(
        "--gap-ratio-act",
        type=float,
        default=1.25,
        help="fp8 (activations rounded to fp8): gap max at most this times HF bf16's own",
    )
    p.add_argument("--gptq-group-size", type=int, default=128, help="gptq_int4's group (the tiny CPU check: 32)")
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run each configuration's workloads this many times on one LLM, waiting for background compiles in "
        "between (e.g. long-context decode programs, whole programs for logprobs); the last pass is checked",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--model-dir", default="/tmp/jaxllm_gpu_parity_model")
    p.add_argument("--compilation-cache-dir", default="", help="empty: none (every configuration compiles)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def make_checkpoint(args) -> str:
    """A random Llama (HF's init, norms perturbed so they matter) saved as bf16 safetensors + a token-id tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = SHAPES[args.widths]
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
    )
    cfg = LlamaConfig(
        **{k: shape[k] for k in keys},
        vocab_size=args.vocab_size,
        num_hidden_layers=args.num_layers,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(args.model_dir)
    write_token_id_tokenizer(args.model_dir, args.vocab_size, 1, 2)
    return args.model_dir


def workloads(name: str, vocab: int, scale: float, seed: int) -> list[list[list[int]]]:
    """The prompt lists one configuration generates, in order (each list is one generate() call)."""
    n = lambda x: max(1, int(round(x * scale)))  # noqa: E731
    rng = np.random.default_rng(seed)
    if name == "batch":
        lens = rng.integers(16, n(600) + 1, n(64)).tolist() + rng.integers(n(1500), n(3000) + 1, 4).tolist()
        return [
            random_token_prompts(len(lens), 0, vocab, seed=seed + 1, lens=lens),
            random_token_prompts(3, 0, vocab, seed=seed + 2, lens=[n(3000), n(1500), 40]),
        ]
    if name == "prefix_cache":
        prefix = random_token_prompts(1, n(800), vocab, seed=seed + 3)[0]
        tails = random_token_prompts(n(16), 0, vocab, seed=seed + 4, lens=rng.integers(1, n(200) + 1, n(16)))
        prompts = [prefix + t for t in tails]
        return [prompts, prompts]
    if name == "preemption":
        return [random_token_prompts(n(64), 0, vocab, seed=seed + 5, lens=rng.integers(n(100), n(400) + 1, n(64)))]
    batch = [random_token_prompts(n(16), 0, vocab, seed=seed + 6, lens=rng.integers(16, n(600) + 1, n(16)))]
    if name in QUANTIZED:  # and one prompt alone: every decode step in the smallest bucket (1 row for int weights)
        batch.append(random_token_prompts(1, 0, vocab, seed=seed + 7, lens=[n(300)]))
    return batch


def run_config(args, model_dir: str, name: str) -> dict:
    """Builds the configuration's LLM, runs its workloads; returns the sequences, logprobs and engine facts."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.engine import programs

    kw, what = CONFIGS[name]
    kw = (
        dict(
            max_model_len=4096,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            gpu_memory_utilization=0.5,
            num_gpu_blocks_override=4096,
            enforce_eager=args.enforce_eager,
            seed=args.seed,
            compilation_cache_dir=args.compilation_cache_dir or None,
        )
        | kw
    )
    batches = workloads(name, args.vocab_size, args.scale, args.seed)
    if name == "preemption":  # a third of the blocks the sequences need (at least one whole max_model_len)
        need = sum(-(-(len(p) + args.output_len) // 16) for p in batches[0])
        kw["max_model_len"] = max(128, int(1024 * args.scale))
        kw["num_gpu_blocks_override"] = max(need // 3, kw["max_model_len"] // 16 + 1)
    if name == "gptq_int4":
        model_dir = write_gptq(model_dir, args.gptq_group_size)[0]
    t0 = time.perf_counter()
    traces: dict[str, int] = {}
    with counting_quant_kernels(traces):  # while the step programs are traced (LLM() and any later compile)
        llm = LLM(model_dir, **kw)
        ready = time.perf_counter() - t0
        runner = llm.llm_engine.runner
        steps: dict[str, int] = {}
        run_step = runner.run_step

        def counting_run_step(v, mode, *a, **k):  # which step programs ran (a long-context decode step's start-up
            # program while its own compiles), and which of them compile with cuBLAS GEMMs
            key = v.shape_name + ("_split" if mode == "split" else "")
            if programs.compile_options(v).get("xla_gpu_enable_triton_gemm") is False:
                key += "_cublas"
            steps[key] = steps.get(key, 0) + 1
            return run_step(v, mode, *a, **k)

        runner.run_step = counting_run_step
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, logprobs=1)
        for _ in range(args.passes - 1):  # earlier passes: their programs compile meanwhile
            for prompts in batches:
                llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            runner.programs.wait_for_background_compiles()
        steps.clear()
        before = llm.llm_engine.stats()  # totals since start: the checked pass's are the difference
        seqs = []
        for prompts in batches:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            for p, o in zip(prompts, outs, strict=True):
                c = o.outputs[0]
                seqs.append(
                    dict(
                        prompt=p,
                        tokens=list(c.token_ids),
                        logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)],
                    )
                )
    st = llm.llm_engine.stats()
    facts = dict(
        what=what,
        llm_kwargs=kw,
        ready_s=ready,
        engine=engine_summary(llm),
        steps=steps,
        quant_kernel_traces=traces,
        passes=args.passes,
        preemptions=st.num_preemptions - before.num_preemptions,
        prefix_cache_hit_tokens=st.prefix_cache_hits - before.prefix_cache_hits,
        kv_cache_dtype=str(runner.kv_values_dtype),
    )
    del llm, runner
    gc.collect()
    return dict(facts=facts, seqs=seqs)


@contextlib.contextmanager
def counting_quant_kernels(counts: dict):
    """Counts traces of the quantized GEMMs' fast paths inside the block (the Pallas int4 / int8 kernel, XLA's fp8
    dot, the Pallas fp8 GEMV of 1-2 rows, the Mosaic GPU int4 kernel): on a GPU a quantized configuration's step programs hold them ("pallas"
    backend), on the CPU none do."""
    from jaxllm.models import quant_matmul
    from kernels_pallas import _fp8_gemv, _qmatmul, _qmatmul_mgpu

    saved = [
        (_qmatmul, "qmatmul_kernel", _qmatmul.qmatmul_kernel),
        (_qmatmul_mgpu, "qmatmul_mgpu", _qmatmul_mgpu.qmatmul_mgpu),  # int4 weights in the nk layout (sm_90's default)
        (_qmatmul_mgpu, "qmatmul_mgpu_wide", _qmatmul_mgpu.qmatmul_mgpu_wide),  # ... of 129-1024 rows (NK_WIDE)
        (quant_matmul, "fp8_matmul", quant_matmul.fp8_matmul),
        (_fp8_gemv, "fp8_gemv_kernel", _fp8_gemv.fp8_gemv_kernel),
    ]
    for mod, name, fn in saved:

        def counted(*a, _fn=fn, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*a, **k)

        setattr(mod, name, counted)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def write_gptq(model_dir: str, group: int = 128) -> tuple[str, str]:
    """(GPTQ v1 int4 folder, dense folder of its dequantized weights) of model_dir's linears: symmetric round to
    nearest per group of input rows, packed as GPTQ's qweight / qzeros / scales / g_idx (written once)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    qdir, ddir = model_dir + "_gptq_int4", model_dir + "_gptq_int4_dequantized"
    if os.path.isfile(os.path.join(ddir, "model.safetensors")):
        return qdir, ddir
    state = {k: v.float() for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    qstate, dense = {}, {}
    for name, w in state.items():
        if not (name.endswith("_proj.weight") and ".layers." in name):
            qstate[name] = dense[name] = w.to(torch.bfloat16)
            continue
        out, inp = w.shape
        g = w.T.reshape(inp // group, group, out)  # [groups, rows, out]
        scale = (g.abs().amax(1) / 7.5).clamp(min=1e-8).to(torch.float16).float()  # [groups, out]
        q = torch.clamp(torch.round(g / scale[:, None]) + 8, 0, 15).to(torch.int64)  # zero 8
        dense[name] = ((q - 8) * scale[:, None]).reshape(inp, out).T.contiguous().to(torch.bfloat16)
        rows = q.reshape(inp // 8, 8, out)  # 8 input rows per int32 word, least significant first
        word = sum(rows[:, j] << (4 * j) for j in range(8))
        prefix = name[: -len(".weight")]
        qstate[prefix + ".qweight"] = (word - (word >> 31 << 32)).to(torch.int32)  # two's complement
        zeros = torch.full((inp // group, out // 8), 0x77777777, dtype=torch.int64)  # v1 stores zero - 1 = 7
        qstate[prefix + ".qzeros"] = (zeros - (zeros >> 31 << 32)).to(torch.int32)
        qstate[prefix + ".scales"] = scale.to(torch.float16)
        qstate[prefix + ".g_idx"] = (torch.arange(inp) // group).to(torch.int32)
    for folder, tensors, extra in ((qdir, qstate, True), (ddir, dense, False)):
        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
        for f in os.listdir(model_dir):
            if f.endswith(".json") and f not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(os.path.join(model_dir, f), folder)
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        if extra:
            cfg["quantization_config"] = dict(
                quant_method="gptq", bits=4, group_size=group, sym=True, desc_act=False, checkpoint_format="gptq"
            )
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
    return qdir, ddir


def write_fp8_reference(model_dir: str) -> str:
    """A dense folder of model_dir's linears rounded as quantization='fp8' stores them (per tensor)."""
    import torch
    from safetensors.torch import load_file, save_file

    out = model_dir + "_fp8_rounded"
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    for name, w in state.items():
        if name.endswith("_proj.weight") and ".layers." in name:
            s = w.float().abs().max().clamp(min=1e-12) / 448.0
            state[name] = ((w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(w.dtype)
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, os.path.join(out, "model.safetensors"))
    return out


def round_linear_inputs_to_fp8(model) -> None:
    """HF's linears of the decoder layers see their input rounded per token to fp8 e4m3, as the engine's
    dynamic-activation fp8 reference (jaxllm/models/quant.py quantize_activations) rounds it."""
    import torch

    def hook(module, args):
        x = args[0]
        s = (x.float().abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
        return (((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype),)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and ".layers." in name:
            m.register_forward_pre_hook(hook)


def teacher_forced(model, seqs, device) -> list[np.ndarray]:
    """Per sequence, the model's logprobs [generated positions, V] (float32) with the engine's tokens as the
    prefix."""
    import torch

    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([(s["prompt"] + s["tokens"])[:-1]], device=device)
            logits = model(ids, logits_to_keep=len(s["tokens"])).logits[0].float()
            out.append(torch.log_softmax(logits, -1).cpu().numpy())
    return out


FP8_KV_ATTENTION = "jaxllm_fp8_kv"


def fp8_format(kv_cache_dtype: str) -> str | None:
    """kv_cache_dtype (the pages' dtype name) when it is a float8 format, else None."""
    import jax.numpy as jnp

    from kernels_pallas.reference import FP8_MAX

    return kv_cache_dtype if jnp.dtype(kv_cache_dtype) in FP8_MAX else None


def fp8_kv_attention(module, query, key, value, attention_mask, **kw):
    """HF's SDPA attention over keys and values rounded as the engine's fp8 pages store them (the
    kv_cache_dtype's float8 format, scale 1, clipped to its range)."""
    import jax.numpy as jnp
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kernels_pallas.reference import FP8_MAX

    fmt = module.config.jaxllm_fp8_format
    limit = FP8_MAX[jnp.dtype(fmt)]

    def stored(x):
        return x.float().clamp(-limit, limit).to(getattr(torch, fmt)).to(x.dtype)

    return sdpa_attention_forward(module, query, stored(key), stored(value), attention_mask, **kw)


def hf_models(model_dir: str, device: str, fp8_format: str | None = None):
    """(reference: float32, baseline: bfloat16) HF models of model_dir; with fp8_format, their attention reads
    keys and values rounded to it (fp8_kv_attention)."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    kw = {}
    if fp8_format:
        AttentionInterface.register(FP8_KV_ATTENTION, fp8_kv_attention)
        kw = dict(attn_implementation=FP8_KV_ATTENTION)
    models = []
    for dtype in (torch.float32, torch.bfloat16):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw).to(device).eval()
        m.config.jaxllm_fp8_format = fp8_format
        models.append(m)
    return models


def compare(
    seqs, ref, base=None, tol: float = 0.1, lp_err_ratio: float | None = None, gap_ratio: float | None = None
) -> dict:
    """The engine's tokens and logprobs against the reference's logprobs (ref: teacher_forced), and a baseline
    model's (base) own argmax and logprobs against the same reference; lp_err_ratio: the engine's mean logprob
    error must also be at most that times the baseline's; gap_ratio: the gap tolerance is at least that times
    the baseline's gap max."""
    rows = [np.arange(len(s["tokens"])) for s in seqs]
    tokens = [np.asarray(s["tokens"]) for s in seqs]
    gaps = np.concatenate([r.max(-1) - r[i, t] for r, i, t in zip(ref, rows, tokens, strict=True)])
    lp_err = np.concatenate(
        [np.abs(np.asarray(s["logprobs"]) - r[i, t]) for s, r, i, t in zip(seqs, ref, rows, tokens, strict=True)]
    )
    equal = [t == r.argmax(-1) for r, t in zip(ref, tokens, strict=True)]
    res = dict(
        positions=int(len(gaps)),
        tokens_equal_frac=float(np.concatenate(equal).mean()),
        sequences=len(seqs),
        sequences_all_equal=sum(bool(e.all()) for e in equal),
        gap_max=float(gaps.max()),
        gap_p99=float(np.percentile(gaps, 99)),
        gap_tol=tol,
        positions_over_tol=int((gaps > tol).sum()),
        lp_err_max=float(lp_err.max()),
        lp_err_mean=float(lp_err.mean()),
        passed=bool(gaps.max() <= tol),
    )
    if base is not None:
        bgap = np.concatenate([r.max(-1) - r[i, b.argmax(-1)] for r, b, i in zip(ref, base, rows, strict=True)])
        berr = np.concatenate([np.abs(b[i, t] - r[i, t]) for r, b, i, t in zip(ref, base, rows, tokens, strict=True)])
        bequal = np.concatenate([b.argmax(-1) == r.argmax(-1) for r, b in zip(ref, base, strict=True)])
        res["hf_baseline"] = dict(
            tokens_equal_frac=float(bequal.mean()),
            gap_max=float(bgap.max()),
            lp_err_max=float(berr.max()),
            lp_err_mean=float(berr.mean()),
        )
        if gap_ratio is not None:
            res["gap_tol"] = tol = max(tol, gap_ratio * float(bgap.max()))
            res["positions_over_tol"] = int((gaps > tol).sum())
            res["passed"] = bool(gaps.max() <= tol)
        if lp_err_ratio is not None:
            res["lp_err_ratio_tol"] = lp_err_ratio
            res["passed"] = res["passed"] and res["lp_err_mean"] <= lp_err_ratio * float(berr.mean())
    return res


def main(argv=None):
    args = parse(argv)
    setup_logging(args.log_level)
    import torch

    model_dir = make_checkpoint(args)
    result = dict(env=environment(), workload=vars(args) | {"model": model_dir}, configs={})
    runs = {name: run_config(args, model_dir, name) for name in args.configs}

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    ref_model, base_model = hf_models(model_dir, device)
    for name, run in runs.items():
        if name in QUANTIZED:  # HF on the weights the engine holds, dequantized (and fp8's rounded inputs)
            ref_dir = (
                write_gptq(model_dir, args.gptq_group_size)[1]
                if name == "gptq_int4"
                else write_fp8_reference(model_dir)
            )
            qref, qbase = hf_models(ref_dir, device)
            if name == "fp8":
                round_linear_inputs_to_fp8(qref), round_linear_inputs_to_fp8(qbase)
            ref, base = teacher_forced(qref, run["seqs"], device), teacher_forced(qbase, run["seqs"], device)
            del qref, qbase
        else:
            ref = teacher_forced(ref_model, run["seqs"], device)
            base = teacher_forced(base_model, run["seqs"], device)
        fp8 = fp8_format(run["facts"]["kv_cache_dtype"])
        tol = (
            args.gap_tol_fp8
            if fp8
            else (args.gap_tol_f32 if run["facts"]["llm_kwargs"]["dtype"] == "float32" else args.gap_tol)
        )
        if fp8:  # the fp8 pages' own loss, against the plain reference; the check is against rounded K/V
            cost = compare(run["seqs"], ref, base, tol)
            fp8_ref, fp8_base = hf_models(model_dir, device, fp8)
            ref = teacher_forced(fp8_ref, run["seqs"], device)
            base = teacher_forced(fp8_base, run["seqs"], device)
            del fp8_ref, fp8_base
        gap_ratio = args.gap_ratio_act if name == "fp8" else None  # rounded activations: module docstring
        res = compare(run["seqs"], ref, base, tol, args.lp_err_ratio if name in QUANTIZED else None, gap_ratio)
        tol = res["gap_tol"]
        if fp8:
            res["against_plain_reference"] = {
                k: cost[k] for k in ("tokens_equal_frac", "gap_max", "gap_p99", "lp_err_max", "lp_err_mean")
            }
        result["configs"][name] = run["facts"] | dict(parity=res)
        hb = res["hf_baseline"]
        print(
            f"{name}: {'PASS' if res['passed'] else 'FAIL'} {res['positions']} positions, tokens equal "
            f"{res['tokens_equal_frac']:.3f} (HF bf16 {hb['tokens_equal_frac']:.3f}), gap max {res['gap_max']:.4f} "
            f"(tol {tol}; HF bf16 {hb['gap_max']:.4f}), logprob err max {res['lp_err_max']:.4f} / mean "
            f"{res['lp_err_mean']:.5f} (HF bf16 {hb['lp_err_max']:.4f} / {hb['lp_err_mean']:.5f}), preemptions "
            f"{run['facts']['preemptions']}, prefix hits {run['facts']['prefix_cache_hit_tokens']}, steps "
            f"{run['facts']['steps']}"
            + (f", quantized GEMM kernels traced {run['facts']['quant_kernel_traces']}" if name in QUANTIZED else "")
            + (
                f"; against the plain float32 reference (what fp8 pages cost): tokens "
                f"equal {cost['tokens_equal_frac']:.3f}, gap max {cost['gap_max']:.4f}"
                if fp8
                else ""
            ),
            flush=True,
        )
    result["hf_scoring_s"] = time.perf_counter() - t0
    result["passed"] = all(c["parity"]["passed"] for c in result["configs"].values())
    write_result("gpu_parity", result, args.out)
    return result


if __name__ == "__main__":
    main()
