"""Multi-LoRA cost (issue 34): the same workloads on the base model without LoRA and on LoRA engines serving 1, 8
and 32 distinct rank-R adapters on every projection (q/k/v/o/gate/up/down), in one device command.

    python bench/lora.py --shape llama3-8b --load-format dummy --out $OUT/lora.json

Per configuration: batch-1 decode (ITL), batch-64 decode (output tok/s, ITL), each the median of --repeats runs
(one run moved by up to ~4% between calls), and offline throughput (prompts x input / output lengths, tokens/s). A
LoRA run assigns its requests round-robin to its adapters (one request in eight also to the base model, so base
and adapters share the batch). Engines: the base one (no --enable-lora), one with max_loras 8 (1 and 8 adapters)
and one with max_loras 32 (32 adapters); the LoRA matmuls read every slot each step (jaxllm/lora/ops.py), so their
cost follows max_loras. Each engine runs in a subprocess of its own (its device
memory is freed before the next). The adapters are PEFT-format folders of random weights (one folder per adapter
count group: identical values do not change the math's cost); each adapter id is read and placed on its own.
The goal (issue 34): at batch 64 with 8 adapters, <= 15% slower than the base model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402

# (engine name, max_loras or 0 for the base engine, adapter counts it runs)
ENGINES = (("base", 0, (0,)), ("lora8", 8, (1, 8)), ("lora32", 32, (32,)))
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=64, help="the batch of the batch-N decode run")
    p.add_argument("--decode-len", type=int, default=128, help="output tokens of the decode runs (32-token prompts)")
    p.add_argument("--num-prompts", type=int, default=256, help="offline throughput workload")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--engines", default=",".join(e[0] for e in ENGINES), help="which of base, lora8, lora32")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each decode workload (the median run is reported)"
    )
    p.add_argument("--max-loras-scale", type=int, default=1, help="divide max_loras / adapter counts (CPU smoke)")
    p.add_argument("--profile-dir", default=None, help="trace batch-N decode steps per engine and sum the trace up")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="override a module constant in the engine processes (A/B runs), e.g. jaxllm.lora.ops.SHRINK_SPLITS=16",
    )
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # child: one engine, JSON to --out
    return p.parse_args(argv)


def write_dummy_adapter(out_dir: str, cfg: dict, rank: int, seed: int) -> str:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, float16) for every projection."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    D, F = cfg["hidden_size"], cfg["intermediate_size"]
    H = D // cfg["num_attention_heads"]
    shapes = {
        "q_proj": (D, D),
        "k_proj": (D, cfg["num_key_value_heads"] * H),
        "v_proj": (D, cfg["num_key_value_heads"] * H),
        "o_proj": (D, D),
        "gate_proj": (D, F),
        "up_proj": (D, F),
        "down_proj": (F, D),
    }
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for m in MODULES:
            part = "self_attn" if m[0] in "qkvo" else "mlp"
            name = f"base_model.model.model.layers.{i}.{part}.{m}"
            fan_in, fan_out = shapes[m]
            a = rng.standard_normal((rank, fan_in)) / np.sqrt(fan_in)
            tensors[f"{name}.lora_A.weight"] = a.astype(np.float16)
            tensors[f"{name}.lora_B.weight"] = (0.01 * rng.standard_normal((fan_out, rank))).astype(np.float16)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(
            dict(
                peft_type="LORA",
                r=rank,
                lora_alpha=2 * rank,
                target_modules=list(MODULES),
                bias="none",
                base_model_name_or_path="dummy",
            ),
            f,
        )
    return out_dir


def _requests(n: int, n_adapters: int, adapter_dir: str):
    """Round-robin over the adapters (every eighth request the base model's) when n_adapters > 0."""
    from jaxllm.lora.request import LoRARequest

    if not n_adapters:
        return [None] * n
    return [
        None if i % 8 == 7 else LoRARequest(f"a{i % n_adapters}", 1 + i % n_adapters, adapter_dir) for i in range(n)
    ]


def _run(llm, prompts, loras, max_tokens: int) -> dict:
    from jaxllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=loras, use_tqdm=False)
    e2e = time.perf_counter() - t0
    itl = [
        (o.metrics.last_token_time - o.metrics.first_token_time) / max(len(o.outputs[0].token_ids) - 1, 1) for o in outs
    ]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(
        e2e_s=e2e,
        itl_p50_ms=1e3 * float(np.median(itl)),
        output_tok_per_s=n_out / e2e,
        total_tok_per_s=(n_out + sum(map(len, prompts))) / e2e,
    )


