"""HF transformers on the workloads of bench/latency.py and bench/throughput.py, each mode run the way the
transformers docs advise, on the same device in the same session: the peers the suite's ratios are taken against.

  python bench/hf_baseline.py --shape llama3-8b --batch1-input-len 128 --batch1-output-len 128 \\
      --input-len 462 --output-len 256 --cb-num-prompts 500 --out /tmp/hf.json

Rows (--modes, run in the order given; a mode that fails or is unavailable records its error and the others go on;
the JSON is rewritten after every row, so a killed run keeps the rows it finished):
  static          batch 1, generate(cache_implementation="static"): on CUDA, generate() compiles the decode step
                  itself (torch.compile, mode "reduce-overhead": CUDA graphs); --warmup runs are untimed
  eager           batch 1, generate() with the default dynamic cache (the suite's baseline until issue 37)
  cb              throughput, continuous batching with paged KV (the engine behind model.generate_batch), HF's own
                  choices: attention switched to flash if installed, else to "paged|<impl>" (paged|sdpa), CUDA
                  graphs off where an attention mask is needed (paged|sdpa)
  cb_graphs       the same with ContinuousBatchingConfig(use_cuda_graph=True)
  eager_batched   throughput, generate() on static batches of --batch-size, dynamic cache
  static_batched  the same with cache_implementation="static" (compiled decode at batch --batch-size)

Batch 1: decode tok/s = (output_len - 1) / (e2e - TTFT), the median over --runs generate() calls, each timed from
the call to its end (e2e) and to its first new token (TTFT, a streamer's second put: the first is the prompt). Throughput rows: requests/s and output tok/s over
their prompts. The cb rows run --cb-num-prompts prompts (a subset of the suite's 500 when time is short: fewer
requests batched together only makes paged|sdpa's masked attention cheaper per request), in one manager started
once, after --cb-warmup-prompts short requests through it (its set-up, graph capture and warm-up: setup_s).
transformers' ContinuousBatchingConfig is read from GenerationConfig no longer (5.13+): use_cuda_graph set on a
GenerationConfig is ignored; it goes in continuous_batching_config=. Same API in 5.17 (the lent image) and 5.24.

Weights are random (from_config, created directly on the device in --dtype); greedy; every sequence runs its full
length (min_new_tokens for generate(), eos_token_id=-1 for continuous batching).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

BATCH1_MODES = ("static", "eager")
THROUGHPUT_MODES = ("cb", "cb_graphs", "eager_batched", "static_batched")
MODES = BATCH1_MODES + THROUGHPUT_MODES
# Rough seconds of each mode for the 8B shapes on one H100 (for --budget): compiles and warm-up included.
EST_S = dict(static=90, eager=20, cb=70, cb_graphs=70, eager_batched=30, static_batched=80)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--shape", choices=sorted(common.SHAPES), default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--modes",
        default="static,cb,eager,static_batched,eager_batched,cb_graphs",
        help=f"comma-separated, from {','.join(MODES)}",
    )
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="static modes: disable_compile=True (CPU smoke tests; generate() compiles only on accelerators anyway)",
    )
    p.add_argument("--batch1-input-len", type=int, default=128)
    p.add_argument("--batch1-output-len", type=int, default=128)
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed batch-1 runs of the static mode (it compiles in the first; eager has one)",
    )
    p.add_argument("--runs", type=int, default=2, help="timed batch-1 runs of each mode")
    p.add_argument("--input-len", type=int, default=462)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64, help="the batched generate() modes")
    p.add_argument("--num-prompts", type=int, default=64, help="the batched generate() modes")
    p.add_argument("--cb-num-prompts", type=int, default=500)
    p.add_argument("--cb-warmup-prompts", type=int, default=8)
    p.add_argument("--cb-max-batch-tokens", type=int, default=None, help="default: HF's (from free memory)")
    p.add_argument("--cb-num-blocks", type=int, default=None, help="default: HF's (from free memory)")
    p.add_argument("--cb-page-size", type=int, default=None, help="default: HF's")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds: a mode whose usual time (8B shapes) no longer fits is skipped and said so",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; known: {list(MODES)}")
    return args


def build(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    dtype = getattr(torch, args.dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.shape:
        cfg = LlamaConfig(
            **{
                k: v
                for k, v in common.SHAPES[args.shape].items()
                if k not in ("architectures", "model_type", "torch_dtype", "transformers_version")
            }
        )
    else:
        cfg = AutoConfig.from_pretrained(common.resolve_model(args) or _demo())
    torch.manual_seed(args.seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return model, cfg, dev


def _demo():
    from jaxllm.demo import demo_model_path

    return str(demo_model_path())


class Prompts:
    """Random token-id prompts, seeded per mode, so a skipped or failed mode changes no other mode's prompts."""

    def __init__(self, vocab: int, seed: int, dev: str):
        self.vocab, self.seed, self.dev = vocab, seed, dev

    def lists(self, mode: str, n: int, length: int) -> list[list[int]]:
        return common.random_token_prompts(n, length, self.vocab, seed=self.seed + sum(map(ord, mode)))

    def tensor(self, mode: str, n: int, length: int):
        import torch

        return torch.tensor(self.lists(mode, n, length), device=self.dev)


