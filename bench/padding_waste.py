"""Where a throughput workload's device time can go, from its schedule alone: replays the engine's scheduler on
the workload without a model (CPU, seconds) and reports, per compiled step bucket, the steps, the real and
padded tokens and sequences, the dense FLOPs the padding costs, and a roofline time model of every step.

  python bench/padding_waste.py --out /tmp/pw.json          # 500 x 462 / 256 at the suite's engine flags
  python bench/padding_waste.py --dataset synthetic-sharegpt --num-prompts 500 --out /tmp/pw_sharegpt.json

Replay: the real Scheduler and BlockManager (prefix caching off, as the benchmark runs) driven as LLMEngine.step
drives them with async scheduling: step N+1 is scheduled before step N's tokens are delivered, and a sequence is
finished once it has its output length (ignore_eos). --num-blocks is the KV size of the H100 runs (27,270 pages
of 16). Each step's bucket is ModelRunner.prepare's (step_bucket below; tests check the two agree): a
decode-only step of n sequences runs B = T = the smallest sequence bucket >= n; a step with prompt tokens runs T
= the smallest token bucket >= its tokens and B = the smallest sequence bucket >= min(T, max_num_seqs).

FLOPs and bytes (bench/common.py ModelMath, the --shape's config): dense = 2 x matmul params per token computed
(T per step, so padding tokens cost as much as real ones) + 2 D V per logits row (B per step; a row that samples
nothing, i.e. padding or a prompt chunk that does not reach its end, is waste); causal attention of the real
chunks; KV bytes read = each chunk's context x KV bytes per token. Step time model (the ideal each step could
reach): max(dense FLOPs / matmul rate, weight bytes / bandwidth) + max(attention FLOPs / matmul rate, KV bytes /
bandwidth), at --matmul-tflops and --bandwidth-tbps (defaults: the H100's measured 687 TFLOP/s bf16 matmul and
2.6 TB/s XLA read+write copy, /work/shared/docs/gpu-findings.md). Against --measured-s (the same workload's
elapsed time on the device) the model says how far from its ideal the device ran; per bucket, the split says
whether bucket granularity, max_num_batched_tokens or the prefill / decode mix holds the time.

--variant NAME:KEY=VALUE,... replays the same workload with other scheduler limits or bucket lists (keys:
max_num_seqs, max_num_batched_tokens, seq_buckets, token_buckets; lists as 2/4/8, or "pow2"), one row each in
the comparison table.

What it found for 500 x 462 / 256 at the suite's flags (H100 rates above; run 35's profile of 20 decode steps):
padding is 1.6% of the dense FLOPs (0.11 s of the model's 11.44 s); the model is 89-90% of the measured 12.7-12.9 s,
and the traced decode steps run at 96% of it (GEMMs 699 TFLOP/s, attention 2.61 TB/s of KV). The schedule cannot
go below the dense FLOPs (7.48 s) plus the KV reads (9.9 TB, 3.80 s) while the two run one after the other: 44.3
req/s at these rates. The ShareGPT-like mix pads 12.9% (0.44 s of 8.95 s), most of it decode steps of 257-511
sequences in the 512 bucket; sequence buckets of 320 / 384 / 448 take the model to 8.65 s (bench/bucket_ab.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from jaxllm.engine import runner  # noqa: E402
from jaxllm.engine.configs import CacheConfig, SchedulerConfig  # noqa: E402
from jaxllm.engine.inputs import bucket  # noqa: E402
from jaxllm.engine.scheduler import Scheduler  # noqa: E402
from jaxllm.engine.sequence import Sequence, SequenceStatus  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(common.SHAPES), default="llama3-8b")
    p.add_argument("--dataset", choices=("random", "synthetic-sharegpt"), default="random")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=462)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=27270, help="KV pages (the H100 suite runs' 8B engine)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--matmul-tflops", type=float, default=687.0)
    p.add_argument("--bandwidth-tbps", type=float, default=2.6)
    p.add_argument(
        "--measured-s",
        type=float,
        default=None,
        help="the workload's elapsed seconds on the device, for the model's efficiency",
    )
    p.add_argument("--kv-itemsize", type=int, default=2, help="1: an fp8 KV cache")
    p.add_argument(
        "--profile-json",
        default=None,
        help="a bench/throughput.py (or suite.py) JSON whose profile "
        "window traced the same workload: its device time per kernel category against the model",
    )
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def step_bucket(num_tokens: int, num_seqs: int, token_buckets, seq_buckets) -> tuple[int, int, bool]:
    """(T, B, decode_only) of a step, as ModelRunner.prepare picks them."""
    if num_tokens == num_seqs:
        b = bucket(num_seqs, seq_buckets)
        return b, b, True
    t = bucket(max(num_tokens, num_seqs), token_buckets)
    return t, bucket(min(t, seq_buckets[-1]), seq_buckets), False


def default_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[tuple, tuple]:
    """The runner's (token, sequence) bucket lists for these limits."""
    seqs, tokens = runner.step_buckets(max_num_seqs, max_num_batched_tokens)
    return tokens, seqs


