"""Speculative decoding: the verify step's cost, measured acceptance, and the projected speed-up.

  python bench/spec_decode.py --out $OUT/spec_decode.json                       # GPU: all three parts (~3-4 min)
  python bench/spec_decode.py --parts accept --accept-tokens 64                 # acceptance only (any device)

(a) verify: on --shape (the Llama-3-8B shape, dummy weights) one runner times, for each batch B, the plain decode
    step (B sequences, one token each: the baseline, same run) and the speculative step verifying k proposals per
    sequence (B * (k + 1) tokens, logits at every position, the rejection sampler), k in --ks, at --context
    tokens of context. Every (B, k) program and the plain decodes are compiled first, in parallel (the engine's
    start-up compile path, StepPrograms.compile_variants); then a step is prepared once and run --iters times
    (each waits for its results, as the engine does when it speculates); ms per step is the median.
(b) accept: the demo model (SmolLM2-135M-Instruct, LLM() with no model) with n-gram prompt lookup on
    input-grounded chat prompts (repeat / edit / extract from a given text), greedy, against the same engine
    without speculation: outputs must be identical; reported are the mean acceptance length (tokens per verified
    sequence step), the per-position acceptance rates, E (output tokens per decode step of a sequence, counting
    steps whose sequence had no proposal) and tok/s of both engines on this device. Skipped, with the reason in
    the JSON, where the demo model is not installed.
(c) projection: E(k) = 1 + sum of the per-position acceptance rates of the first k positions (from (b), or
    --acceptance-json of an earlier run), speed-up(B, k) = E(k) * t_plain(B) / t_spec(B, k), the best k per
    batch and the largest batch where the best speed-up is above 1 (where the engine's switch-off should sit).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

TEXT = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
    "members agreed to move the reading room to the second floor, to extend the opening hours on weekends, "
    "and to buy three hundred new books for the children's section. The final report will be published "
    "next month on the town's website."
)
PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Rewrite the following text, replacing 'library' with 'museum' and changing nothing else:\n\n{TEXT}",
    f"Fix the spelling in this text and return it in full: {TEXT.replace('the', 'teh')}",
    f"Copy the sentences of this text that mention a number:\n\n{TEXT}",
]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="verify,accept", help="comma list of verify, accept (the projection follows)")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(common.SHAPES))
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--accept-k", type=int, default=8, help="proposals per step in the acceptance run")
    p.add_argument("--accept-tokens", type=int, default=200, help="max_tokens of each acceptance prompt")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument(
        "--acceptance-json",
        default=None,
        help="(b)'s per-position rates from this JSON when this run has none (demo model not installed)",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--compilation-cache-dir", default="")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _sequences(B: int, context: int, block_size: int, num_blocks: int):
    from jaxllm.engine.sequence import Sequence, SequenceStatus

    pages = -(-(context + 16) // block_size)
    seqs = []
    for i in range(B):
        seq = Sequence(f"b{i}", [100 + (7 * i + j) % 1000 for j in range(context)])
        seq.status = SequenceStatus.RUNNING
        seq.block_table = [1 + (i * pages + j) % (num_blocks - 1) for j in range(pages)]
        seqs.append(seq)
    return seqs


def time_step(runner, B: int, k: int, context: int, iters: int) -> float:
    """Median ms of one step of B decodes at `context` tokens, each verifying k proposals (k = 0: plain)."""
    import numpy as np

    from jaxllm.engine.scheduler import ScheduledSeq, SchedulerOutput

    runner.programs.num_spec = k  # the verify program for this k (its variants carry it) compiles on first use
    scheduled = []
    for seq in _sequences(B, context, runner.block_size, runner.num_blocks):
        props = [200 + j for j in range(k)]
        seq.num_computed_tokens, seq.num_pending = context + k, 1
        scheduled.append(ScheduledSeq(seq, context - 1, 1 + k, True, [seq.prompt_token_ids[-1]] + props, props))
    sched = SchedulerOutput(scheduled=scheduled, num_batched_tokens=B * (1 + k))
    p = runner.prepare(sched)
    runner.collect(runner.launch(p))  # compiles
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        runner.collect(runner.launch(p))
        times.append(time.perf_counter() - t)
    runner.batch.release([s.seq.seq_id for s in scheduled])
    return float(np.median(times) * 1e3)


def _grid_variants(runner, batches, ks):
    """The plain decode and verify programs of the grid (the buckets prepare() picks for them)."""
    from jaxllm.engine.inputs import bucket
    from jaxllm.engine.programs import StepVariant
    from jaxllm.engine.sampler import SamplerFlags

    programs, out = runner.programs, []
    for B in batches:
        b = bucket(B, runner.seq_buckets)
        out.append(StepVariant(b, b, True, SamplerFlags(), 0))
        for k in ks:
            programs.num_spec = k
            out.append(programs.spec_variant(b, SamplerFlags()))
    return list(dict.fromkeys(out))


def part_verify(args) -> dict:
    from jaxllm import LLM

    ks = [int(x) for x in args.ks.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    max_b = max(batches)
    blocks = max_b * (-(-(args.context + 16) // 16)) + 2
    llm = LLM(
        common.make_model_dir(args.shape),
        load_format="dummy",
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.context + 64,
        max_num_seqs=max(max_b, 2),
        max_num_batched_tokens=max(max_b * (max(ks) + 1), 16),
        num_gpu_blocks_override=blocks,
        enable_prefix_caching=False,
        compilation_cache_dir=args.compilation_cache_dir or None,
        speculative_config={"method": "ngram", "num_speculative_tokens": max(ks)},
    )
    runner = llm.llm_engine.runner
    t0 = time.perf_counter()
    variants = _grid_variants(runner, batches, ks)
    runner.programs.compile_variants(runner.params, runner.prev_tokens, variants=variants)
    compile_s = time.perf_counter() - t0
    print(f"{len(variants)} programs compiled in {compile_s:.1f} s", flush=True)
    rows = []
    for B in batches:
        plain = time_step(runner, B, 0, args.context, args.iters)
        row = dict(batch=B, plain_ms=plain, spec_ms={})
        for k in ks:
            row["spec_ms"][str(k)] = time_step(runner, B, k, args.context, args.iters)
        print(
            f"B={B}: plain {plain:.3f} ms; verify " + ", ".join(f"k={k} {v:.3f}" for k, v in row["spec_ms"].items()),
            flush=True,
        )
        rows.append(row)
    del llm
    return dict(shape=args.shape, context=args.context, iters=args.iters, compile_s=compile_s, rows=rows)


def _accept_run(llm, prompts, max_tokens):
    from jaxllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    t = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp, use_tqdm=False)
    return outs, time.perf_counter() - t


def part_accept(args) -> dict:
    from jaxllm import LLM
    from jaxllm.demo import DemoModelUnavailable

    kw = dict(enforce_eager=True, compilation_cache_dir=args.compilation_cache_dir or None, max_model_len=1024)
    spec_cfg = {
        "method": "ngram",
        "num_speculative_tokens": args.accept_k,
        "disable_by_batch_size": 2,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    try:
        plain = LLM(**kw)
    except DemoModelUnavailable as e:
        return dict(skipped=str(e))
    rows = []
    for prompt in PROMPTS:  # batch 1, one request at a time (the latency case speculation is for)
        _accept_run(plain, [prompt], 8)  # warm the buckets
        outs, secs = _accept_run(plain, [prompt], args.accept_tokens)
        rows.append(dict(prompt=prompt[:60], plain_tokens=outs[0].outputs[0].token_ids, plain_s=secs))
    del plain
    spec = LLM(**kw, speculative_config=spec_cfg)
    stats = spec.llm_engine.scheduler.spec_stats
    tot = dict(tokens=0, decode_steps=0, plain_s=0.0, spec_s=0.0)
    for row, prompt in zip(rows, PROMPTS, strict=True):
        _accept_run(spec, [prompt], 8)
        d0, a0 = stats.num_drafts, stats.num_accepted_tokens
        outs, secs = _accept_run(spec, [prompt], args.accept_tokens)
        toks = outs[0].outputs[0].token_ids
        accepted = stats.num_accepted_tokens - a0
        row.update(
            identical=toks == row.pop("plain_tokens"),
            spec_s=secs,
            tokens=len(toks),
            drafts=stats.num_drafts - d0,
            accepted=accepted,
            decode_steps=len(toks) - 1 - accepted,
        )  # the first token comes from the prefill
        tot["tokens"] += len(toks) - 1
        tot["decode_steps"] += row["decode_steps"]
        tot["plain_s"] += row["plain_s"]
        tot["spec_s"] += secs
        print(
            f"{row['prompt']!r}: {len(toks)} tokens, identical={row['identical']}, {row['drafts']} drafts, "
            f"{accepted} accepted, {row['decode_steps']} decode steps",
            flush=True,
        )
    per_pos = [n / max(stats.num_drafts, 1) for n in stats.num_accepted_tokens_per_pos]
    return dict(
        k=args.accept_k,
        prompt_lookup=[args.prompt_lookup_min, args.prompt_lookup_max],
        rows=rows,
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        mean_acceptance_length=1 + stats.num_accepted_tokens / max(stats.num_drafts, 1),
        per_position_acceptance=per_pos,
        draft_fraction=stats.num_drafts / max(tot["decode_steps"], 1),
        tokens_per_decode_step=tot["tokens"] / max(tot["decode_steps"], 1),
        all_identical=all(r["identical"] for r in rows),
        tok_per_s_plain=tot["tokens"] / tot["plain_s"],
        tok_per_s_spec=tot["tokens"] / tot["spec_s"],
    )


def project(verify: dict, accept: dict) -> dict:
    """Speed-up(B, k) = E(k) * t_plain(B) / t_spec(B, k) with E(k) = 1 + draft_fraction * sum of the first k
    per-position acceptance rates (a sequence step without a proposal emits one token at the spec cost)."""
    rates, frac = accept["per_position_acceptance"], accept.get("draft_fraction", 1.0)
    table, best = [], []
    for row in verify["rows"]:
        sp = {}
        for k, t in row["spec_ms"].items():
            e = 1 + frac * sum(rates[: int(k)])
            sp[k] = e * row["plain_ms"] / t
        k_best = max(sp, key=sp.get)
        table.append(dict(batch=row["batch"], speedup=sp))
        best.append(
            dict(
                batch=row["batch"],
                k=int(k_best),
                speedup=sp[k_best],
                tok_per_s_plain=row["batch"] * 1e3 / row["plain_ms"],
                tok_per_s_spec=row["batch"] * 1e3 / row["plain_ms"] * sp[k_best],
            )
        )
    paying = [b["batch"] for b in best if b["speedup"] > 1.0]
    return dict(table=table, best=best, largest_paying_batch=max(paying) if paying else 0)


def main(argv=None) -> dict:
    args = parse(argv)
    common.setup_logging("warning")
    parts = args.parts.split(",")
    res = dict(env=common.environment())
    if "verify" in parts:
        res["verify"] = part_verify(args)
    if "accept" in parts:
        res["accept"] = part_accept(args)
    accept = res.get("accept")
    if args.acceptance_json and not (accept and "per_position_acceptance" in accept):  # this run's, if it has one
        with open(args.acceptance_json) as f:
            accept = json.load(f)["accept"]
    if "verify" in res and accept and "per_position_acceptance" in accept:
        res["projection"] = proj = project(res["verify"], accept)
        for b in proj["best"]:
            print(f"B={b['batch']}: best k={b['k']} projected {b['speedup']:.2f}x", flush=True)
        print(f"speculation pays up to batch {proj['largest_paying_batch']}", flush=True)
    res["wall_s"] = time.perf_counter() - T_START
    common.write_result("spec_decode", res, args.out)
    return res


if __name__ == "__main__":
    main()
