"""The issue-7 GPU session in one command: every measurement as its own process (so one failure or timeout
leaves the rest), then one summary of each figure against its goal.

  python bench/suite.py --out-dir $OUT [--stages latency,throughput,hf,ready] [--max-num-seqs 512 ...]

Stages (each a subprocess with a time limit; JSON lands in --out-dir):
  latency     bench/latency.py, Llama-3-8B shape, batch 1 and 64 (+ a jax.profiler trace of batch 1)
  throughput  bench/throughput.py, 500 prompts x 462 in / 256 out (+ a short traced run)
  hf          bench/hf_baseline.py: batch-1 decode and one batch of the throughput workload
  ready       time to ready without and then with the compile cache (two fresh processes, full warm-up)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GOALS = dict(batch1_tok_s=180, req_s=38, hf_throughput_ratio=10, hf_batch1_ratio=15, ready_cold_s=60,
             ready_warm_s=15)


def run(name, cmd, timeout, log):
    t0 = time.perf_counter()
    log.write(f"\n===== {name}: {' '.join(cmd)}\n")
    log.flush()
    print(f"===== {name} (limit {timeout} s)", flush=True)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    log.write(out)
    log.write(f"\n===== {name}: rc={rc} in {time.perf_counter() - t0:.1f} s\n")
    log.flush()
    tail = "\n".join(l for l in out.splitlines() if not l.startswith("DEBUG"))[-1500:]
    print(tail, f"\n----- {name}: rc={rc} in {time.perf_counter() - t0:.1f} s", flush=True)
    return rc


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--stages", default="latency,throughput,hf,ready")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--ready-max-num-seqs", type=int, default=None)
    p.add_argument("--ready-max-num-batched-tokens", type=int, default=None)
    p.add_argument("--eager", action="store_true", help="latency/throughput compile only the buckets they hit")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--hf-num-prompts", type=int, default=64)
    p.add_argument("--timeout", type=int, default=240, help="per stage")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    py = sys.executable
    o = lambda n: os.path.join(a.out_dir, n)  # noqa: E731
    model = ["--shape", "llama3-8b", "--load-format", "dummy", "--dtype", "bfloat16",
             "--attention-backend", a.attention_backend, "--max-model-len", str(a.max_model_len)]
    limits = ["--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    eager = ["--enforce-eager"] if a.eager else []
    stages = a.stages.split(",")
    with open(o("log.txt"), "a") as log:
        for st in stages:
            if st == "latency":
                prof = ["--profile-dir", "/tmp/prof_latency"] if a.profile else []
                run("latency", [py, f"{HERE}/latency.py", *model, *limits, *eager, "--batch-size", "1",
                                "--batch-size", "64", "--input-len", "128", "--output-len", "128",
                                "--num-iters", "2", "--compilation-cache-dir", "/tmp/xla_lat",
                                "--out", o("latency.json"), *prof], a.timeout, log)
            elif st == "throughput":
                prof = (["--profile-dir", "/tmp/prof_tp", "--profile-prompts", "128", "--profile-output-len", "32"]
                        if a.profile else [])
                run("throughput", [py, f"{HERE}/throughput.py", *model, *limits, *eager, "--num-prompts",
                                   str(a.num_prompts), "--input-len", "462", "--output-len", "256",
                                   "--compilation-cache-dir", "/tmp/xla_tp", "--out", o("throughput.json"), *prof],
                    a.timeout, log)
            elif st == "hf":
                run("hf", [py, f"{HERE}/hf_baseline.py", "--shape", "llama3-8b", "--batch1-output-len", "64",
                           "--input-len", "462", "--output-len", "256", "--batch-size", "64", "--num-prompts",
                           str(a.hf_num_prompts), "--out", o("hf_baseline.json")], a.timeout, log)
            elif st == "ready":
                rl = ["--max-num-seqs", str(a.ready_max_num_seqs or a.max_num_seqs), "--max-num-batched-tokens",
                      str(a.ready_max_num_batched_tokens or a.max_num_batched_tokens)]
                for tag in ("cold", "warm"):
                    run(f"ready_{tag}", [py, f"{HERE}/latency.py", *model, *rl, "--batch-size", "1",
                                         "--input-len", "16", "--output-len", "16", "--num-iters", "1",
                                         "--num-iters-warmup", "0", "--compilation-cache-dir", "/tmp/xla_ready",
                                         "--out", o(f"ready_{tag}.json")], a.timeout, log)
    summarize(a.out_dir)


def summarize(out_dir):
    o = lambda n: load(os.path.join(out_dir, n))  # noqa: E731
    lat, tp, hf, cold, warm = o("latency.json"), o("throughput.json"), o("hf_baseline.json"), o("ready_cold.json"), \
        o("ready_warm.json")
    s: dict = {"goals": GOALS}
    if lat:
        b1 = next((r for r in lat["results"] if r["batch_size"] == 1), None)
        s["batch1_tok_s"] = b1 and b1["decode_tok_per_s_per_seq"]
    if tp:
        s["req_s"] = tp["requests_per_s"]
        s["output_tok_s"] = tp["output_tokens_per_s"]
    if hf:
        s["hf_batch1_tok_s"] = hf["batch1"]["decode_tok_per_s"]
        if hf.get("batched"):
            s["hf_req_s"] = hf["batched"]["requests_per_s"]
            if tp:
                s["hf_throughput_ratio"] = tp["requests_per_s"] / hf["batched"]["requests_per_s"]
        if s.get("batch1_tok_s"):
            s["hf_batch1_ratio"] = s["batch1_tok_s"] / hf["batch1"]["decode_tok_per_s"]
    for tag, r in (("cold", cold), ("warm", warm)):
        if r:
            s[f"ready_{tag}_s"] = r["time_to_ready_s"]["since_script_start"]
            s[f"ready_{tag}_llm_init_s"] = r["time_to_ready_s"]["llm_init"]
            s[f"ready_{tag}_variants"] = r["engine"]["num_variants_compiled"]
    s["met"] = {k: (s[k] <= g if k.startswith("ready") else s[k] >= g) for k, g in GOALS.items()
                if s.get(k) is not None}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    print(json.dumps(s, indent=1), flush=True)
    return s


if __name__ == "__main__":
    main()