def workload(args) -> tuple[list[int], list[int]]:
    if args.dataset == "random":
        return [args.input_len] * args.num_prompts, [args.output_len] * args.num_prompts
    half = args.max_model_len // 2
    return common.synthetic_sharegpt(args.num_prompts, args.seed, max_input=min(1024, half), max_output=min(1024, half))


def replay(in_lens, out_lens, *, max_num_seqs, max_num_batched_tokens, max_model_len, num_blocks, block_size):
    """The engine's schedule for these requests: per dispatched step, its chunks as (start, num_tokens, sample)
    and the number of preemptions so far."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
        ),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False),
    )
    for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens, strict=True)):
        # Token ids only matter to prefix caching (off); arrival order = add order, as LLM.generate adds them.
        sched.add(Sequence(f"r{i}", [100 + (i + j) % 1000 for j in range(n_in)], max_tokens=n_out, arrival_time=0.0))
    steps, inflight = [], None
    while sched.has_unfinished() or inflight is not None:
        out = sched.schedule()
        if not out.is_empty:
            steps.append(([(s.start, s.num_tokens, s.sample) for s in out.scheduled], sched.num_preemptions))
        if inflight is not None:  # the previous step's tokens arrive after this step was scheduled
            for seq in sched.update(inflight, {s.seq.seq_id: 1 for s in inflight.scheduled if s.sample}):
                if len(seq.output_token_ids) >= seq.max_tokens:
                    sched.finish(seq.seq_id, SequenceStatus.FINISHED_LENGTH)
        elif out.is_empty and sched.has_unfinished():
            raise RuntimeError("the schedule stalled: nothing to run and no tokens in flight")
        inflight = None if out.is_empty else out
    return steps


def analyse(
    steps, math: common.ModelMath, token_buckets, seq_buckets, mm_rate: float, bw: float, window: range | None = None
) -> dict:
    """Per bucket totals and the step-time model (see the module docstring); window: only those steps."""
    rows: dict = collections.defaultdict(dict)
    kv_tok = math.kv_bytes_per_token
    for i, (chunks, _) in enumerate(steps):
        if window is not None and i not in window:
            continue
        n = len(chunks)
        n_tok = sum(c[1] for c in chunks)
        sampled = sum(c[2] for c in chunks)
        T, B, decode = step_bucket(n_tok, n, token_buckets, seq_buckets)
        attn = sum(math.attn_flops(c[1], c[0]) for c in chunks)
        kv = kv_tok * sum(c[0] + c[1] for c in chunks)
        dense_real = math.dense_flops(n_tok, sampled)
        dense_done = math.dense_flops(T, B)
        t_gemm = max(dense_done / mm_rate, math.weight_bytes / bw)
        t_gemm_real = max(dense_real / mm_rate, math.weight_bytes / bw)
        t_attn = max(attn / mm_rate, kv / bw)
        key = f"{B}x{T}{'d' if decode else ''}"
        _add(
            rows[key],
            dict(
                steps=1,
                tokens=n_tok,
                padded_tokens=T - n_tok,
                seqs=n,
                padded_seqs=B - n,
                sampled_rows=sampled,
                unsampled_rows=B - sampled,
                dense_flops=dense_real,
                dense_flops_computed=dense_done,
                attention_flops=attn,
                kv_bytes=kv,
                model_s=t_gemm + t_attn,
                model_gemm_s=t_gemm,
                model_attention_s=t_attn,
                padding_s=t_gemm - t_gemm_real,
            ),
        )
    order = sorted(rows, key=lambda k: (k.endswith("d"), -rows[k]["model_s"]))

    def summed(keys):
        out: dict = {}
        for k in keys:
            _add(out, rows[k])
        return _finish(out)

    return dict(
        total=summed(rows),
        decode_only=summed(k for k in rows if k.endswith("d")),
        with_prompt_tokens=summed(k for k in rows if not k.endswith("d")),
        per_bucket={k: _finish(dict(rows[k])) for k in order},
    )


def _add(into: dict, values: dict) -> None:
    for k, v in values.items():
        into[k] = into.get(k, 0) + v


def _finish(r: dict) -> dict:
    """Ratios of a bucket's (or a total's) sums."""
    if r.get("dense_flops_computed"):
        r["padding_flops_frac"] = 1 - r["dense_flops"] / r["dense_flops_computed"]
    if r.get("steps"):
        r["mean_tokens"] = r["tokens"] / r["steps"]
        r["mean_seqs"] = r["seqs"] / r["steps"]
        r["model_ms_per_step"] = r["model_s"] / r["steps"] * 1e3
    return r


def parse_variant(text: str, args) -> tuple[str, dict]:
    """NAME:key=value,... -> (name, replay + bucket settings) on top of args' own."""
    name, _, spec = text.partition(":")
    cfg = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seq_buckets="pow2",
        token_buckets="pow2",
    )
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in cfg:
            raise ValueError(f"--variant {text!r}: unknown key {key!r}; known: {sorted(cfg)}")
        cfg[key] = value if key.endswith("buckets") else int(value)
    return name, cfg


