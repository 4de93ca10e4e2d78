"""Tensor / pipeline parallelism on several GPUs: greedy tokens at each (tp, pp) equal tp=1, and throughput.

    python bench/parallel.py --shape llama3-8b --load-format dummy --layouts 1x1 2x1 1x2

Each layout builds the same dummy weights (same seed; jax's random bits do not depend on the sharding), runs
the same greedy prompts (float32 by default, so reduction-order differences cannot flip a near tie as easily
as in bf16) and then a throughput workload in --throughput-dtype. The tp=1 run is the baseline of the same run.
"""

from __future__ import annotations

import argparse
import gc
import time

from common import (
    add_model_args,
    engine_kwargs,
    engine_summary,
    environment,
    make_model_dir,
    random_token_prompts,
    setup_logging,
    write_result,
)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"], help="TPxPP, the first is the baseline")
    p.add_argument("--greedy-dtype", default="float32")
    p.add_argument("--throughput-dtype", default="bfloat16")
    p.add_argument("--num-greedy", type=int, default=8)
    p.add_argument("--greedy-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--skip-greedy", action="store_true", help="throughput only")
    return p.parse_args(argv)


def run_layout(args, model, tp, pp, dtype, prompts, output_len):
    from jaxllm import LLM, SamplingParams

    kw = engine_kwargs(args, model) | dict(dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    ready = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # Warm-up: the same workload once, so lazily compiled buckets (enforce_eager) stay out of the timing.
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    secs = time.perf_counter() - t0
    summary = engine_summary(llm)
    del llm
    gc.collect()
    tokens = [o.outputs[0].token_ids for o in outs]
    return tokens, dict(ready_s=ready, seconds=secs, output_tok_s=len(prompts) * output_len / secs, engine=summary)


def main(argv=None):
    args = parse(argv)
    setup_logging(args.log_level)
    model = make_model_dir(args.shape) if args.shape else args.model
    from jaxllm.config import ModelConfig

    vocab = ModelConfig.from_hf(model).vocab_size
    greedy_prompts = random_token_prompts(args.num_greedy, 64, vocab, seed=1)
    tp_prompts = random_token_prompts(args.num_prompts, args.input_len, vocab, seed=2)
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts]
    result = dict(env=environment(), workload=vars(args) | {"model": model}, layouts={})
    base_tokens = None
    for tp, pp in layouts:
        name = f"tp{tp}_pp{pp}"
        entry = {}
        if not args.skip_greedy:
            tokens, g = run_layout(args, model, tp, pp, args.greedy_dtype, greedy_prompts, args.greedy_len)
            base_tokens = tokens if base_tokens is None else base_tokens
            entry = dict(
                greedy_equal_to_baseline=tokens == base_tokens,
                greedy=g,
                first_divergence=[
                    next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(tokens, base_tokens)
                ],
            )
        _, t = run_layout(args, model, tp, pp, args.throughput_dtype, tp_prompts, args.output_len)
        result["layouts"][name] = entry | dict(throughput=t)
        print(
            f"{name}: greedy equal={entry.get('greedy_equal_to_baseline')} "
            f"first_diff={entry.get('first_divergence')} throughput {t['output_tok_s']:.0f} out tok/s "
            f"(ready {t['ready_s']:.0f} s)",
            flush=True,
        )
    write_result("parallel", result, args.out)
    return result


if __name__ == "__main__":
    main()
