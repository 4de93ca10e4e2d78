"""The stall a request with non-default sampler flags causes the first time it meets a shape bucket.

Start-up compiles every bucket for the plain sampler (temperature, min_p, seeds). A request that needs top-p /
top-k, penalties, logit biases or logprobs used to compile a whole step program for its flags on first use,
and every running request waited for it. Now (runner.programs.split_sampler) such steps run the bucket's start-up
program and a sampler-only program (compiled on first use; small) while the step program compiles in the
background. For each setting this times a batch-1 request of --output-len tokens (it meets the compiles), the
wait for the background compiles after it, and the same request again (the step programs); then, with
split_sampler off (the old way: the step compiles before the step runs), the same for three other flag
combinations (other programs, so they compile too), in one process:

  python bench/first_use.py --shape llama3-8b --load-format dummy --dtype bfloat16 --max-model-len 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

SETTINGS = {  # split sampler
    "top_p_top_k": dict(temperature=0.8, top_p=0.9, top_k=50),
    "penalties": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3),
    "logprobs": dict(temperature=0.8, logprobs=5),
}
WHOLE_SETTINGS = {  # split sampler off: other flag combinations, so their step programs are not compiled yet
    "top_p_logprobs": dict(temperature=0.8, top_p=0.9, logprobs=5),
    "penalties_top_k": dict(temperature=0.8, presence_penalty=0.5, top_k=50),
    "penalties_logprobs": dict(temperature=0.8, frequency_penalty=0.3, logprobs=5),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    return p.parse_args(argv)


def timed(llm, prompt, sp) -> dict:
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    e2e = time.perf_counter() - t0
    m = out.metrics
    return dict(e2e_s=e2e, ttft_s=m.first_token_time - m.arrival_time, tokens=len(out.outputs[0].token_ids))


def main(argv=None) -> dict:
    args = parse(argv)
    common.setup_logging(args.log_level)
    from jaxllm import SamplingParams

    llm, t0, t_ready = common.build_llm(args)
    runner = llm.llm_engine.runner
    prompt = common.random_token_prompts(1, args.input_len, llm.llm_engine.vocab_size, args.seed)[0]
    base = dict(max_tokens=args.output_len, ignore_eos=True, seed=0)
    rows = [
        dict(
            mode="plain",
            setting="temperature",
            first=timed(llm, prompt, SamplingParams(**base)),
            again=timed(llm, prompt, SamplingParams(**base)),
        )
    ]
    for split, settings in ((True, SETTINGS), (False, WHOLE_SETTINGS)):
        runner.programs.split_sampler = split
        for name, kw in settings.items():
            sp = SamplingParams(**base, **kw)
            n_steps, n_samplers = len(runner.programs.compiled), len(runner.programs.samplers)
            first = timed(llm, prompt, sp)
            t0 = time.perf_counter()
            runner.programs.wait_for_background_compiles()
            wait = time.perf_counter() - t0
            again = timed(llm, prompt, sp)
            rows.append(
                dict(
                    mode="split_sampler" if split else "whole_step",
                    setting=name,
                    first=first,
                    background_wait_s=wait,
                    again=again,
                    stall_s=first["e2e_s"] - again["e2e_s"],
                    step_programs_compiled=len(runner.programs.compiled) - n_steps,
                    sampler_programs_compiled=len(runner.programs.samplers) - n_samplers,
                )
            )
            print(
                f"{rows[-1]['mode']:>13} {name:>18}: first {first['e2e_s']:.2f} s (TTFT {first['ttft_s']:.2f} s), "
                f"background wait after it {wait:.2f} s, again {again['e2e_s']:.2f} s; compiled "
                f"{rows[-1]['step_programs_compiled']} step / {rows[-1]['sampler_programs_compiled']} sampler "
                "programs",
                flush=True,
            )
    res = dict(
        env=common.environment(),
        engine=common.engine_summary(llm),
        ready_s=t_ready - t0,
        workload=dict(input_len=args.input_len, output_len=args.output_len, batch=1),
        rows=rows,
    )
    common.write_result("first_use", res, args.out)
    return res


if __name__ == "__main__":
    main()
