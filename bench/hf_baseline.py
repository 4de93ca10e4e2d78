"""HF transformers generate() on the workloads of bench/throughput.py and bench/latency.py: the baseline the
issue's ratios are taken against, run on the same device in the same session.

  python bench/hf_baseline.py --shape llama3-8b --batch1-output-len 64 --input-len 462 --output-len 256 \\
      --batch-size 64 --num-prompts 64

Weights are random (from_config, created directly on the GPU in bf16); eager attention-free defaults of
transformers (sdpa), greedy, min_new_tokens = max_new_tokens so every sequence runs the full length.
batch-1: decode tok/s = (new tokens - 1) / (time(generate N) - time(generate 1)).
Batched: --num-prompts prompts in batches of --batch-size, requests/s and output tok/s over all of them.
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
    p.add_argument("--model", default=None)
    p.add_argument("--shape", choices=sorted(common.SHAPES), default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch1-input-len", type=int, default=32)
    p.add_argument("--batch1-output-len", type=int, default=64)
    p.add_argument("--input-len", type=int, default=462)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--skip-batched", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def build(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.shape:
        from transformers import LlamaConfig

        cfg = LlamaConfig(**{k: v for k, v in common.SHAPES[args.shape].items()
                             if k not in ("architectures", "model_type", "torch_dtype")})
    else:
        cfg = AutoConfig.from_pretrained(common.resolve_model(args) or _demo())
    torch.manual_seed(args.seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return model, cfg, dev


def _demo():
    from jaxllm.demo import demo_model_path

    return str(demo_model_path())


def generate(model, ids, new_tokens: int) -> float:
    import torch

    torch.cuda.synchronize() if ids.is_cuda else None
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize() if ids.is_cuda else None
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    args = parse(argv)
    import numpy as np
    import torch
    import transformers

    t0 = time.perf_counter()
    model, cfg, dev = build(args)
    load_s = time.perf_counter() - t0
    V = cfg.vocab_size
    rng = np.random.default_rng(args.seed)

    def prompts(n, L):
        return torch.tensor(rng.integers(min(100, V - 1), V, size=(n, L)), device=dev)

    b1 = prompts(1, args.batch1_input_len)
    generate(model, b1, 2)  # warm-up
    t_first = min(generate(model, b1, 1) for _ in range(2))
    t_all = generate(model, b1, args.batch1_output_len)
    batch1 = dict(input_len=args.batch1_input_len, output_len=args.batch1_output_len, ttft_s=t_first,
                  e2e_s=t_all, decode_tok_per_s=(args.batch1_output_len - 1) / max(t_all - t_first, 1e-9))
    print(f"HF batch 1: {batch1['decode_tok_per_s']:.1f} decode tok/s (TTFT {t_first * 1e3:.0f} ms)", flush=True)
    res = dict(env=dict(common.environment(with_jax=False), torch=torch.__version__,
                        transformers=transformers.__version__,
                        device=torch.cuda.get_device_name() if dev == "cuda" else "cpu"),
               model=dict(shape=args.shape, model=args.model, dtype=args.dtype,
                          attn_implementation=getattr(model.config, "_attn_implementation", None)),
               load_s=load_s, batch1=batch1)
    if not args.skip_batched:
        n_done, t_total = 0, 0.0
        while n_done < args.num_prompts:
            b = min(args.batch_size, args.num_prompts - n_done)
            t_total += generate(model, prompts(b, args.input_len), args.output_len)
            n_done += b
        res["batched"] = dict(num_prompts=args.num_prompts, batch_size=args.batch_size, input_len=args.input_len,
                              output_len=args.output_len, elapsed_s=t_total, requests_per_s=n_done / t_total,
                              output_tokens_per_s=n_done * args.output_len / t_total,
                              total_tokens_per_s=n_done * (args.input_len + args.output_len) / t_total)
        print(f"HF batched: {res['batched']['requests_per_s']:.2f} req/s, "
              f"{res['batched']['output_tokens_per_s']:.1f} output tok/s", flush=True)
    common.write_result("hf_baseline", res, args.out)
    return res


if __name__ == "__main__":
    main()