def run_variant(name: str, cfg: dict, args, in_lens, out_lens, math, mm_rate, bw) -> dict:
    tok_default, seq_default = default_buckets(cfg["max_num_seqs"], cfg["max_num_batched_tokens"])
    tok = tok_default if cfg["token_buckets"] == "pow2" else tuple(int(x) for x in cfg["token_buckets"].split("/"))
    seq = seq_default if cfg["seq_buckets"] == "pow2" else tuple(int(x) for x in cfg["seq_buckets"].split("/"))
    if tok[-1] < cfg["max_num_batched_tokens"] or seq[-1] < cfg["max_num_seqs"]:
        raise ValueError(f"variant {name}: the largest buckets ({tok[-1]}, {seq[-1]}) must cover the limits")
    t0 = time.perf_counter()
    steps = replay(
        in_lens,
        out_lens,
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
    )
    res = analyse(steps, math, tok, seq, mm_rate, bw)
    res["_steps"], res["_buckets"] = steps, (tok, seq)
    res.update(
        name=name,
        settings=dict(cfg, token_buckets=list(tok), seq_buckets=list(seq)),
        num_steps=len(steps),
        num_variants=len({k for k in res["per_bucket"]}),
        preemptions=steps[-1][1] if steps else 0,
        replay_s=time.perf_counter() - t0,
    )
    return res


