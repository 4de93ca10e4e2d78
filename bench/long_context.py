"""Long-context latency (issue 37, item 3): TTFT of a long prompt and ITL at long context, each against its
roofline from ceilings measured in the same process.

  python bench/long_context.py --shape llama3.1-8b --load-format dummy --max-model-len 32768 --max-num-seqs 16 \\
      --batch-size 1 --input-len 32640 --output-len 128 --out /tmp/long32k.json
  python bench/long_context.py ... --batch-size 16 --input-len 8064 --output-len 128 --out /tmp/long8k.json

(bench/suite.py's long32k and long8k stages: the same engine flags, so the second finds its programs compiled.)
Each timed run is one batch through LLM.generate as in bench/latency.py (random-token prompts, ignore_eos,
greedy), after --num-iters-warmup untimed ones; TTFT and ITL per request from RequestMetrics.

Ceilings, measured before the engine takes the device's memory, timed as bench/kernels.py times a call (the
difference of two chain lengths inside one jit): copy bandwidth = bytes read + written by x + 1 over a --copy-mib
bf16 array; matmul rate = a bf16 --matmul-n cube.
Rooflines (FLOP and byte counts: bench/common.py ModelMath; L layers, N q / K kv heads, H head dim, D, V):
  ITL roofline = (weight bytes + KV bytes read per decode step) / copy bandwidth. Weight bytes: every layer's
    matmuls and the lm_head; KV bytes: sum over the batch of context x L x 2 x K x H x KV itemsize, averaged over
    the decode steps (contexts input_len + 1 .. input_len + output_len - 1). itl_roofline_frac = roofline / ITL
    p50 (1.0 = at the roofline; the decode kernels only read, so above 1.0 is possible: a copy also writes). The
    ITL is each request's mean: in a batch whose prompts take several prefill steps, the requests that start
    decoding first also wait for the others' prefill chunks. itl_last_started_s: the ITL of the request whose
    first token came last (decode steps only), itl_last_started_roofline_frac its fraction.
  TTFT: prefill FLOPs per prompt of n tokens = 2 x matmul params x n + 2 D V (the sampled row) + causal attention
    2 L N H n (n + 1) (QK^T and PV, each query against itself and the positions before it); achieved rate =
    batch x prefill FLOPs / TTFT (batch 1: p50; a batch: the last request's first token, its prompts arriving
    together), ttft_matmul_frac = achieved rate / matmul rate.
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


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=32640)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=2)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--copy-mib", type=int, default=512, help="array size of the copy-bandwidth ceiling")
    p.add_argument("--matmul-n", type=int, default=8192, help="n of the n^3 bf16 matmul ceiling")
    p.add_argument(
        "--profile-dir",
        default=None,
        help="after the timed runs, trace one batch (prefill and decode; with --enable-prefix-caching its prompts "
        "come from the cache of an untraced run first) and sum it up, with 200 kernels in launch order",
    )
    return p.parse_args(argv)


def ceilings(copy_mib: int, matmul_n: int) -> dict:
    """Copy bandwidth (bytes/s, read + write) and bf16 matmul rate (FLOP/s) of device 0, as bench/kernels.py
    measures them (its fixed sizes made parameters here, so CPU smoke tests can shrink them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.kernels import timeit

    x = jnp.ones((copy_mib << 19,), jnp.bfloat16)

    def copies(n):
        def f(x):
            for _ in range(n):  # the barrier keeps XLA from fusing the passes into one
                x = jax.lax.optimization_barrier(x + jnp.bfloat16(1))
            return x

        return jax.jit(f)

    t_copy = timeit(copies, x)[0]
    del x
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((matmul_n, matmul_n), np.float32), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((matmul_n, matmul_n), np.float32) / np.sqrt(matmul_n), jnp.bfloat16)

    def matmuls(m):
        def f(a, b):
            for _ in range(m):
                a = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            return a

        return jax.jit(f)

    t_mm = timeit(matmuls, a, b)[0]
    del a, b
    return dict(
        copy_bytes_per_s=2 * (copy_mib << 20) / t_copy,
        copy_mib=copy_mib,
        matmul_flops_per_s=2 * matmul_n**3 / t_mm,
        matmul_n=matmul_n,
    )


def rooflines(math: common.ModelMath, batch: int, input_len: int, output_len: int, ceil: dict) -> dict:
    """The ITL and TTFT rooflines of this workload (see the module docstring)."""
    contexts = [input_len + i for i in range(1, max(output_len, 2))]  # context of each decode step's new token
    kv_step = batch * math.kv_bytes_per_token * sum(contexts) / len(contexts)
    step_bytes = math.weight_bytes + kv_step
    prefill_dense = math.dense_flops(input_len, 1)
    prefill_attn = math.attn_flops(input_len, 0)
    return dict(
        weight_bytes=math.weight_bytes,
        kv_bytes_per_token=math.kv_bytes_per_token,
        kv_bytes_per_step=kv_step,
        itl_roofline_s=step_bytes / ceil["copy_bytes_per_s"],
        prefill_flops_per_prompt=prefill_dense + prefill_attn,
        prefill_dense_flops=prefill_dense,
        prefill_attention_flops=prefill_attn,
        ttft_roofline_s=batch * (prefill_dense + prefill_attn) / ceil["matmul_flops_per_s"],
        flop_formula="per prompt of n tokens: 2 * matmul_params * n + 2 * D * V + 2 * L * N * H * n * (n + 1)",
        itl_formula="(weight_bytes + batch * kv_bytes_per_token * mean decode context) / copy bandwidth",
    )


