"""Host time per engine step, by phase: runs bench/throughput.py (same flags) with timers around the engine's
host phases and the garbage collector, and reports per-step milliseconds. What the device trace cannot show: a
gap between two steps is the host being late, and this says which phase made it late.

  python bench/step_phases.py --shape llama3-8b --load-format dummy --num-prompts 500 --input-len 462 \\
      --output-len 256 --out /tmp/tp.json [--min-seqs 480]      -> /tmp/tp_step_phases.json

Phases of one LLMEngine.step() call: schedule (Scheduler.schedule), prepare (ModelRunner.prepare, numpy),
exe_call (the compiled step's call: argument handling, host-to-device copies, launch), collect (waits for the
previous step's tokens), sched_update, on_token (per-token bookkeeping, detokenization, stops), make_output
(RequestOutput objects) and gc (collector pauses, wherever they fell). The medians are over the steps that ran
at least --min-seqs sequences (the steady decode of the throughput workload by default).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = ("schedule", "prepare", "exe_call", "collect", "sched_update", "on_token", "make_output", "gc")


def install_timers(current: dict):
    """Wraps the engine's phase methods (class level, before the engine is built) to add their wall time to
    current[phase], and registers a GC callback that adds collector pauses to current["gc"]. Returns the
    function that undoes both."""
    from bench.common import time_calls, timed
    from jaxllm.engine import llm_engine, programs, runner, scheduler

    originals = []

    def wrap(cls, name, key):
        originals.append((cls, name, time_calls(cls, name, current, key)))

    wrap(scheduler.Scheduler, "schedule", "schedule")
    wrap(scheduler.Scheduler, "update", "sched_update")
    wrap(runner.ModelRunner, "prepare", "prepare")
    wrap(runner.ModelRunner, "collect", "collect")
    wrap(llm_engine.LLMEngine, "_on_token", "on_token")
    wrap(llm_engine.LLMEngine, "_make_output", "make_output")
    executable = programs.StepPrograms.executable

    def timed_executable(self, v, args):
        return timed(executable(self, v, args), current, "exe_call")

    originals.append((programs.StepPrograms, "executable", executable))
    programs.StepPrograms.executable = timed_executable
    gc_start: list[float] = []

    def on_gc(phase, info):
        if phase == "start":
            gc_start[:] = [time.perf_counter()]
        elif gc_start:
            current["gc"] = current.get("gc", 0.0) + time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)

    def undo():
        gc.callbacks.remove(on_gc)
        for cls, name, f in reversed(originals):
            setattr(cls, name, f)

    return undo


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--min-seqs", type=int, default=480)
    p.add_argument("--out", required=True)
    own, _ = p.parse_known_args(argv)
    if "--min-seqs" in argv:
        i = argv.index("--min-seqs")
        del argv[i : i + 2]
    if "--profile-dir" in argv:
        p.error("--profile-dir re-runs the workload after the timed run; run it without")
    from jaxllm.engine import llm_engine

    current: dict = {}
    steps: list[dict] = []
    undo = install_timers(current)
    step = llm_engine.LLMEngine.step

    def timed_step(self):
        current.clear()
        t = time.perf_counter()
        out = step(self)
        row = {k: v * 1e3 for k, v in current.items()}
        row.update(total=(time.perf_counter() - t) * 1e3, num_running=len(self.scheduler.running))
        steps.append(row)
        return out

    from bench import throughput

    llm_engine.LLMEngine.step = timed_step
    try:
        res = throughput.main(argv)
    finally:
        llm_engine.LLMEngine.step = step
        undo()
    run = steps[-_timed_steps(steps) :]  # the timed generate() is the last one (warm-up ones come before)
    steady = [r for r in run if r["num_running"] >= own.min_seqs]
    out = dict(
        throughput=dict(
            requests_per_s=res["requests_per_s"],
            elapsed_s=res["elapsed_s"],
            commit=res["env"]["commit"],
            device=res["env"]["device"],
            jax=res["env"]["jax"],
            command=res["env"]["command"],
        ),
        steps=len(run),
        steady_steps=len(steady),
        min_seqs=own.min_seqs,
        totals_s={k: round(sum(r.get(k, 0.0) for r in run) / 1e3, 3) for k in PHASES + ("total",)},
        steady_median_ms={k: round(statistics.median(r.get(k, 0.0) for r in steady), 3) for k in PHASES + ("total",)}
        if steady
        else None,
        slowest_steady=sorted(steady, key=lambda r: -r["total"])[:20],
    )
    path = own.out[:-5] + "_step_phases.json" if own.out.endswith(".json") else own.out + "_step_phases.json"
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("totals_s", "steady_median_ms")}, indent=1))
    return out


def _timed_steps(steps: list[dict]) -> int:
    """Steps of the last generate(): it starts where the number of running sequences last rose from 0."""
    for i in range(len(steps) - 1, 0, -1):
        if steps[i - 1]["num_running"] == 0 and steps[i]["num_running"] > 0:
            return len(steps) - i
    return len(steps)


if __name__ == "__main__":
    main()