def main(argv=None) -> dict:
    args = parse(argv)
    in_lens, out_lens = workload(args)
    math = common.ModelMath.from_config(common.SHAPES[args.shape], kv_itemsize=args.kv_itemsize)
    mm_rate, bw = args.matmul_tflops * 1e12, args.bandwidth_tbps * 1e12
    variants = [("engine", parse_variant("engine:", args)[1])] + [parse_variant(v, args) for v in args.variant]
    results = [run_variant(n, c, args, in_lens, out_lens, math, mm_rate, bw) for n, c in variants]
    base = results[0]
    t = base["total"]
    floor = dict(
        dense_flops=t["dense_flops"],
        dense_s=t["dense_flops"] / mm_rate,
        attention_flops=t["attention_flops"],
        kv_bytes=t["kv_bytes"],
        kv_s=t["kv_bytes"] / bw,
        weights_bytes_per_step=math.weight_bytes,
    )
    # Both totals are the workload's, whatever the schedule: every token's matmuls, and every decode reading its
    # whole context once. While a step's attention and its GEMMs run one after the other, their sum bounds it.
    floor.update(
        serial_s=floor["dense_s"] + floor["kv_s"],
        serial_requests_per_s=len(in_lens) / (floor["dense_s"] + floor["kv_s"]),
    )
    res = dict(
        env=common.environment(with_jax=False),
        workload=dict(
            dataset=args.dataset,
            num_prompts=len(in_lens),
            prompt_tokens=sum(in_lens),
            output_tokens=sum(out_lens),
            shape=args.shape,
        ),
        rates=dict(matmul_tflops=args.matmul_tflops, bandwidth_tbps=args.bandwidth_tbps),
        floor=floor,
        engine=base,
        variants={r["name"]: _brief(r) for r in results},
    )
    if args.measured_s:
        res["measured"] = dict(
            elapsed_s=args.measured_s,
            model_s=t["model_s"],
            model_over_measured=t["model_s"] / args.measured_s,
            requests_per_s=len(in_lens) / args.measured_s,
            model_requests_per_s=len(in_lens) / t["model_s"],
        )
    if args.profile_json:
        res["profile"] = against_profile(args.profile_json, base, math, mm_rate, bw)
    for r in results:
        del r["_steps"], r["_buckets"]
    print(report(res), flush=True)
    if args.out:
        common.write_result("padding_waste", res, args.out)
    return res


def against_profile(path: str, base: dict, math, mm_rate: float, bw: float) -> dict:
    """The traced window of a throughput run of this workload: its device time by kernel category against the
    model's time and FLOPs for the same steps (the replay's step i is the run's step() call i: checked on the
    traced steps' token and sequence counts)."""
    with open(path) as f:
        data = json.load(f)
    tp = data.get("stages", {}).get("throughput", data) if "stages" in data else data
    prof = (tp or {}).get("profile") or {}
    if not prof.get("steps") or not prof.get("devices"):
        return {"error": f"{path}: no profile window with per-step rows and a device plane"}
    steps = base["_steps"]
    idx = [r["step"] for r in prof["steps"] if r["kind"] != "none"]
    mismatch = [
        r["step"]
        for r in prof["steps"]
        if r["kind"] != "none"
        and (
            r["step"] >= len(steps)
            or len(steps[r["step"]][0]) != r["num_seqs"]
            or sum(c[1] for c in steps[r["step"]][0]) != r["num_tokens"]
        )
    ]
    model = analyse(steps, math, *base["_buckets"], mm_rate, bw, window=range(min(idx), max(idx) + 1))["total"]
    dev = prof["devices"][0]
    cat = dev.get("by_category_ms", {})
    gemm_ms = cat.get("gemm", 0.0)
    attn_ms = cat.get("decode_attention", 0.0) + cat.get("prefill_attention", 0.0)
    return dict(
        file=path,
        window=prof.get("window"),
        steps=len(idx),
        steps_not_matching_the_replay=mismatch,
        device_busy_ms=dev.get("busy_ms"),
        device_span_ms=dev.get("span_ms"),
        by_category_ms=cat,
        model_ms=model["model_s"] * 1e3,
        model_gemm_ms=model["model_gemm_s"] * 1e3,
        model_attention_ms=model["model_attention_s"] * 1e3,
        model_over_busy=model["model_s"] * 1e3 / dev["busy_ms"] if dev.get("busy_ms") else None,
        gemm_tflops=model["dense_flops_computed"] / (gemm_ms * 1e-3) / 1e12 if gemm_ms else None,
        gemm_frac_of_rate=model["dense_flops_computed"] / (gemm_ms * 1e-3) / mm_rate if gemm_ms else None,
        attention_tbps=model["kv_bytes"] / (attn_ms * 1e-3) / 1e12 if attn_ms else None,
        attention_tflops=model["attention_flops"] / (attn_ms * 1e-3) / 1e12 if attn_ms else None,
        other_ms=cat.get("other", 0.0) + cat.get("kv_write", 0.0) + cat.get("memcpy", 0.0),
    )