class FirstToken:
    """A generate() streamer that notes when the first new token arrives (its first put is the prompt)."""

    def __init__(self):
        self.t_call: float | None = None  # set by generate() just before it calls model.generate
        self.puts: list[float] = []

    def put(self, value):
        self.puts.append(time.perf_counter())

    def end(self):
        pass

    @property
    def ttft(self) -> float:
        if len(self.puts) < 2:
            raise RuntimeError("the streamer saw no new token")
        return self.puts[1] - self.t_call


def _sync(dev: str) -> None:
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def generate(model, ids, new_tokens: int, static: bool, no_compile: bool, streamer=None) -> float:
    """One generate() call, greedy, exactly new_tokens new tokens; returns its wall seconds."""
    import torch

    kw = dict(cache_implementation="static", disable_compile=True if no_compile else None) if static else {}
    _sync(ids.device.type)
    t0 = time.perf_counter()
    if streamer is not None:
        streamer.t_call = t0
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
            **kw,
        )
    _sync(ids.device.type)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate() returned {out.shape[1] - ids.shape[1]} new tokens, not {new_tokens}")
    return time.perf_counter() - t0


def batch1_row(model, args, prompts: Prompts, mode: str) -> dict:
    """--runs timed generate() calls after the untimed warm-up ones (static: --warmup, which compile; eager: one).
    Each timed call carries the FirstToken streamer: generate() syncs on every step's stop check anyway, so
    the streamer adds one small copy per token."""
    static = mode == "static"
    ids = prompts.tensor(mode, 1, args.batch1_input_len)
    n = args.batch1_output_len
    t0 = time.perf_counter()
    warm = [generate(model, ids, n, static, args.no_compile) for _ in range(args.warmup if static else 1)]
    setup_s = time.perf_counter() - t0
    e2e, ttft = [], []
    for _ in range(args.runs):
        first = FirstToken()
        e2e.append(generate(model, ids, n, static, args.no_compile, streamer=first))
        ttft.append(first.ttft)
    decode = common.pct([(n - 1) / max(e - t, 1e-9) for e, t in zip(e2e, ttft, strict=True)], (50,))["p50"]
    return dict(
        kind="batch1",
        input_len=args.batch1_input_len,
        output_len=n,
        warmup_s=warm,
        setup_s=setup_s,
        e2e_s=e2e,
        ttft_s=common.pct(ttft, (50,))["p50"],
        ttft_runs_s=ttft,
        itl_s=1.0 / decode,
        decode_tok_per_s=decode,
        output_tok_per_s=n / common.pct(e2e, (50,))["p50"],
        cache_implementation="static" if static else "dynamic",
        compiled=static and not args.no_compile and getattr(model, "_compiled_call", None) is not None,
    )


