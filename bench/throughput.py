"""Offline throughput, like `vllm bench throughput`: N prompts of random token ids through LLM.generate
with ignore_eos, so every request produces exactly its output length.

  python bench/throughput.py --shape llama3-8b --load-format dummy --num-prompts 500 --input-len 462 \\
      --output-len 256
  python bench/throughput.py --dataset synthetic-sharegpt --num-prompts 200      # demo model, length mix

Prints requests/s, total tok/s and output tok/s; the JSON also has the time to ready (LLM() built and every
shape bucket compiled), the engine's buckets and KV size, and compiles that happened during the timed run.
--profile-dir traces a short extra run (after the timed one) with jax.profiler and sums it up.
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
    p.add_argument("--dataset", choices=("random", "synthetic-sharegpt"), default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="vLLM's bench samples at 1.0")
    p.add_argument("--no-detokenize", action="store_true")
    p.add_argument("--warmup-prompts", type=int, default=0,
                   help="run this many short requests before timing (with --enforce-eager: compiles buckets)")
    p.add_argument("--profile-dir", default=None)
    p.add_argument("--profile-prompts", type=int, default=64)
    p.add_argument("--profile-output-len", type=int, default=16)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    common.setup_logging(args.log_level)
    from jaxllm import LLM, SamplingParams

    model = common.resolve_model(args)
    t0 = time.perf_counter()
    llm = LLM(model, **common.engine_kwargs(args, model))
    t_ready = time.perf_counter()
    env = common.environment()
    vocab = llm.llm_engine.vocab_size
    if args.dataset == "random":
        in_lens = [args.input_len] * args.num_prompts
        out_lens = [args.output_len] * args.num_prompts
    else:
        in_lens, out_lens = common.synthetic_sharegpt(args.num_prompts, args.seed,
                                                      max_input=min(1024, llm.llm_engine.max_model_len // 2),
                                                      max_output=min(1024, llm.llm_engine.max_model_len // 2))
    prompts = [{"prompt_token_ids": p} for p in common.random_token_prompts(args.num_prompts, 0, vocab,
                                                                              args.seed, in_lens)]
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=args.temperature,
                             detokenize=not args.no_detokenize) for o in out_lens]
    if args.warmup_prompts:
        llm.generate(prompts[: args.warmup_prompts],
                     SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    runner = llm.llm_engine.runner
    compiled_before = len(runner._compiled)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t1
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = dict(
        env=env, engine=common.engine_summary(llm),
        workload=dict(dataset=args.dataset, num_prompts=args.num_prompts,
                      input_len=args.input_len if args.dataset == "random" else None,
                      output_len=args.output_len if args.dataset == "random" else None,
                      prompt_tokens=n_in, output_tokens=n_out, ignore_eos=True, temperature=args.temperature,
                      detokenize=not args.no_detokenize, model=args.model or args.shape or "demo",
                      load_format=args.load_format),
        time_to_ready_s=dict(llm_init=t_ready - t0, since_script_start=t_ready - T_START),
        elapsed_s=elapsed, requests_per_s=len(outs) / elapsed, total_tokens_per_s=(n_in + n_out) / elapsed,
        output_tokens_per_s=n_out / elapsed,
        compiles_during_run=len(runner._compiled) - compiled_before,
        compiles_after_warmup=runner.num_compiles_after_warmup,
    )
    print(f"Throughput: {res['requests_per_s']:.2f} requests/s, {res['total_tokens_per_s']:.2f} total tokens/s, "
          f"{res['output_tokens_per_s']:.2f} output tokens/s  ({len(outs)} requests, {elapsed:.1f} s; "
          f"ready in {t_ready - t0:.1f} s)", flush=True)
    if args.profile_dir:
        res["profile"] = profile_run(llm, prompts[: args.profile_prompts], args.profile_output_len, args.profile_dir)
    common.write_result("throughput", res, args.out)
    return res


def profile_run(llm, prompts, output_len: int, log_dir: str) -> dict:
    """Traces a short run (host tracer on, Python tracer off so host gaps are not inflated) and sums it up."""
    import jax

    from bench.profile_summary import summarize
    from jaxllm import SamplingParams

    sp = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # the same buckets, compiled, before the trace
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    t0 = time.perf_counter()
    with jax.profiler.trace(log_dir, profiler_options=opts):
        llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    summary = summarize(log_dir)
    summary.update(num_prompts=len(prompts), output_len=output_len, traced_wall_s=wall,
                   input_len=len(prompts[0]["prompt_token_ids"]) if prompts else 0)
    return summary


if __name__ == "__main__":
    main()
