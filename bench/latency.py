"""Latency of one batch through LLM.generate, like `vllm bench latency`: TTFT, ITL, decode tok/s.

  python bench/latency.py --shape llama3-8b --load-format dummy --batch-size 1 --batch-size 64 \\
      --input-len 128 --output-len 128
  python bench/latency.py --shape llama3-8b --load-format dummy --quantization gptq ...   # int4 g128 sym weights
  python bench/latency.py --shape llama3-8b --load-format dummy --quantization fp8 ...    # fp8 W8A8 (dynamic)

For each batch size: --num-iters timed runs after --num-iters-warmup, each a fresh batch of random-token
prompts with ignore_eos. Per request, from RequestMetrics: TTFT = first token - arrival, ITL = (last - first
token) / (output - 1). Decode tok/s per sequence = 1 / ITL; batch tok/s = batch * output / end-to-end.
The JSON also has the time to ready (LLM() built and every bucket compiled).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--batch-size", type=int, action="append", default=None, help="repeatable (default 1 and 8)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument(
        "--profile-dir",
        default=None,
        help="trace one batch-1 run with jax.profiler and sum it up (with 200 decode kernels in launch order)",
    )
    p.add_argument(
        "--host-timing",
        action="store_true",
        help="one more batch-1 run with the runner's prepare / launch / collect timed: host ms a step in each, and "
        "collect's wait for the device (near 0: the host is the bottleneck)",
    )
    p.add_argument(
        "--smallest-seq-bucket",
        type=int,
        default=None,
        help="A/B of the smallest decode bucket: replaces runner.SMALLEST_SEQ_BUCKET and SMALLEST_SEQ_BUCKET_INT",
    )
    return p.parse_args(argv)


def run_batch(llm, batch: int, input_len: int, output_len: int, seed: int) -> dict:
    from jaxllm import SamplingParams

    vocab = llm.llm_engine.vocab_size
    prompts = [{"prompt_token_ids": p} for p in common.random_token_prompts(batch, input_len, vocab, seed)]
    sp = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    e2e = time.perf_counter() - t0
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    itl = [
        (o.metrics.last_token_time - o.metrics.first_token_time) / max(len(o.outputs[0].token_ids) - 1, 1) for o in outs
    ]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(e2e_s=e2e, ttft_s=ttft, itl_s=itl, output_tokens=n_out)


def host_timing(llm, input_len: int, output_len: int) -> dict:
    """One batch-1 run with ModelRunner's prepare, launch and collect wrapped in timers (instance attributes,
    removed after): mean ms a call of each, and of the whole engine step. The engine keeps one step in flight, so
    collect mostly waits for the device: when its mean is near the unpacking's ~0.1 ms, the device waits for the
    host instead."""
    runner, engine = llm.llm_engine.runner, llm.llm_engine
    names = ("prepare", "launch", "collect")
    spent = {**common.call_seconds(runner, names), **common.call_seconds(engine, ("step",))}
    try:
        run = run_batch(llm, 1, input_len, output_len, seed=77)
    finally:
        for name in names:
            delattr(runner, name)
        del engine.step
    out = {name: dict(calls=len(t), ms=1e3 * sum(t) / len(t)) for name, t in spent.items() if t}
    decode = spent.get("step", [])[2:-1]  # decode steps: not the first two (the prefill's dispatch, then its output)
    if decode:
        out["decode_step_ms_p50"] = 1e3 * sorted(decode)[len(decode) // 2]
    out["itl_ms"] = 1e3 * run["itl_s"][0]  # this run's own ITL, beside its timings
    return out


def main(argv=None) -> dict:
    args = parse(argv)
    common.setup_logging(args.log_level)
    from jaxllm.engine import runner as runner_mod

    defaults = runner_mod.SMALLEST_SEQ_BUCKET, runner_mod.SMALLEST_SEQ_BUCKET_INT
    if args.smallest_seq_bucket is not None:  # read while the engine is built (its bucket lists), then restored
        runner_mod.SMALLEST_SEQ_BUCKET = runner_mod.SMALLEST_SEQ_BUCKET_INT = args.smallest_seq_bucket
    try:
        llm, t0, t_ready = common.build_llm(args)
    finally:
        runner_mod.SMALLEST_SEQ_BUCKET, runner_mod.SMALLEST_SEQ_BUCKET_INT = defaults
    env = common.environment()
    runner = llm.llm_engine.runner
    compiled_before = len(runner.programs.compiled)
    results = []
    for batch in args.batch_size or [1, 8]:
        for i in range(args.num_iters_warmup):
            run_batch(llm, batch, args.input_len, args.output_len, seed=1000 + i)
        runner.programs.wait_for_background_compiles()  # e.g. long-context decode programs (runner.py)
        runs = [run_batch(llm, batch, args.input_len, args.output_len, seed=i) for i in range(args.num_iters)]
        ttft = [t for r in runs for t in r["ttft_s"]]
        itl = [t for r in runs for t in r["itl_s"]]
        e2e = [r["e2e_s"] for r in runs]
        out_tok = runs[0]["output_tokens"]
        row = dict(
            batch_size=batch,
            ttft_s=common.pct(ttft),
            itl_s=common.pct(itl),
            e2e_s=common.pct(e2e),
            decode_tok_per_s_per_seq=1.0 / common.pct(itl)["p50"],
            batch_output_tok_per_s=out_tok / common.pct(e2e)["p50"],
        )
        results.append(row)
        print(
            f"batch {batch}: TTFT p50 {row['ttft_s']['p50'] * 1e3:.1f} ms, ITL p50 {row['itl_s']['p50'] * 1e3:.2f} ms"
            f" ({row['decode_tok_per_s_per_seq']:.1f} tok/s per sequence), e2e p50 {row['e2e_s']['p50']:.2f} s,"
            f" {row['batch_output_tok_per_s']:.1f} output tok/s",
            flush=True,
        )
    res = dict(
        env=env,
        engine=common.engine_summary(llm),
        workload=dict(
            input_len=args.input_len,
            output_len=args.output_len,
            num_iters=args.num_iters,
            ignore_eos=True,
            temperature=0.0,
            model=args.model or args.shape or "demo",
            load_format=args.load_format,
            quantization=args.quantization,
        ),
        time_to_ready_s=dict(llm_init=t_ready - t0, since_script_start=t_ready - T_START),
        results=results,
        compiles_during_run=len(runner.programs.compiled) - compiled_before,
        compiles_after_warmup=runner.programs.num_compiles_after_warmup,
        long_decode_from=runner.host.long_decode_from,
        long_context_programs=sorted(v.shape_name for v in runner.programs.compiled if v.long_context),
    )
    if args.host_timing:
        res["host_timing"] = host_timing(llm, args.input_len, args.output_len)
        print(f"host timing (ms a call): {res['host_timing']}", flush=True)
    if args.profile_dir:
        from bench.throughput import profile_run

        vocab = llm.llm_engine.vocab_size
        prompts = [{"prompt_token_ids": p} for p in common.random_token_prompts(1, args.input_len, vocab, 7)]
        # sequence: 200 kernels in launch order from the trace's middle (decode steps), as bench/long_context.py
        res["profile"] = profile_run(llm, prompts, min(args.output_len, 64), args.profile_dir, sequence=200)
    common.write_result("latency", res, args.out)
    return res


if __name__ == "__main__":
    main()
