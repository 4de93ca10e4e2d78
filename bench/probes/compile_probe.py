"""Finding: steps with prompt tokens compile in half the time on cuBLAS GEMMs (XLA's Triton GEMMs off) and run
as fast or faster (H100: LLM() 73.8 -> 60.5 s cold; programs.compile_options, HISTORY stop 21).

Probe: what XLA compile options cost at start-up and per step (issue 7's cold start).

For each option set, a fresh process (XLA's in-process autotuning results start empty) with a fresh
compilation cache builds LLM(...) cold with runner.compile_options extended by the set's options for the steps
it names ("mixed": steps with prompt tokens, "decode": decode-only steps, "all"). It reports LLM() seconds,
the warm-up log line and each variant's compile seconds (several compile at once, as in a real start), then
times every compiled step on its warm-up inputs (chained calls, KV donated; the inputs write no KV slot, so a
mixed step's attention does little and its time is mostly the GEMMs the options change).

  python bench/probes/compile_probe.py --shape llama3-8b --load-format dummy --dtype bfloat16 --max-model-len 1024 \\
      --max-num-seqs 512 --max-num-batched-tokens 8192 --sets base,mixed_cublas --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import common  # noqa: E402

# name -> {step kind ("mixed", "decode", "all"): extra XLA options; "workers": compile threads of warm-up;
# "nice": niceness of the compile threads (the tracing thread keeps its own)}
CUBLAS_MIXED = {"mixed": {"xla_gpu_enable_triton_gemm": False}}
SETS = {
    "base": {},
    "mixed_cublas": CUBLAS_MIXED,
    "autotune2": {"all": {"xla_gpu_autotune_level": 2}},
    "mixed_cublas_autotune2": CUBLAS_MIXED | {"all": {"xla_gpu_autotune_level": 2}},
    "autotune0": {"all": {"xla_gpu_autotune_level": 0}},
    "mixed_cublas_w4": CUBLAS_MIXED | {"workers": 4},
    "mixed_cublas_w12": CUBLAS_MIXED | {"workers": 12},
    "mixed_cublas_nice": CUBLAS_MIXED | {"nice": 10},
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--sets", default="base,mixed_cublas", help=f"comma-separated, from {sorted(SETS)}")
    p.add_argument("--no-time-steps", action="store_true", help="skip the per-step timing")
    p.add_argument(
        "--trace-only",
        action="store_true",
        help="also one process that traces and lowers every step (no compiles alongside)",
    )
    p.add_argument(
        "--ab-steps",
        default=None,
        help="instead: in one process, compile these steps (e.g. 512x2048,512x8192) once per set, one "
        "at a time, and time the sets' programs alternately",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def extra_options(spec: dict, decode_only: bool) -> dict:
    out = dict(spec.get("all", {}))
    out.update(spec.get("decode" if decode_only else "mixed", {}))
    return out


def step_ms(runner, v, exe) -> float:
    """Milliseconds per call of exe (v's program): (t(n2) - t(n1)) / (n2 - n1) over chained calls, so the fixed
    cost of dispatching the first call and syncing cancels."""
    import jax

    n1, n2 = (2, 6) if v.num_tokens >= 1024 else (5, 25)

    def chain(n):
        params, _, ints, floats, _, layout = runner.programs.dummy_args(v, runner.params, runner.prev_tokens)
        t0 = time.perf_counter()
        for _ in range(n):
            runner.kv_caches, runner.prev_tokens, outputs, _, _ = exe(
                params, runner.kv_caches, ints, floats, runner.prev_tokens, layout
            )
        jax.block_until_ready(outputs)
        return time.perf_counter() - t0

    return (chain(n2) - chain(n1)) / (n2 - n1) * 1e3


def time_steps(runner) -> list[dict]:
    """Each compiled step's time per call (median of three)."""
    rows = []
    for v in runner.programs.variants():
        exe = runner.programs.compiled[v]
        step_ms(runner, v, exe)  # first calls: graph instantiation, buffers
        samples = [step_ms(runner, v, exe) for _ in range(3)]
        rows.append(dict(step=v.shape_name, ms=statistics.median(samples), ms_samples=samples))
        print(f"step {rows[-1]}", flush=True)
    return rows


def ab_steps(args) -> dict:
    """--ab-steps: each named step compiled once per set (alone, nothing else compiling), then the sets'
    programs timed in alternation for --rounds rounds."""
    from jaxllm import LLM
    from jaxllm.engine import programs

    kw = common.engine_kwargs(args, args.model) | dict(enforce_eager=True)
    r = LLM(args.model, **kw).llm_engine.runner
    by_name = {v.shape_name: v for v in r.programs.variants()}
    names = args.sets.split(",")
    exes, compile_s = {}, {}
    for step in args.ab_steps.split(","):
        v = by_name[step]
        for name in names:
            options = programs.compile_options(v) | extra_options(SETS[name], v.decode_only)
            lowered = r.programs._lower(v, r.programs.dummy_args(v, r.params, r.prev_tokens))
            t0 = time.perf_counter()
            exes[step, name] = lowered.compile(compiler_options=options)
            compile_s[f"{step} {name}"] = round(time.perf_counter() - t0, 2)
            step_ms(r, v, exes[step, name])
            print(f"compiled {step} {name} in {compile_s[f'{step} {name}']} s", flush=True)
    samples = {k: [] for k in exes}
    for _ in range(args.rounds):
        for (step, name), exe in exes.items():
            samples[step, name].append(step_ms(r, by_name[step], exe))
    rows = [dict(step=step, set=name, ms=statistics.median(s), ms_samples=s) for (step, name), s in samples.items()]
    for row in rows:
        print(f"ab {row['step']} {row['set']}: {row['ms']:.2f} ms", flush=True)
    return dict(set="ab_steps", compile_s=compile_s, rows=rows)


def child(args) -> dict:
    import logging

    import jax

    from jaxllm import LLM
    from jaxllm.engine import programs
    from jaxllm.engine import runner as runner_mod

    spec = SETS[args.child]
    base_options = programs.compile_options

    def compile_options(v):
        return base_options(v) | extra_options(spec, v.decode_only)

    programs.compile_options = compile_options
    seconds: dict[str, float] = {}
    base_compile = programs.StepPrograms._compile

    def timed_compile(self, v, *a, **k):
        if spec.get("nice") and threading.current_thread() is not threading.main_thread():
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), spec["nice"])
        t0 = time.perf_counter()
        try:
            return base_compile(self, v, *a, **k)
        finally:
            seconds[v.shape_name] = round(time.perf_counter() - t0, 2)

    programs.StepPrograms._compile = timed_compile
    if spec.get("workers"):
        warm_up = runner_mod.ModelRunner.warm_up
        runner_mod.ModelRunner.warm_up = lambda self, enforce_eager=False, workers=None: warm_up(
            self, enforce_eager, spec["workers"]
        )
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("jaxllm").addHandler(Keep(logging.INFO))
    t0 = time.perf_counter()
    llm = LLM(args.model, **common.engine_kwargs(args, args.model))
    llm_init = time.perf_counter() - t0
    print(f"set {args.child}: LLM() {llm_init:.1f} s", flush=True)
    runner = llm.llm_engine.runner
    return dict(
        set=args.child,
        options=spec,
        llm_init_s=llm_init,
        compile_s=seconds,
        jax=jax.__version__,
        log=[m for m in messages if "variants" in m or "weights" in m],
        steps=[] if args.no_time_steps else time_steps(runner),
    )


