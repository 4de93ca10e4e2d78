"""A/B of the compiled steps' sequence-bucket list on the throughput workloads, in one device call: each arm is
its own process (its own engine, compiled for its list), running the random 500 x 462 / 256 workload and the
ShareGPT-like mix --rounds times, alternating, after one untimed round of each.

  python bench/bucket_ab.py --shape llama3-8b --load-format dummy --max-num-seqs 512 \\
      --max-num-batched-tokens 8192 --max-model-len 1024 \\
      --arm pow2 --arm by64:2/4/8/16/32/64/128/256/320/384/448/512 --arm pow2 --out /tmp/ab.json

An arm is "pow2" (the engine's lists, jaxllm.engine.runner.step_buckets) or NAME:B1/B2/... (sequence buckets;
the largest must be --max-num-seqs; token buckets stay the engine's). The arm's process replaces
runner.step_buckets before the engine is built, as bench/first_steps_trace.py replaces SMALLEST_SEQ_BUCKET.
bench/padding_waste.py predicts the difference (--variant with the same list); this measures it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import common  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--arm", action="append", default=None, help="repeatable; default: pow2")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=462)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--datasets", default="random,synthetic-sharegpt")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one arm, in its own process
    return p.parse_args(argv)


def arm_buckets(spec: str, max_num_seqs: int) -> tuple[str, tuple[int, ...] | None]:
    """(name, sequence buckets or None for the engine's own)."""
    if spec == "pow2":
        return spec, None
    name, _, lst = spec.partition(":")
    seqs = tuple(int(x) for x in lst.split("/") if x.strip().isdigit())
    if not seqs or len(seqs) != len(lst.split("/")) or list(seqs) != sorted(set(seqs)) or seqs[-1] != max_num_seqs:
        raise ValueError(f"--arm {spec!r}: NAME:B1/B2/... rising, ending at --max-num-seqs ({max_num_seqs})")
    return name, seqs


def worker(args) -> dict:
    from jaxllm import SamplingParams
    from jaxllm.engine import runner

    name, seqs = arm_buckets(args.worker, args.max_num_seqs)
    if seqs is not None:
        default = runner.step_buckets
        runner.step_buckets = lambda max_num_seqs, max_num_batched_tokens: (
            seqs,
            default(max_num_seqs, max_num_batched_tokens)[1],
        )
    common.setup_logging(args.log_level)
    llm, t0, t_ready = common.build_llm(args)
    vocab = llm.llm_engine.vocab_size
    work = {}
    for ds in args.datasets.split(","):
        if ds == "random":
            ins, outs = [args.input_len] * args.num_prompts, [args.output_len] * args.num_prompts
        else:
            half = llm.llm_engine.max_model_len // 2
            ins, outs = common.synthetic_sharegpt(
                args.num_prompts, args.seed, max_input=min(1024, half), max_output=min(1024, half)
            )
        prompts = [{"prompt_token_ids": p} for p in common.random_token_prompts(len(ins), 0, vocab, args.seed, ins)]
        params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=args.temperature) for o in outs]
        work[ds] = (prompts, params)
    rows = []
    for rnd in range(-1, args.rounds):  # round -1: untimed (the first use of every bucket)
        for ds, (prompts, params) in work.items():
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            if rnd >= 0:
                rows.append(
                    dict(
                        round=rnd,
                        dataset=ds,
                        elapsed_s=dt,
                        requests_per_s=len(outs) / dt,
                        output_tokens_per_s=sum(len(o.outputs[0].token_ids) for o in outs) / dt,
                    )
                )
                print(f"{name} round {rnd} {ds}: {len(outs) / dt:.2f} req/s", flush=True)
    return dict(
        arm=name,
        spec=args.worker,
        env=common.environment(),
        engine=common.engine_summary(llm),
        ready_s=t_ready - t0,
        rows=rows,
        compiles_after_warmup=llm.llm_engine.runner.programs.num_compiles_after_warmup,
    )


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker:
        res = worker(args)
        common.write_result("bucket_ab_arm", res, args.out)
        return res
    arms = args.arm or ["pow2"]
    for a in arms:
        arm_buckets(a, args.max_num_seqs)  # a bad spec fails here, before any engine starts
    rest = [x for i, x in enumerate(argv) if x != "--arm" and (i == 0 or argv[i - 1] != "--arm")]
    out = args.out or os.path.join(common.RESULTS, "bucket_ab.json")
    results = []
    for i, a in enumerate(arms):
        arm_out = f"{out[:-5] if out.endswith('.json') else out}_arm{i}.json"
        cmd = [sys.executable, os.path.abspath(__file__), *rest, "--worker", a, "--out", arm_out]
        rc = subprocess.run(cmd, cwd=os.path.dirname(HERE)).returncode
        try:
            with open(arm_out) as f:
                results.append(json.load(f))
        except (OSError, ValueError):
            results.append(dict(arm=a, error=f"rc={rc}, no result"))
    summary = {}
    for r in results:
        for row in r.get("rows", []):
            summary.setdefault(row["dataset"], {}).setdefault(f"{r['arm']}", []).append(row["requests_per_s"])
    res = dict(env=common.environment(with_jax=False), arms=arms, results=results, requests_per_s=summary)
    print(json.dumps(summary, indent=1), flush=True)
    common.write_result("bucket_ab", res, out)
    return res


if __name__ == "__main__":
    main()