def batched_row(model, args, prompts: Prompts, mode: str) -> dict:
    """--num-prompts prompts through generate() in static batches of --batch-size; the static mode first runs
    one untimed batch of the same shape (its compile and CUDA-graph capture)."""
    static = mode == "static_batched"
    sizes = [min(args.batch_size, args.num_prompts - i) for i in range(0, args.num_prompts, args.batch_size)]
    setup_s = 0.0
    if static:
        setup_s = generate(
            model, prompts.tensor("warmup_" + mode, sizes[0], args.input_len), args.output_len, True, args.no_compile
        )
    total = 0.0
    for i, b in enumerate(sizes):
        total += generate(
            model, prompts.tensor(f"{mode}{i}", b, args.input_len), args.output_len, static, args.no_compile
        )
    n = sum(sizes)
    return dict(
        kind="throughput",
        num_prompts=n,
        batch_size=args.batch_size,
        input_len=args.input_len,
        output_len=args.output_len,
        setup_s=setup_s,
        elapsed_s=total,
        requests_per_s=n / total,
        output_tokens_per_s=n * args.output_len / total,
        total_tokens_per_s=n * (args.input_len + args.output_len) / total,
        cache_implementation="static" if static else "dynamic",
        compiled=static and not args.no_compile and getattr(model, "_compiled_call", None) is not None,
    )


def cb_config(args, mode: str):
    from transformers import ContinuousBatchingConfig

    kw = dict(max_batch_tokens=args.cb_max_batch_tokens, num_blocks=args.cb_num_blocks)
    if args.cb_page_size:  # "block_size" until transformers 5.17, "page_size" after
        fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        kw["page_size" if "page_size" in fields else "block_size"] = args.cb_page_size
    if mode == "cb_graphs":
        kw["use_cuda_graph"] = True
    return ContinuousBatchingConfig(**kw)


def _run_requests(manager, inputs: list[list[int]], new_tokens: int, timeout_s: float) -> dict:
    """Adds the requests to a started manager and waits for all of them: request id -> GenerationOutput."""
    ids = manager.add_requests(inputs=inputs, max_new_tokens=new_tokens)
    done: dict = {}
    deadline = time.perf_counter() + timeout_s
    while len(done) < len(ids):
        r = manager.get_result(timeout=1)
        if r is None:
            if not manager.is_running():
                raise RuntimeError(
                    f"the continuous batching thread stopped with {len(ids) - len(done)} requests unfinished"
                )
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{len(ids) - len(done)} of {len(ids)} requests unfinished after {timeout_s} s")
            continue
        if r.is_finished():
            done[r.request_id] = r
    return done


def cb_row(model, args, prompts: Prompts, mode: str) -> dict:
    """Continuous batching as model.generate_batch() runs it (same context manager and workload hints), with the
    manager's set-up and a few warm-up requests kept out of the timed part."""
    from transformers import GenerationConfig

    inputs = prompts.lists(mode, args.cb_num_prompts, args.input_len)
    # eos_token_id=-1: no stop token, every request runs output_len tokens (HF's own "disabled" value).
    gen = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:  # the hints generate_batch() gives the manager (internal in 5.17 and 5.24; without them HF's defaults)
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(
            max_prompt_length=args.input_len, max_generated_length=args.output_len, num_requests=len(inputs)
        )
    except ImportError:
        hints = None
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen,
        continuous_batching_config=cb_config(args, mode),
        block=True,
        timeout=30,
        warmup=True,
        workload_hints=hints,
    ) as manager:
        attn = getattr(model.config, "_attn_implementation", None)  # switched for the manager's lifetime
        warm = prompts.lists("warmup_" + mode, args.cb_warmup_prompts, args.input_len)
        if warm:
            _run_requests(manager, warm, min(8, args.output_len), 600)
        setup_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        done = _run_requests(manager, inputs, args.output_len, 3600)
        elapsed = time.perf_counter() - t1
        resolved = _plain(vars(manager.continuous_batching_config))
        cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
        sizes = {k: getattr(cache, k, None) for k in ("num_blocks", "max_batch_tokens", "block_size")}
    failed = [r.error for r in done.values() if r.error]
    n_out = [len(r.generated_tokens) for r in done.values() if not r.error]
    ok = len(n_out)
    return dict(
        kind="throughput",
        num_prompts=len(inputs),
        input_len=args.input_len,
        output_len=args.output_len,
        setup_s=setup_s,
        elapsed_s=elapsed,
        completed=ok,
        failed=len(failed),
        errors=failed[:3],
        short_outputs=sum(x != args.output_len for x in n_out),
        requests_per_s=ok / elapsed,
        output_tokens_per_s=sum(n_out) / elapsed,
        total_tokens_per_s=(sum(n_out) + ok * args.input_len) / elapsed,
        attn_implementation=attn,
        cb_config=resolved,
        cache=sizes,
    )