def _repeated(llm, prompts, loras, max_tokens: int, repeats: int) -> dict:
    """_run repeated: the run of median output tok/s, with every run's ITL and tok/s beside it."""
    runs = [_run(llm, prompts, loras, max_tokens) for _ in range(max(repeats, 1))]
    median = sorted(runs, key=lambda r: r["output_tok_per_s"])[len(runs) // 2]
    return dict(
        median,
        runs=len(runs),
        itl_p50_ms_runs=[r["itl_p50_ms"] for r in runs],
        output_tok_per_s_runs=[r["output_tok_per_s"] for r in runs],
    )


def _profile(llm, prompts, loras, log_dir: str) -> dict:
    """A traced batch decode (16 tokens each), summed up by bench/profile_summary.py: where LoRA's time goes."""
    import jax

    from bench.profile_summary import summarize
    from bench.throughput import _trace_options

    with jax.profiler.trace(log_dir, profiler_options=_trace_options()):
        _run(llm, prompts, loras, 16)
    return summarize(log_dir, top=25, sequence=120)


def _apply_overrides(settings) -> dict:
    """--set MODULE.NAME=VALUE: each module constant replaced by the literal VALUE before the engine is built."""
    import ast
    import importlib

    done = {}
    for item in settings:
        target, _, value = item.partition("=")
        module, _, name = target.rpartition(".")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise ValueError(f"--set {item}: {module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
        done[target] = getattr(mod, name)
    return done


def override_cache_dir(cache_dir: str, overrides: dict) -> str:
    """The compilation cache an engine with --set overrides uses: one of its own per override set under cache_dir
    (jaxllm's executable cache is keyed by the code's hash, not by constants set at run time, so an A/B's second
    engine would load the first one's programs); cache_dir itself without overrides, "" (none) stays none."""
    if not overrides or not cache_dir:
        return cache_dir
    tag = hashlib.sha256(repr(sorted(overrides.items())).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, f"set-{tag}")


def run_engine(args, name: str, max_loras: int, counts, adapter_dir: str) -> dict:
    from jaxllm import LLM

    overrides = _apply_overrides(args.set)
    args.compilation_cache_dir = override_cache_dir(args.compilation_cache_dir, overrides)

    model = common.resolve_model(args)
    kw = common.engine_kwargs(args, model)
    if max_loras:
        kw.update(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_loras, max_lora_rank=args.rank)
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    ready = time.perf_counter() - t0
    vocab = llm.llm_engine.vocab_size
    rows = []
    for n in counts:
        loras = _requests(max(args.num_prompts, args.batch), n, adapter_dir)
        t_load = time.perf_counter()
        for r in {r.lora_int_id: r for r in loras if r}.values():  # read and checked before the timed runs
            llm.llm_engine.add_lora(r)
        load_s = time.perf_counter() - t_load
        row = dict(engine=name, max_loras=max_loras, adapters=n, adapters_load_s=load_s)
        one = common.random_token_prompts(1, 32, vocab, 1)
        _run(llm, one, loras[:1], 8)  # warm: the adapters' first slot writes, the buckets' first runs
        row["batch1"] = _repeated(llm, one, loras[:1], args.decode_len, args.repeats)
        batch = common.random_token_prompts(args.batch, 32, vocab, 2)
        _run(llm, batch, loras[: args.batch], 8)
        row[f"batch{args.batch}"] = _repeated(llm, batch, loras[: args.batch], args.decode_len, args.repeats)
        if args.profile_dir:
            row["profile"] = _profile(llm, batch, loras[: args.batch], os.path.join(args.profile_dir, f"{name}_{n}"))
        prompts = common.random_token_prompts(args.num_prompts, args.input_len, vocab, 3)
        row["offline"] = _run(llm, prompts, loras[: args.num_prompts], args.output_len)
        row["slot_swaps"] = llm.llm_engine.lora.num_swaps if llm.llm_engine.lora else 0
        row["compiles_after_warmup"] = llm.llm_engine.runner.programs.num_compiles_after_warmup
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = common.engine_summary(llm)
    return dict(env=common.environment(), engine=summary, overrides=overrides, time_to_ready_s=ready, rows=rows)


def main(argv=None) -> dict:
    args = parse(argv)
    common.setup_logging(args.log_level)
    scale = args.max_loras_scale
    engines = [(n, m // scale, tuple(max(c // scale, 1) if c else 0 for c in cs)) for n, m, cs in ENGINES]
    if args.only:
        name, max_loras, counts = next(e for e in engines if e[0] == args.only)
        with open(os.path.join(os.path.dirname(args.out), "adapter_dir")) as f:
            adapter_dir = f.read()
        res = run_engine(args, name, max_loras, counts, adapter_dir)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return res
    model = common.resolve_model(args)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    work = tempfile.mkdtemp(prefix="jaxllm-lora-bench-")
    adapter_dir = write_dummy_adapter(os.path.join(work, "adapter"), cfg, args.rank, 0)
    with open(os.path.join(work, "adapter_dir"), "w") as f:
        f.write(adapter_dir)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--shape" in argv:  # the children use the folder made here (no second tokenizer build)
        i = argv.index("--shape")
        argv[i : i + 2] = ["--model", model]
    if "--out" in argv:
        i = argv.index("--out")
        del argv[i : i + 2]
    # This process never touches the device (jax would take its memory from the engines): the children report
    # the device and jax version.
    out = dict(
        env=common.environment(with_jax=False),
        rank=args.rank,
        batch=args.batch,
        decode_len=args.decode_len,
        offline=dict(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len),
        engines={},
        rows=[],
    )
    path = None
    for name, _, _ in engines:
        if name not in args.engines.split(","):
            continue
        part = os.path.join(work, f"{name}.json")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--only", name, "--out", part], check=True)
        with open(part) as f:
            res = json.load(f)
        out["env"].update({k: res["env"][k] for k in ("jax", "backend", "device", "num_devices")})
        out["engines"][name] = dict(
            engine=res["engine"],
            overrides=res["overrides"],
            time_to_ready_s=res["time_to_ready_s"],
            wall_s=time.perf_counter() - t0,
        )
        out["rows"] += res["rows"]
        _ratios(out["rows"], args.batch)
        path = common.write_result("lora", out, args.out if path is None else path)  # each engine's rows at once
    for r in out["rows"]:
        print(
            f"{r['engine']:>7} {r['adapters']:>2} adapters: batch-1 ITL {r['batch1']['itl_p50_ms']:.2f} ms, "
            f"batch-{args.batch} {r[f'batch{args.batch}']['output_tok_per_s']:.0f} tok/s, offline "
            f"{r['offline']['total_tok_per_s']:.0f} tok/s" + (f", vs base {r['vs_base']}" if "vs_base" in r else "")
        )
    return out


def _ratios(rows: list[dict], batch: int) -> None:
    """Each row's output tok/s over the base engine's (same call), when the base engine ran."""
    base = next((r for r in rows if r["engine"] == "base"), None)
    if base is None:
        return
    for r in rows:
        r["vs_base"] = {
            k: r[k]["output_tok_per_s"] / base[k]["output_tok_per_s"] for k in ("batch1", f"batch{batch}", "offline")
        }


if __name__ == "__main__":
    main()
