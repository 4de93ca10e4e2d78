"""One engine over two processes (as two hosts: one GPU each) against one process with both GPUs, and data
parallelism against one GPU, in one command on a 2-GPU machine:

    python bench/multihost.py --shape llama3-8b --load-format dummy --out $OUT/multihost.json

Cases (--cases; each runs in fresh processes, so no case inherits another's device memory):
  single_tp2, single_pp2   one process, both GPUs, tp 2 / pp 2 (the baselines)
  multi_tp2, multi_pp2     two processes joined by jaxllm.distributed on localhost, one GPU each
                           (CUDA_VISIBLE_DEVICES=0 / 1), the same tp 2 / pp 2: process 0 schedules and sends each
                           step to process 1 (jaxllm/engine/multihost.py)
  single_tp1, dp2          one GPU, and two data-parallel replicas on the two GPUs (jaxllm/engine/dp.py: a process
                           per replica, CUDA_VISIBLE_DEVICES=0 / 1, behind this process's front end)
Each tp / pp case reports greedy tokens (--greedy-dtype, float32 by default: a near tie flips less often; the
multi-process tokens are compared with the same layout's single-process ones), offline throughput
(--num-prompts x --input-len / --output-len, bf16) and batch-1 inter-token latency (--itl-output-len tokens of
one request); dp2 and single_tp1 report throughput on --dp-num-prompts prompts, and the JSON the ratio.

CPU check of the script (tests/test_bench.py): --cpu runs the same cases on simulated CPU devices.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    add_model_args,
    engine_kwargs,
    engine_summary,
    environment,
    make_model_dir,
    random_token_prompts,
    setup_logging,
    write_result,
)

CASES = ("single_tp2", "single_pp2", "multi_tp2", "multi_pp2", "single_tp1", "dp2")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--greedy-dtype", default="float32")
    p.add_argument("--throughput-dtype", default="bfloat16")
    p.add_argument("--num-greedy", type=int, default=8)
    p.add_argument("--greedy-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--dp-num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--itl-output-len", type=int, default=128)
    p.add_argument("--skip-greedy", action="store_true")
    p.add_argument("--case-timeout", type=float, default=900.0, help="seconds per case before it is killed")
    p.add_argument("--cpu", action="store_true", help="simulated CPU devices instead of GPUs (script checks)")
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)  # internal: CASE:PROCESS_ID:PORT:OUT
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    setup_logging(args.log_level)
    if args.role:
        return run_role(args)
    model = make_model_dir(args.shape) if args.shape else args.model
    # no jax here: the cases' processes own the GPUs
    result = dict(env=environment(with_jax=False), workload=vars(args) | {"model": model}, cases={})
    for case in args.cases:
        t0 = time.perf_counter()
        result["cases"][case] = run_case(args, argv, model, case)
        print(f"{case}: {summary_line(result['cases'][case])} ({time.perf_counter() - t0:.0f} s)", flush=True)
        write_result("multihost", result, args.out)  # each case as it ends: a later case's time-out keeps it
    result["comparison"] = compare(result["cases"])
    for case in result["cases"].values():
        if "env" in case:
            result["env"].update({k: case["env"][k] for k in ("jax", "backend", "device") if k in case["env"]})
            break
    print(json.dumps(result["comparison"], indent=1), flush=True)
    write_result("multihost", result, args.out)
    return result


# ---- the parent: one case in its own process(es) ----------------------------------------------------------------
def run_case(args, argv: list[str], model: str, case: str) -> dict:
    """The case's process(es) run this script with the same flags and --role (the last --model wins)."""
    multi = case.startswith("multi_")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="jaxllm-multihost-") as tmp:
        outs = [os.path.join(tmp, f"p{i}.json") for i in range(2 if multi else 1)]
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--model", model]
        procs = [
            subprocess.Popen(cmd + ["--role", f"{case}:{i}:{port}:{out}"], env=_env(args, case, i))
            for i, out in enumerate(outs)
        ]
        try:
            codes = [p.wait(timeout=args.case_timeout) for p in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if codes != [0] * len(procs) or not os.path.exists(outs[0]):
            return dict(error=f"exit codes {codes}" if codes else f"timed out after {args.case_timeout} s")
        with open(outs[0]) as f:
            return json.load(f)


def _env(args, case: str, process_id: int) -> dict:
    env = dict(os.environ)
    devices = 1 if case.startswith("multi_") or case == "single_tp1" else 2
    if args.cpu:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    else:
        # two processes as two hosts: each sees its own GPU only
        env["CUDA_VISIBLE_DEVICES"] = (
            str(process_id) if case.startswith("multi_") else ",".join(map(str, range(devices)))
        )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- a case's process ---------------------------------------------------------------------------------------------
def run_role(args) -> None:
    case, process_id, port, out = args.role.split(":", 3)
    process_id = int(process_id)
    if case.startswith("multi_"):
        from jaxllm.distributed import initialize

        initialize(f"localhost:{port}", 2, process_id, timeout=300)
    layout = {
        "single_tp2": (2, 1, 1),
        "multi_tp2": (2, 1, 1),
        "single_pp2": (1, 2, 1),
        "multi_pp2": (1, 2, 1),
        "single_tp1": (1, 1, 1),
        "dp2": (1, 1, 2),
    }[case]
    from jaxllm.config import ModelConfig

    vocab = ModelConfig.from_hf(args.model).vocab_size
    # data parallel: jax must not start on the GPUs here (the replica processes own them); their info fills env
    entry = dict(env=environment(with_jax=layout[2] == 1), layout=dict(zip(("tp", "pp", "dp"), layout, strict=True)))
    if not args.skip_greedy and layout[2] == 1 and case != "single_tp1":
        prompts = random_token_prompts(args.num_greedy, 64, vocab, seed=1)
        entry["greedy"] = run(args, layout, args.greedy_dtype, prompts, args.greedy_len)
    n = args.dp_num_prompts if case in ("dp2", "single_tp1") else args.num_prompts
    entry["throughput"] = run(
        args,
        layout,
        args.throughput_dtype,
        random_token_prompts(n, args.input_len, vocab, 2),
        args.output_len,
        itl=case not in ("dp2", "single_tp1"),
    )
    replicas = entry["throughput"].get("replicas")
    if replicas:
        first = replicas[0]
        entry["env"].update(
            jax=first["jax"],
            backend=first["backend"],
            device=first["device_kind"],
            num_devices=sum(len(r["devices"]) for r in replicas),
        )
    if process_id == 0:
        with open(out, "w") as f:
            json.dump(entry, f, default=str)


def run(args, layout, dtype, prompts, output_len, itl: bool = False) -> dict:
    """Builds the engine, runs prompts twice (the first run compiles what start-up did not) and times the
    second; itl: then one request alone, its mean inter-token latency. Every process runs it; process 0's
    numbers are the result."""
    from jaxllm import LLM, SamplingParams

    tp, pp, dp = layout
    kw = engine_kwargs(args, args.model) | dict(
        dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp
    )
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    ready = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, sp, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    secs = time.perf_counter() - t0
    r = dict(
        ready_s=ready,
        seconds=secs,
        num_prompts=len(prompts),
        output_tok_s=len(prompts) * output_len / secs,
        req_s=len(prompts) / secs,
        tokens=[o.outputs[0].token_ids for o in outs],
    )
    if itl:
        one = SamplingParams(temperature=0, max_tokens=args.itl_output_len, ignore_eos=True)
        llm.generate(batch[:1], one, use_tqdm=False)
        gaps = []
        for _ in range(3):
            o = llm.generate(batch[:1], one, use_tqdm=False)
            if o:
                m = o[0].metrics
                gaps.append((m.last_token_time - m.first_token_time) / (args.itl_output_len - 1) * 1e3)
        r["batch1_itl_ms"] = min(gaps) if gaps else None
    if dp == 1:
        r["engine"] = engine_summary(llm)
    else:  # each replica in its own process, on its own devices; this process never started jax's backend
        from jax._src import xla_bridge

        r["replicas"] = [p.info for p in llm.llm_engine.replicas]
        r["front_end_backend_started"] = xla_bridge.backends_are_initialized()
        llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return r


# ---- the result ---------------------------------------------------------------------------------------------------
def compare(cases: dict) -> dict:
    out = {}
    for layout in ("tp2", "pp2"):
        single, multi = cases.get(f"single_{layout}", {}), cases.get(f"multi_{layout}", {})
        if "throughput" not in single or "throughput" not in multi:
            continue
        row = dict(
            throughput_ratio=multi["throughput"]["output_tok_s"] / single["throughput"]["output_tok_s"],
            single_out_tok_s=single["throughput"]["output_tok_s"],
            multi_out_tok_s=multi["throughput"]["output_tok_s"],
            single_batch1_itl_ms=single["throughput"].get("batch1_itl_ms"),
            multi_batch1_itl_ms=multi["throughput"].get("batch1_itl_ms"),
            throughput_tokens_equal=single["throughput"]["tokens"] == multi["throughput"]["tokens"],
        )
        if "greedy" in single and "greedy" in multi:
            a, b = single["greedy"]["tokens"], multi["greedy"]["tokens"]
            row["greedy_equal"] = a == b
            row["greedy_first_divergence"] = [
                next((i for i, (x, y) in enumerate(zip(p, q, strict=False)) if x != y), None)
                for p, q in zip(a, b, strict=True)
            ]
        out[layout] = row
    one, dp = cases.get("single_tp1", {}), cases.get("dp2", {})
    if "throughput" in one and "throughput" in dp:
        out["dp2"] = dict(
            one_gpu_out_tok_s=one["throughput"]["output_tok_s"],
            dp2_out_tok_s=dp["throughput"]["output_tok_s"],
            speedup=dp["throughput"]["output_tok_s"] / one["throughput"]["output_tok_s"],
            tokens_equal=one["throughput"]["tokens"] == dp["throughput"]["tokens"],
        )
    return out


def summary_line(case: dict) -> str:
    if "error" in case:
        return f"FAILED: {case['error']}"
    t = case["throughput"]
    itl = f", batch-1 ITL {t['batch1_itl_ms']:.2f} ms" if t.get("batch1_itl_ms") else ""
    return f"{t['output_tok_s']:.0f} out tok/s (ready {t['ready_s']:.0f} s){itl}"


if __name__ == "__main__":
    main()
