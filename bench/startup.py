"""Time to ready, cold and warm, and where it goes (issue 7).

  python bench/startup.py --shape tiny --num-layers 32 --max-num-seqs 64 --max-num-batched-tokens 512 \\
      --max-model-len 1024 --warm-runs 2 --phases
  python bench/startup.py --shape llama3-8b --load-format dummy --dtype bfloat16 --max-model-len 1024 \\
      --max-num-seqs 512 --max-num-batched-tokens 8192 --warm-runs 2

Each start is a fresh process that builds LLM(...) (as bench/throughput.py does) with one compilation cache
directory: the first start finds it empty (cold), the next ones find it filled (warm: JAX's compilation cache
and jaxllm's executable cache). A start reports LLM() time and its parts: weights, KV allocation, warm_up
(trace/lower/compile or load), the rest (transformers import, tokenizer, config), the step traces it ran and
the executable cache's counters; after it, each start generates greedy tokens (untimed), and a warm start's
must equal the cold start's. --phases adds one in-process pass that traces, lowers and compiles every
bucket one at a time (no caches) for a per-bucket breakdown. --code-dir runs the starts against another
checkout (e.g. `git archive` of a base commit), so a before/after pair is measured in one run.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--num-layers", type=int, default=None, help="override num_hidden_layers of --shape")
    p.add_argument("--warm-runs", type=int, default=2)
    p.add_argument("--phases", action="store_true", help="also a per-bucket trace/lower/compile breakdown")
    p.add_argument(
        "--code-dir",
        action="append",
        default=None,
        help="run the starts against this checkout (repeatable: one cold + warm series each)",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> dict:
    """One start in this process: LLM() with its parts timed."""
    t_import = time.perf_counter()
    import jax

    from jaxllm import LLM
    from jaxllm.engine import runner as runner_mod
    from jaxllm.engine import step_fns

    parts: dict = {"import_s": time.perf_counter() - t_import}  # jax, jaxllm (transformers: inside LLM())
    import jaxllm
    import jaxllm.models.loader as loader

    common.time_calls(loader, "load_params", parts, "weights_s")
    from jaxllm.engine import setup

    common.time_calls(setup, "build_engine_parts", parts, "engine_parts_s")
    common.time_calls(runner_mod.ModelRunner, "_allocate_kv", parts, "kv_alloc_s")
    common.time_calls(runner_mod.ModelRunner, "warm_up", parts, "warm_up_s")
    traces = {"n": 0}
    orig_forward = step_fns.forward

    def counting_forward(*a, **k):  # called once per trace of the step function
        traces["n"] += 1
        return orig_forward(*a, **k)

    step_fns.forward = counting_forward
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("jaxllm").addHandler(Keep(logging.INFO))
    logging.getLogger("jaxllm").setLevel(logging.INFO)
    t0 = time.perf_counter()
    llm = LLM(args.model, **common.engine_kwargs(args, args.model))
    parts["llm_init_s"] = time.perf_counter() - t0
    # The rest: imports (transformers, torch), config, mesh, tokenizer, generation config, scheduler.
    parts["other_s"] = parts["llm_init_s"] - sum(parts.get(k, 0.0) for k in ("weights_s", "kv_alloc_s", "warm_up_s"))
    # Greedy tokens after LLM() (not timed): a warm start (loaded executables) must give the cold start's.
    from jaxllm import SamplingParams

    prompts = common.random_token_prompts(2, 16, llm.llm_engine.vocab_size, seed=0)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    parts["greedy_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    r = llm.llm_engine.runner
    cache = r.programs.exec_cache
    counters = ("hits", "misses", "errors", "stores", "from_jax_cache")
    parts.update(
        step_traces=traces["n"],
        code=os.path.dirname(os.path.dirname(jaxllm.__file__)),
        num_variants=len(r.programs.compiled),
        jax=jax.__version__,
        exec_cache=None if cache is None else {k: getattr(cache, k) for k in counters},
        log=[m for m in messages if "variants" in m or "weights" in m],
    )
    return parts


def phases(args) -> list[dict]:
    """Per bucket, one at a time and with no compilation cache: trace, lower, compile."""
    import jax

    from jaxllm import LLM

    jax.config.update("jax_enable_compilation_cache", False)
    kw = common.engine_kwargs(args, args.model) | dict(enforce_eager=True, compilation_cache_dir=None)
    r = LLM(args.model, **kw).llm_engine.runner
    rows = []
    for v in r.programs.variants():
        a = r.programs.dummy_args(v, r.params, r.prev_tokens)
        t0 = time.perf_counter()
        traced = r.programs._jit.trace(*a, cfg=r.cfg, attn=r.attn, flags=v.flags, prompt_k=v.prompt_logprobs)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
        rows.append(
            dict(
                T=v.num_tokens,
                B=v.num_seqs,
                decode_only=v.decode_only,
                trace_s=t1 - t0,
                lower_s=t2 - t1,
                compile_s=t3 - t2,
            )
        )
        print(f"phases {rows[-1]}", flush=True)
    return rows


def run_child(args, argv, code_dir: str | None, cache_dir: str, mode: str) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        *argv,
        "--child",
        mode,
        "--model",
        args.model,
        "--compilation-cache-dir",
        cache_dir,
    ]
    if code_dir:
        cmd += ["--code-dir", os.path.abspath(code_dir)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), cwd=common.ROOT)
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"child {mode} failed ({out.returncode})")
    res = json.loads(lines[-1][len("RESULT ") :])
    return res if isinstance(res, list) else res | {"process_wall_s": wall}


# Parent-only flags that take a value (the child gets its own --model / --compilation-cache-dir).
_PARENT_FLAGS = ("--code-dir", "--warm-runs", "--out", "--shape", "--model", "--compilation-cache-dir")


def strip_args(argv: list[str]) -> list[str]:
    """The command line minus the parent-only flags (--phases and _PARENT_FLAGS, as "--f v" or "--f=v")."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in _PARENT_FLAGS:
            skip = True
            continue
        if a == "--phases" or a.split("=")[0] in _PARENT_FLAGS:
            continue
        out.append(a)
    return out


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.child:
        if args.code_dir:  # ahead of this checkout, which the top of this file put first on sys.path
            sys.path.insert(0, args.code_dir[0])
        common.setup_logging(args.log_level)
        res = phases(args) if args.child == "phases" else child(args)
        print("RESULT " + json.dumps(res), flush=True)
        return res
    common.setup_logging(args.log_level)
    model = common.resolve_model(args)
    if args.num_layers:
        # A copy: the generated folder is shared by every bench script of that shape (editing it in place
        # made later runs of other scripts use the truncated model).
        copy = tempfile.mkdtemp(prefix="jaxllm-startup-model-")
        atexit.register(shutil.rmtree, copy, True)
        shutil.copytree(model, copy, dirs_exist_ok=True)
        model = copy
        path = os.path.join(model, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["num_hidden_layers"] = args.num_layers
        with open(path, "w") as f:
            json.dump(cfg, f, indent=1)
    args.model = model
    child_argv = strip_args(argv)
    series = {}
    code_dirs = args.code_dir or [None]
    with tempfile.TemporaryDirectory(prefix="jaxllm-startup-") as work:
        caches = {c: os.path.join(work, f"cache{i}") for i, c in enumerate(code_dirs)}
        # Interleaved: cold of each checkout, then warm runs alternating, so load on a shared machine hits all
        # alike.
        for c in code_dirs:
            series[c or "."] = {"cold": run_child(args, child_argv, c, caches[c], "start"), "warm": []}
            print(f"{c or '.'} cold: {json.dumps(series[c or '.']['cold'])}", flush=True)
        for _ in range(args.warm_runs):
            for c in code_dirs:
                res = run_child(args, child_argv, c, caches[c], "start")
                series[c or "."]["warm"].append(res)
                print(f"{c or '.'} warm: {json.dumps(res)}", flush=True)
        for name, s in series.items():
            s["warm_tokens_equal_cold"] = all(w["greedy_tokens"] == s["cold"]["greedy_tokens"] for w in s["warm"])
            print(f"{name}: greedy tokens of the warm starts equal the cold start's: {s['warm_tokens_equal_cold']}")
        result = dict(
            env=common.environment(), args={k: v for k, v in vars(args).items() if k != "child"}, series=series
        )
        if args.phases:
            result["phases"] = run_child(args, child_argv, code_dirs[0], os.path.join(work, "none"), "phases")
    common.write_result("startup", result, args.out)
    return result


if __name__ == "__main__":
    main()
