"""Host overhead per engine step without a device: Scheduler.schedule() + ModelRunner.prepare() and
pack_host_args (the numpy half of execute) + Scheduler.update(), at N running sequences in steady decode.
Goal (issue 7): schedule + prepare <= 1 ms at 256 sequences.

  python bench/host_overhead.py --num-seqs 256 --context 512 --steps 200

The loop is the engine's, minus the device: step N+1 is scheduled and prepared before step N's tokens are
delivered (one-step lookahead), so every decode input is a device-pending token. The runner is built with a
tiny model config (its prepare() depends only on block size, max_model_len and the batch), on CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--context", type=int, default=512, help="prompt length of every sequence")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def build(args):
    import numpy as np

    from jaxllm.config import ModelConfig
    from jaxllm.engine.configs import CacheConfig, SchedulerConfig
    from jaxllm.engine.runner import ModelRunner
    from jaxllm.engine.scheduler import Scheduler
    from jaxllm.engine.sequence import Sequence
    from jaxllm.sampling_params import SamplingParams
    from jaxllm.sharding import ParallelConfig

    n, L = args.num_seqs, args.context
    blocks = n * (-(-(L + args.steps + args.warmup_steps + 2) // args.block_size)) + 2
    blocks = max(blocks, -(-args.max_model_len // args.block_size) + 1)  # the scheduler wants one full sequence
    cfg = ModelConfig.from_hf(dict(common.TINY, max_position_embeddings=args.max_model_len), dtype="float32")
    mesh = ParallelConfig(1, 1).make_mesh()
    runner = ModelRunner(
        cfg,
        None,
        mesh,
        num_blocks=blocks,
        block_size=args.block_size,
        max_num_seqs=n,
        max_num_batched_tokens=max(n * L, 2048),
        max_model_len=args.max_model_len,
    )
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=max(n * L, 2048), max_model_len=args.max_model_len),
        CacheConfig(block_size=args.block_size, num_blocks=blocks, enable_prefix_caching=True),
    )
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=args.temperature)
    for i in range(n):
        seq = Sequence(str(i), rng.integers(100, 500, L).tolist(), max_tokens=10**6, sampling_params=sp)
        seq.rng_seed, seq.bias_row = i, {}
        sched.add(seq)
    return sched, runner


def main(argv=None) -> dict:
    args = parse(argv)
    import numpy as np

    from jaxllm.engine.packing import pack_host_args

    sched, runner = build(args)
    # Prefill every sequence (one big step), deliver its tokens: from here on every step is a decode.
    out = sched.schedule()
    p = runner.prepare(out)
    runner.host.prev_rows = dict(p.sample_rows)
    sched.update(out, {sid: 1 for sid in p.sample_rows})
    t_sched, t_prep, t_upd = [], [], []
    prev, prev_rows = None, None
    for step in range(args.warmup_steps + args.steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        p = runner.prepare(out)
        p.packed or pack_host_args(p.host_args)  # (as the runner's launch: packed by prepare where it could)
        runner.host.prev_rows = dict(p.sample_rows)
        t2 = time.perf_counter()
        if prev is not None:
            sched.update(prev, {sid: 7 for sid in prev_rows})
        t3 = time.perf_counter()
        prev, prev_rows = out, p.sample_rows
        if step >= args.warmup_steps:
            t_sched.append(t1 - t0), t_prep.append(t2 - t1), t_upd.append(t3 - t2)
        assert p.variant.decode_only and len(out.scheduled) == args.num_seqs, (p.variant, len(out.scheduled))
    ms = lambda xs: {k: v * 1e3 for k, v in common.pct(xs).items()}  # noqa: E731
    total = np.asarray(t_sched) + np.asarray(t_prep)
    res = dict(
        env=common.environment(),
        workload=vars(args),
        schedule_ms=ms(t_sched),
        prepare_ms=ms(t_prep),
        update_ms=ms(t_upd),
        schedule_plus_prepare_ms=ms(total),
        goal_ms=1.0,
        met=bool(np.percentile(total, 50) * 1e3 <= 1.0),
    )
    print(
        f"{args.num_seqs} seqs: schedule {res['schedule_ms']['p50']:.3f} ms + prepare {res['prepare_ms']['p50']:.3f} ms"
        f" = {res['schedule_plus_prepare_ms']['p50']:.3f} ms p50 (goal <= 1 ms; update {res['update_ms']['p50']:.3f} ms)",
        flush=True,
    )
    common.write_result("host_overhead", res, args.out)
    return res


if __name__ == "__main__":
    main()
