"""Offline throughput, like `vllm bench throughput`: N prompts of random token ids through LLM.generate
with ignore_eos, so every request produces exactly its output length.

  python bench/throughput.py --shape llama3-8b --load-format dummy --num-prompts 500 --input-len 462 \\
      --output-len 256
  python bench/throughput.py --dataset synthetic-sharegpt --num-prompts 200      # demo model, length mix
  python bench/throughput.py --shape llama3-8b --load-format dummy --quantization gptq ...  # int4 g128 (or fp8)

Prints requests/s, total tok/s and output tok/s; the JSON also has the time to ready (LLM() built and every
shape bucket compiled), the engine's buckets and KV size, and compiles that happened during the timed run.
--profile-dir traces a short extra run (after the timed one) with jax.profiler and sums it up: by default
--profile-prompts prompts x --profile-output-len tokens; with --profile-window START:COUNT the timed workload
itself again, step by step, tracing only engine steps START..START+COUNT-1 (so a decode-heavy run is traced in
its real prefill/decode mix), e.g. for 500 x 462 / 256 at --max-num-seqs 512 (~285 steps, the first ~29 of them
chunked prefill), as bench/suite.py --profile passes it: 20 decode steps of all 500 sequences:
  python bench/throughput.py ... --profile-dir /tmp/prof --profile-window 147:20
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
    p.add_argument(
        "--warmup-prompts",
        type=int,
        default=0,
        help="run this many short requests before timing (with --enforce-eager: compiles buckets)",
    )
    p.add_argument("--profile-dir", default=None)
    p.add_argument("--profile-prompts", type=int, default=64)
    p.add_argument("--profile-output-len", type=int, default=16)
    p.add_argument(
        "--profile-window",
        type=_window,
        default=None,
        metavar="START:COUNT",
        help="with --profile-dir: re-run the timed workload and trace only engine steps "
        "START..START+COUNT-1 (0-based step() calls) instead of the --profile-prompts run",
    )
    args = p.parse_args(argv)
    if args.profile_window is not None and not args.profile_dir:
        p.error("--profile-window needs --profile-dir")
    return args


def _window(text: str) -> tuple[int, int]:
    try:
        start, count = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:COUNT (two integers), got {text!r}") from None
    if start < 0 or count < 1:
        raise argparse.ArgumentTypeError(f"START must be >= 0 and COUNT >= 1, got {text!r}")
    return start, count


def main(argv=None) -> dict:
    args = parse(argv)
    common.setup_logging(args.log_level)
    from jaxllm import SamplingParams

    llm, t0, t_ready = common.build_llm(args)
    env = common.environment()
    vocab = llm.llm_engine.vocab_size
    if args.dataset == "random":
        in_lens = [args.input_len] * args.num_prompts
        out_lens = [args.output_len] * args.num_prompts
    else:
        in_lens, out_lens = common.synthetic_sharegpt(
            args.num_prompts,
            args.seed,
            max_input=min(1024, llm.llm_engine.max_model_len // 2),
            max_output=min(1024, llm.llm_engine.max_model_len // 2),
        )
    prompts = [
        {"prompt_token_ids": p} for p in common.random_token_prompts(args.num_prompts, 0, vocab, args.seed, in_lens)
    ]
    params = [
        SamplingParams(max_tokens=o, ignore_eos=True, temperature=args.temperature, detokenize=not args.no_detokenize)
        for o in out_lens
    ]
    if args.warmup_prompts:
        llm.generate(prompts[: args.warmup_prompts], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    runner = llm.llm_engine.runner
    compiled_before = len(runner.programs.compiled)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t1
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = dict(
        env=env,
        engine=common.engine_summary(llm),
        workload=dict(
            dataset=args.dataset,
            num_prompts=args.num_prompts,
            input_len=args.input_len if args.dataset == "random" else None,
            output_len=args.output_len if args.dataset == "random" else None,
            prompt_tokens=n_in,
            output_tokens=n_out,
            ignore_eos=True,
            temperature=args.temperature,
            detokenize=not args.no_detokenize,
            model=args.model or args.shape or "demo",
            load_format=args.load_format,
            quantization=args.quantization,
        ),
        time_to_ready_s=dict(llm_init=t_ready - t0, since_script_start=t_ready - T_START),
        elapsed_s=elapsed,
        requests_per_s=len(outs) / elapsed,
        total_tokens_per_s=(n_in + n_out) / elapsed,
        output_tokens_per_s=n_out / elapsed,
        compiles_during_run=len(runner.programs.compiled) - compiled_before,
        compiles_after_warmup=runner.programs.num_compiles_after_warmup,
    )
    print(
        f"Throughput: {res['requests_per_s']:.2f} requests/s, {res['total_tokens_per_s']:.2f} total tokens/s, "
        f"{res['output_tokens_per_s']:.2f} output tokens/s  ({len(outs)} requests, {elapsed:.1f} s; "
        f"ready in {t_ready - t0:.1f} s)",
        flush=True,
    )
    if args.profile_dir and args.profile_window is not None:
        res["profile"] = profile_window_run(llm, prompts, params, *args.profile_window, args.profile_dir)
        _print_window(res["profile"])
    elif args.profile_dir:
        res["profile"] = profile_run(llm, prompts[: args.profile_prompts], args.profile_output_len, args.profile_dir)
    common.write_result("throughput", res, args.out)
    return res


def profile_run(llm, prompts, output_len: int, log_dir: str, sequence: int = 0) -> dict:
    """Traces a short run (host tracer on, Python tracer off so host gaps are not inflated) and sums it up
    (sequence: also the first N kernels in launch order, profile_summary.summarize's)."""
    import jax

    from bench.profile_summary import summarize
    from jaxllm import SamplingParams

    sp = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # the same buckets, compiled, before the trace
    t0 = time.perf_counter()
    with jax.profiler.trace(log_dir, profiler_options=_trace_options()):
        llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    summary = summarize(log_dir, sequence=sequence)
    summary.update(
        num_prompts=len(prompts),
        output_len=output_len,
        traced_wall_s=wall,
        input_len=len(prompts[0]["prompt_token_ids"]) if prompts else 0,
    )
    return summary


def _trace_options():
    import jax

    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0  # host tracer stays on (its default level); the Python tracer would inflate gaps
    return opts


def _wait_for_device(engine) -> None:
    """Blocks until the step in flight (if any) and every KV write before it are done on the device."""
    import jax

    if engine._inflight is not None:
        jax.block_until_ready(engine._inflight.outputs)
    jax.block_until_ready(engine.runner.kv_caches)


def _decode_only(sched) -> bool:
    """The runner's decode variant: every scheduled chunk is one token."""
    return sched.num_batched_tokens == len(sched.scheduled)


def _step_kind(sched) -> dict:
    """What one dispatched step ran."""
    seqs = sched.scheduled
    n_prefill = sum(1 for s in seqs if s.is_prefill)
    kind = "decode_only" if _decode_only(sched) else "prefill_only" if n_prefill == len(seqs) else "mixed"
    return dict(
        kind=kind,
        num_seqs=len(seqs),
        num_tokens=sched.num_batched_tokens,
        num_prefill_chunks=n_prefill,
        num_preempted=len(sched.preempted),
    )


def profile_window_run(llm, prompts, params, start: int, count: int, log_dir: str) -> dict:
    """Runs the workload again (same prompts and sampling params) one engine step at a time, as LLM.generate
    does, and traces only steps start..start+count-1 (0-based step() calls) with the host tracer on and the
    Python tracer off. step() keeps one device step in flight, so before the trace starts the step in flight is
    waited for, and before it stops the last traced step is: the trace holds exactly the device work of the
    steps dispatched by the traced calls (and the host side of those calls: collecting and processing the
    previous step, scheduling, preparing and dispatching). Per traced step: what it ran (from the scheduler's
    output) and the host wall time of its step() call (which, pipelined, mostly waits for the previous step;
    the first traced call waits for nothing, the device having been drained before the trace)."""
    import jax

    from bench.profile_summary import summarize

    engine = llm.llm_engine
    runner = engine.runner
    bm = getattr(engine.scheduler, "block_manager", None)
    if bm is not None and bm.enable_prefix_caching:
        bm.reset_prefix_cache()  # the same prompts must be computed again, as in the timed run
    compiled_before = len(runner.programs.compiled)
    ids = llm._add(prompts, params, None)
    done: dict = {}
    kinds: list[bool | None] = []  # per step() call: decode-only step dispatched (None: nothing dispatched)
    walls: list[float] = []  # per step() call, seconds
    traced: list = []  # (call index, SchedulerOutput or None) of the traced calls; summed up after the trace

    def step() -> None:
        t = time.perf_counter()
        llm._step(ids, done)
        walls.append(time.perf_counter() - t)
        h = engine._inflight
        kinds.append(None if h is None else _decode_only(h.sched))

    t_run = time.perf_counter()
    while engine.has_unfinished_requests() and len(walls) < start:
        step()
    traced_wall = drain = None
    if len(walls) == start and engine.has_unfinished_requests():
        _wait_for_device(engine)
        with jax.profiler.trace(log_dir, profiler_options=_trace_options()):
            t0 = time.perf_counter()
            while engine.has_unfinished_requests() and len(walls) < start + count:
                step()
                traced.append((len(walls) - 1, engine._inflight.sched if engine._inflight is not None else None))
            t1 = time.perf_counter()
            _wait_for_device(engine)
            t2 = time.perf_counter()
            traced_wall, drain = t2 - t0, t2 - t1
    while engine.has_unfinished_requests():
        step()
    rerun_wall = time.perf_counter() - t_run

    if not traced:
        summary: dict = {"error": f"the run had {len(walls)} engine steps, none in the window {start}:{count}"}
    else:
        summary = summarize(log_dir)
    rows = []
    for i, sched in traced:
        row = dict(step=i, wall_ms=walls[i] * 1e3)
        row.update(_step_kind(sched) if sched is not None else dict(kind="none", num_seqs=0, num_tokens=0))
        rows.append(row)
    by_kind = {k: sum(r["kind"] == k for r in rows) for k in ("decode_only", "mixed", "prefill_only", "none")}
    in_window = set(range(start, start + count))
    untraced_decode = [
        w
        for i, (w, k) in enumerate(zip(walls, kinds))
        if k and i not in in_window and i - 1 not in in_window and i != start + count
    ]  # not the calls next to the trace
    traced_decode = [walls[i] for i, _ in traced if kinds[i]]
    outs = [done[i] for i in ids if i in done]
    summary.update(
        mode="window",
        window=dict(start=start, count=count),
        traced_steps=len(rows),
        decode_only_steps=by_kind["decode_only"],
        mixed_steps=by_kind["mixed"],
        prefill_only_steps=by_kind["prefill_only"],
        empty_steps=by_kind["none"],
        traced_wall_s=traced_wall,
        final_wait_ms=None if drain is None else drain * 1e3,
        traced_mean_seqs=sum(r["num_seqs"] for r in rows) / len(rows) if rows else None,
        traced_mean_tokens=sum(r["num_tokens"] for r in rows) / len(rows) if rows else None,
        steps=rows,
        run=dict(
            total_steps=len(walls),
            decode_only_steps=sum(1 for k in kinds if k),
            other_steps=sum(1 for k in kinds if k is False),
            wall_s=rerun_wall,
            median_decode_only_step_ms_untraced=_median_ms(untraced_decode),
            median_decode_only_step_ms_traced=_median_ms(traced_decode),
            num_requests=len(outs),
            output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
            compiles=len(runner.programs.compiled) - compiled_before,
            note="step wall = host time of one step() call; pipelined, it mostly waits for the step "
            "dispatched by the call before",
        ),
        num_prompts=len(prompts),
        log_dir=log_dir,
    )
    return summary


def _median_ms(seconds: list[float]) -> float | None:
    p50 = common.pct(seconds, (50,))["p50"]
    return None if p50 is None else p50 * 1e3


def _print_window(p: dict) -> None:
    if p.get("error"):
        print(f"Profile window: {p['error']}", flush=True)
        return
    busy = [d.get("busy_fraction") for d in p.get("devices", []) if d.get("busy_fraction") is not None]
    print(
        f"Profile window {p['window']['start']}:{p['window']['count']} of {p['run']['total_steps']} steps: "
        f"{p['traced_steps']} traced ({p['decode_only_steps']} decode-only, {p['mixed_steps']} mixed, "
        f"{p['prefill_only_steps']} prefill-only; {p['traced_mean_seqs']:.0f} seqs / "
        f"{p['traced_mean_tokens']:.0f} tokens a step) in {p['traced_wall_s'] * 1e3:.1f} ms"
        + (f"; device busy {busy[0]:.1%}" if busy else ""),
        flush=True,
    )


if __name__ == "__main__":
    main()