def trace_only(args) -> dict:
    """Every step traced and lowered one after another, nothing compiling beside it."""
    from jaxllm import LLM

    kw = common.engine_kwargs(args, args.model) | dict(enforce_eager=True)
    r = LLM(args.model, **kw).llm_engine.runner
    rows = {}
    t_all = time.perf_counter()
    for v in r.programs.variants():
        t0 = time.perf_counter()
        r.programs._lower(v, r.programs.dummy_args(v, r.params, r.prev_tokens))
        rows[v.shape_name] = round(time.perf_counter() - t0, 3)
    total = time.perf_counter() - t_all
    print(f"trace_only: {total:.1f} s", flush=True)
    return dict(set="trace_only", lower_s=rows, total_s=total)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    common.setup_logging(args.log_level)
    if args.child:
        res = {"trace_only": trace_only, "ab_steps": ab_steps}.get(args.child, child)(args)
        print("RESULT " + json.dumps(res), flush=True)
        return res
    model = common.resolve_model(args)
    names = args.sets.split(",")
    unknown = [n for n in names if n not in SETS]
    names = ["ab_steps"] if args.ab_steps else names + (["trace_only"] if args.trace_only else [])
    if unknown:
        raise SystemExit(f"unknown sets {unknown}; known: {sorted(SETS)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="jaxllm-compile-probe-") as work:
        for i, name in enumerate(names):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                *argv,
                "--child",
                name,
                "--model",
                model,
                "--compilation-cache-dir",
                os.path.join(work, f"cache{i}"),
            ]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not lines:
                sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
                results.append(dict(set=name, failed=out.returncode, stderr=out.stderr[-2000:]))
                continue
            res = json.loads(lines[-1][len("RESULT ") :]) | {"process_wall_s": time.perf_counter() - t0}
            results.append(res)
            print(json.dumps({k: res.get(k) for k in ("set", "llm_init_s", "log", "total_s")}), flush=True)
    result = dict(env=common.environment(), args={k: v for k, v in vars(args).items() if k != "child"}, results=results)
    common.write_result("compile_probe", result, args.out)
    return result


if __name__ == "__main__":
    main()