def _brief(r: dict) -> dict:
    t = r["total"]
    return dict(
        steps=r["num_steps"],
        variants=r["num_variants"],
        preemptions=r["preemptions"],
        model_s=t["model_s"],
        padding_s=t["padding_s"],
        padding_flops_frac=t["padding_flops_frac"],
        padded_tokens=t["padded_tokens"],
        padded_seqs=t["padded_seqs"],
        settings=r["settings"],
    )


def report(res: dict) -> str:
    e = res["engine"]
    lines = [
        f"{res['workload']['num_prompts']} prompts ({res['workload']['dataset']}), {e['num_steps']} steps, "
        f"{e['preemptions']} preemptions; model at {res['rates']['matmul_tflops']:.0f} TFLOP/s, "
        f"{res['rates']['bandwidth_tbps']:.2f} TB/s",
        f"{'bucket':>11} {'steps':>5} {'tok/step':>8} {'pad tok':>8} {'seq/step':>8} {'pad seq':>7} "
        f"{'pad FLOP':>8} {'ms/step':>8} {'model s':>8} {'attn s':>7} {'pad s':>6}",
    ]
    for k, r in list(e["per_bucket"].items()) + [("total", e["total"])]:
        lines.append(
            f"{k:>11} {r['steps']:>5} {r['mean_tokens']:>8.0f} {r['padded_tokens']:>8} "
            f"{r['mean_seqs']:>8.0f} {r['padded_seqs']:>7} {r.get('padding_flops_frac', 0):>8.1%} "
            f"{r['model_ms_per_step']:>8.2f} {r['model_s']:>8.3f} {r['model_attention_s']:>7.3f} "
            f"{r['padding_s']:>6.3f}"
        )
    f = res["floor"]
    lines.append(
        f"floors (any schedule): dense {f['dense_flops'] / 1e15:.2f} PFLOP = {f['dense_s']:.2f} s; KV read "
        f"{f['kv_bytes'] / 1e12:.2f} TB = {f['kv_s']:.2f} s; one after the other {f['serial_s']:.2f} s = "
        f"{f['serial_requests_per_s']:.1f} req/s"
    )
    if "measured" in res:
        m = res["measured"]
        lines.append(
            f"measured {m['elapsed_s']:.2f} s ({m['requests_per_s']:.1f} req/s); the model "
            f"{m['model_s']:.2f} s ({m['model_requests_per_s']:.1f} req/s) = {m['model_over_measured']:.0%}"
        )
    if "profile" in res and "error" not in res["profile"]:
        p = res["profile"]
        lines.append(
            f"traced steps {p['window']}: device busy {p['device_busy_ms']:.1f} ms, model "
            f"{p['model_ms']:.1f} ms ({p['model_over_busy']:.0%}); GEMMs {p['by_category_ms'].get('gemm', 0):.1f}"
            f" ms = {p['gemm_tflops'] or 0:.0f} TFLOP/s (model {p['model_gemm_ms']:.1f} ms); attention "
            f"{p['attention_tbps'] or 0:.2f} TB/s of KV, {p['attention_tflops'] or 0:.0f} TFLOP/s (model "
            f"{p['model_attention_ms']:.1f} ms); other {p['other_ms']:.1f} ms"
        )
    lines.append(
        f"{'variant':>18} {'steps':>5} {'buckets':>7} {'preempt':>7} {'model s':>8} {'pad s':>6} {'pad FLOP':>8}"
    )
    for name, v in res["variants"].items():
        lines.append(
            f"{name:>18} {v['steps']:>5} {v['variants']:>7} {v['preemptions']:>7} {v['model_s']:>8.3f} "
            f"{v['padding_s']:>6.3f} {v['padding_flops_frac']:>8.1%}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