def main(argv=None) -> dict:
    args = parse(argv)
    common.setup_logging(args.log_level)
    from jaxllm.engine.device_memory import request_device_memory

    # The engine's memory settings before the backend starts (LLM() would make the same call, too late once the
    # ceilings below have started it).
    request_device_memory(args.gpu_memory_utilization, args.pipeline_parallel_size, args.tensor_parallel_size)
    t0 = time.perf_counter()
    ceil = ceilings(args.copy_mib, args.matmul_n)
    ceil["seconds"] = time.perf_counter() - t0
    print(
        f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s",
        flush=True,
    )
    import jax.numpy as jnp

    from bench.latency import run_batch

    llm, t_llm, t_ready = common.build_llm(args)
    env = common.environment()
    eng = llm.llm_engine
    with open(os.path.join(common.resolve_model(args), "config.json")) as f:
        cfg = json.load(f)
    math = common.ModelMath.from_config(
        cfg, weight_itemsize=jnp.dtype(eng.model_config.dtype).itemsize, kv_itemsize=eng.runner.kv_dtype.itemsize
    )
    B, n_in, n_out = args.batch_size, args.input_len, args.output_len
    for i in range(args.num_iters_warmup):
        run_batch(llm, B, n_in, n_out, seed=1000 + i)
    # the long-context decode programs (runner.long_decode_from) compile in the background at their first step
    eng.runner.programs.wait_for_background_compiles()
    runs = [run_batch(llm, B, n_in, n_out, seed=i) for i in range(args.num_iters)]
    ttft = [t for r in runs for t in r["ttft_s"]]
    itl = [t for r in runs for t in r["itl_s"]]
    last_ttft = [max(r["ttft_s"]) for r in runs]
    # the request whose first token came last decodes only after every prompt is in: its ITL has no prefill
    # chunk of another request in it (the other requests' ITLs do when a batch's prompts take several steps)
    last_itl = common.pct([r["itl_s"][r["ttft_s"].index(max(r["ttft_s"]))] for r in runs])
    roof = rooflines(math, B, n_in, n_out, ceil)
    itl_p50 = common.pct(itl)["p50"]
    ttft_batch = common.pct(last_ttft)["p50"]  # batch 1: the p50 TTFT
    rate = B * roof["prefill_flops_per_prompt"] / ttft_batch
    res = dict(
        env=env,
        engine=common.engine_summary(llm),
        workload=dict(
            batch_size=B,
            input_len=n_in,
            output_len=n_out,
            num_iters=args.num_iters,
            num_iters_warmup=args.num_iters_warmup,
            ignore_eos=True,
            temperature=0.0,
            model=args.model or args.shape,
            load_format=args.load_format,
        ),
        time_to_ready_s=dict(llm_init=t_ready - t_llm, since_script_start=t_ready - T_START),
        ceilings=ceil,
        roofline=roof,
        ttft_s=common.pct(ttft),
        ttft_last_in_batch_s=common.pct(last_ttft),
        itl_s=common.pct(itl),
        e2e_s=common.pct([r["e2e_s"] for r in runs]),
        decode_tok_per_s_per_seq=1.0 / itl_p50,
        itl_roofline_frac=roof["itl_roofline_s"] / itl_p50,
        itl_last_started_s=last_itl,
        itl_last_started_roofline_frac=roof["itl_roofline_s"] / last_itl["p50"],
        prefill_flops_per_s=rate,
        ttft_matmul_frac=rate / ceil["matmul_flops_per_s"],
        compiles_after_warmup=eng.runner.programs.num_compiles_after_warmup,
        long_decode_from=eng.runner.host.long_decode_from,
        long_context_programs=sorted(v.shape_name for v in eng.runner.programs.compiled if v.long_context),
    )
    print(
        f"batch {B} x {n_in} in / {n_out} out: TTFT p50 {res['ttft_s']['p50'] * 1e3:.1f} ms "
        f"({rate / 1e12:.1f} TFLOP/s = {res['ttft_matmul_frac']:.1%} of matmul), ITL p50 {itl_p50 * 1e3:.2f} ms "
        f"(roofline {roof['itl_roofline_s'] * 1e3:.2f} ms: {res['itl_roofline_frac']:.1%})",
        flush=True,
    )
    if args.profile_dir:
        from bench.throughput import profile_run

        vocab = eng.vocab_size
        prompts = [{"prompt_token_ids": p} for p in common.random_token_prompts(B, n_in, vocab, 7)]
        res["profile"] = profile_run(llm, prompts, min(n_out, 64), args.profile_dir, sequence=200)
    common.write_result("long_context", res, args.out)
    return res


if __name__ == "__main__":
    main()