def _plain(d: dict) -> dict:
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)[:200]
        for k, v in d.items()
        if not k.startswith("_")
    }


def strongest(rows: dict) -> dict:
    """The best batch-1 decode rate and the best requests/s among the rows that ran."""

    def best(kind, key):
        ok = {m: r for m, r in rows.items() if r.get("kind") == kind and key in r}
        if not ok:
            return None
        m = max(ok, key=lambda k: ok[k][key])
        return dict(mode=m, **{key: ok[m][key]})

    return dict(batch1=best("batch1", "decode_tok_per_s"), throughput=best("throughput", "requests_per_s"))


def main(argv=None) -> dict:
    args = parse(argv)
    t_start = time.perf_counter()
    import torch
    import transformers

    model, cfg, dev = build(args)
    prompts = Prompts(cfg.vocab_size, args.seed, dev)
    flash = {}
    try:
        from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

        flash = dict(flash_attn_2=is_flash_attn_2_available(), flash_attn_3=is_flash_attn_3_available())
    except ImportError:
        pass
    res = dict(
        env=dict(
            common.environment(with_jax=False),
            torch=torch.__version__,
            transformers=transformers.__version__,
            device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
            **flash,
        ),
        model=dict(
            shape=args.shape,
            model=args.model,
            dtype=args.dtype,
            attn_implementation=getattr(model.config, "_attn_implementation", None),
        ),
        load_s=time.perf_counter() - t_start,
        modes=args.modes,
        rows={},
        skipped={},
    )
    big = args.shape in ("llama3-8b", "llama3.1-8b")
    for mode in args.modes:
        left = None if args.budget is None else args.budget - (time.perf_counter() - t_start)
        if left is not None and left < (EST_S[mode] if big else 1):
            res["skipped"][mode] = f"needs ~{EST_S[mode] if big else 1} s, {max(left, 0):.0f} s of the budget left"
            print(f"HF {mode}: SKIPPED ({res['skipped'][mode]})", flush=True)
            continue
        fn = batch1_row if mode in BATCH1_MODES else cb_row if mode.startswith("cb") else batched_row
        t0 = time.perf_counter()
        try:
            row = fn(model, args, prompts, mode)
        except Exception as e:  # noqa: BLE001 - a mode this transformers or device lacks must not end the others
            row = dict(
                kind="batch1" if mode in BATCH1_MODES else "throughput",
                error=f"{type(e).__name__}: {str(e)[:500]}",
                traceback=traceback.format_exc()[-2000:],
            )
        finally:
            if dev == "cuda":  # what the mode left cached goes back before the next mode sizes its KV
                torch.cuda.empty_cache()
        row["mode_s"] = time.perf_counter() - t0
        res["rows"][mode] = row
        res["strongest"] = strongest(res["rows"])
        print(f"HF {mode}: {_line(row)}", flush=True)
        common.write_result("hf_baseline", res, args.out)
    res["strongest"] = strongest(res["rows"])
    res["wall_s"] = time.perf_counter() - t_start
    common.write_result("hf_baseline", res, args.out)
    return res


def _line(row: dict) -> str:
    if "error" in row:
        return f"ERROR {row['error']}"
    if row["kind"] == "batch1":
        return (
            f"{row['decode_tok_per_s']:.1f} decode tok/s (ITL {row['itl_s'] * 1e3:.2f} ms, TTFT "
            f"{row['ttft_s'] * 1e3:.0f} ms; compiled {row['compiled']}; set-up {row['setup_s']:.1f} s)"
        )
    return (
        f"{row['requests_per_s']:.2f} req/s, {row['output_tokens_per_s']:.1f} output tok/s over "
        f"{row['num_prompts']} prompts (set-up {row['setup_s']:.1f} s)"
    )


if __name__ == "__main__":
    main()
