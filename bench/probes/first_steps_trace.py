"""Finding: batch-1 TTFT is host-bound: dispatching a step takes 4-8 ms of host time under the tracer (the
CUDA-graph update alone 0.4-2.8 ms), and the first token is collected after the first decode step is dispatched
(HISTORY, batch-1 TTFT).

Where a batch-1 request's first token waits: a host + device trace of one short generate, after warm-up.

Builds the engine (--smallest-seq-bucket and --no-fused-decode override the engine's module settings, for
A/B runs in one call), runs --warm generates of one --input-len prompt and --output-len tokens untraced
(their TTFTs are reported), then traces one more with jax.profiler and keeps every host event of at least
--min-host-ms and the device's XLA module events, in time order from the trace's start.

  python bench/probes/first_steps_trace.py --shape llama3-8b --load-format dummy --dtype bfloat16 \\
      --max-model-len 1024 --max-num-seqs 512 --max-num-batched-tokens 8192 --out OUT.json [--smallest-seq-bucket 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import common  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=6)
    p.add_argument("--warm", type=int, default=6)
    p.add_argument("--min-host-ms", type=float, default=0.2)
    p.add_argument("--max-events", type=int, default=400)
    p.add_argument("--smallest-seq-bucket", type=int, default=None)
    p.add_argument("--no-fused-decode", action="store_true")
    args = p.parse_args(argv)
    import jax
    from jax.profiler import ProfileData

    import jaxllm.engine.runner as runner
    import jaxllm.models.attention as attention
    from bench.profile_summary import find_xplane
    from jaxllm import SamplingParams

    if args.smallest_seq_bucket is not None:
        runner.SMALLEST_SEQ_BUCKET = args.smallest_seq_bucket
    if args.no_fused_decode:
        attention.FUSED_DECODE = False
    common.setup_logging(args.log_level)
    llm, _, _ = common.build_llm(args)
    vocab = llm.llm_engine.vocab_size
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)

    def ttft_ms(seed):
        prompts = [{"prompt_token_ids": q} for q in common.random_token_prompts(1, args.input_len, vocab, seed)]
        m = llm.generate(prompts, sp, use_tqdm=False)[0].metrics
        return round((m.first_token_time - m.arrival_time) * 1e3, 2)

    untraced = [ttft_ms(i) for i in range(args.warm)]
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        traced = ttft_ms(99)
    rows = []
    for plane in ProfileData.from_file(find_xplane(d)).planes:
        device = plane.name.startswith("/device:")
        for line in plane.lines:
            for e in line.events:
                if (device and line.name == "XLA Modules") or (not device and e.duration_ns >= args.min_host_ms * 1e6):
                    rows.append((e.start_ns, e.duration_ns, plane.name[:14], line.name[:20], e.name[:70]))
    rows.sort()
    t0 = rows[0][0] if rows else 0
    res = dict(
        env=common.environment(),
        smallest_seq_bucket=runner.SMALLEST_SEQ_BUCKET,
        fused_decode=attention.FUSED_DECODE,
        ttft_ms_untraced=untraced,
        ttft_ms_traced=traced,
        events=[
            dict(t_ms=round((s - t0) / 1e6, 3), dur_ms=round(n / 1e6, 3), plane=pl, line=ln, name=nm)
            for s, n, pl, ln, nm in rows[: args.max_events]
        ],
    )
    keys = ("smallest_seq_bucket", "fused_decode", "ttft_ms_untraced", "ttft_ms_traced")
    print(json.dumps({k: res[k] for k in keys}))
    common.write_result("first_steps_trace", res, args.out)
    return res


if __name__ == "__main__":
    main()
