"""Does pipeline parallelism overlap its stages? Times one prefill-heavy step through PipelineExecutor with 1,
2 and 4 micro-batches. With pp stages and M micro-batches a GPipe schedule takes (M + pp - 1) / (M * pp) of
the one-micro-batch time if stages really run concurrently (pp=2: 0.75 at M=2, 0.625 at M=4); without
overlap the ratio stays >= 1.

    python bench/pipeline_overlap.py --shape llama3-8b --load-format dummy --pp 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from common import add_model_args, engine_kwargs, environment, make_model_dir, setup_logging, write_result


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    setup_logging(args.log_level)
    import jax

    from jaxllm import LLM
    from jaxllm.engine.inputs import SeqChunk, build_step_inputs
    from jaxllm.models.attention import AttentionMetadata

    model = make_model_dir(args.shape) if args.shape else args.model
    n_tok = args.num_seqs * args.seq_len
    kw = engine_kwargs(args, model) | dict(
        pipeline_parallel_size=args.pp, max_num_batched_tokens=n_tok, max_num_seqs=args.num_seqs, enforce_eager=True
    )
    llm = LLM(model, **kw)
    runner = llm.llm_engine.runner
    pipe = runner.pipeline
    S = runner.block_size
    pages = args.seq_len // S + 1
    rng = np.random.default_rng(0)
    chunks = [
        SeqChunk(list(rng.integers(0, 1000, args.seq_len)), 0, list(range(1 + i * pages, 1 + (i + 1) * pages)))
        for i in range(args.num_seqs)
    ]
    inp = build_step_inputs(chunks, S, n_tok, args.num_seqs, runner.max_pages, 0)
    meta = AttentionMetadata(
        inp.positions, inp.slot_mapping, inp.seq_lens, inp.query_start_loc, inp.block_tables, False
    )
    src = np.full(n_tok, -1, np.int32)
    times = {}
    for m in args.microbatches:
        pipe.num_microbatches = m
        samples = []
        for i in range(args.repeats + 2):  # two warm-up runs compile this micro-batch shape
            t0 = time.perf_counter()
            runner.kv_caches, hidden = pipe.forward(runner.kv_caches, inp.token_ids, src, meta, runner.prev_tokens)
            jax.block_until_ready(hidden)
            if i >= 2:
                samples.append(time.perf_counter() - t0)
        times[m] = float(np.median(samples))
        print(
            f"micro-batches {m}: {times[m] * 1e3:.1f} ms (ratio to 1: {times[m] / times[args.microbatches[0]]:.3f}, "
            f"ideal with overlap {(m + args.pp - 1) / (m * args.pp):.3f})",
            flush=True,
        )
    result = dict(
        env=environment(),
        workload=vars(args) | {"model": model, "tokens": n_tok},
        step_seconds=times,
        ratio_to_1=({m: t / times[args.microbatches[0]] for m, t in times.items()}),
        ideal_ratio_with_overlap={m: (m + args.pp - 1) / (m * args.pp) for m in times},
    )
    write_result("pipeline_overlap", result, args.out)
    return result


if __name__ == "__main__":
    main()
