"""LoRA fused into the base projections (jaxllm/lora/ops.py fuse_layer) against the separate shrink / expand GEMMs
and the base model: L layers of one decoder layer's projections (qkv, o + residual, norm, gate_up, activation,
down + residual; attention replaced by q's slice) at T tokens, S slots of rank R, each token on slot t % (S + 1)
(S: the base model). Prints and writes per-mode milliseconds (median of --reps jitted calls) and the largest
difference of the fused and separate outputs.

    python bench/probes/lora_fused_probe.py --runs 64:8,1:8,64:32 --rank 16 --layers 16 --out $OUT/fused.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from jaxllm.config import ModelConfig  # noqa: E402
from jaxllm.lora import ops  # noqa: E402
from jaxllm.models import decoder  # noqa: E402
from jaxllm.models.attention import AttentionConfig  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(common.SHAPES))
    p.add_argument("--runs", default="64:8", help="comma-separated TOKENS:SLOTS pairs, each timed in all modes")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument(
        "--modes",
        default="",
        help="more modes over the fused arrays: sliced (every projection as separate GEMMs over slices of them), "
        "fused_in (qkv, gate_up fused; o, down sliced), fused_out (o, down fused; qkv, gate_up sliced)",
    )
    p.add_argument(
        "--cublas",
        choices=("auto", "on"),
        default="auto",
        help="auto: XLA's Triton GEMMs off from 32 tokens (the engine's decode rule); on: off at every size",
    )
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def make_layer(key, D, N, K, H, F, S, R, dt):
    G = N // K
    ks = jax.random.split(key, 12)
    n = lambda k, shape, scale: (scale * jax.random.normal(k, shape, jnp.float32)).astype(dt)  # noqa: E731
    base = {
        "w_qkv": n(ks[0], (D, K, G + 2, H), D**-0.5),
        "wo": n(ks[1], (N, H, D), (N * H) ** -0.5),
        "w_gate_up": n(ks[2], (D, 2, F), D**-0.5),
        "w_down": n(ks[3], (F, D), F**-0.5),
        "attn_norm": jnp.ones((D,), dt),
        "mlp_norm": jnp.ones((D,), dt),
    }
    if ops.qkv_block_diagonal(S, R, K, G, H, jnp.dtype(dt).itemsize):
        parts = np.asarray(ops.qkv_parts(G))
        mask = (parts == np.arange(3)[:, None])[:, None, None, :, None]  # [3, 1, 1, G + 2, 1]
        qb = n(ks[5], (S, 3, R, K, G + 2, H), 0.05) * jnp.asarray(mask[None], dt)
    else:
        qb = n(ks[5], (G + 2, S, R, K, H), 0.05)
    slots = {
        "qkv": (n(ks[4], (D, S, 3, R), D**-0.5), qb),
        "o": (n(ks[6], (N, H, S, R), (N * H) ** -0.5), n(ks[7], (S, R, D), 0.05)),
        "gate_up": (n(ks[8], (D, S, 2, R), D**-0.5), n(ks[9], (2, S, R, F), 0.05)),
        "down": (n(ks[10], (F, S, R), F**-0.5), n(ks[11], (S, R, D), 0.05)),
    }
    return base, slots


def unfuse(ll: dict, kinds) -> tuple[dict, dict]:
    """ops.fuse_layer undone for the projections in kinds (eagerly: separate arrays again): (base weights
    {"w_qkv", ...}, the layer's LoRA arrays with those kinds as separate (A, B))."""
    base, out = {}, dict(ll)
    for kind in kinds:
        a, b = out.pop(f"{kind}_fused")
        if kind in ("qkv", "gate_up"):  # W [D, base | S * P * R] beside B
            parts = 3 if kind == "qkv" else 2
            shape = (2, b.shape[-1]) if kind == "gate_up" else ops.qkv_shape(b)
            n = math.prod(shape)
            S, R = (b.shape[0], b.shape[2]) if b.ndim == 6 else (b.shape[1], b.shape[2])
            base[ops.FUSED_BASE[kind]] = a[:, :n].reshape(a.shape[0], *shape)
            out[kind] = (a[:, n:].reshape(a.shape[0], S, parts, R), b)
        else:  # A beside W [base rows | S * R, D]
            S, R = a.shape[-2], a.shape[-1]
            k = b.shape[0] - S * R
            base[ops.FUSED_BASE[kind]] = b[:k].reshape(*a.shape[:-2], b.shape[1])
            out[kind] = (a, b[k:].reshape(S, R, b.shape[1]))
    return base, out


def layer_fn(lp, ll, x, lw, cfg, attn, G):
    """The decoder's projections of one layer (attention replaced by the q heads of the qkv projection)."""
    h = decoder._norm(x, lp["attn_norm"], cfg)
    if "qkv_fused" in ll:
        qkv = ops.fused_qkv(h, *ll["qkv_fused"], lw)
    else:
        qkv = decoder._proj(h, lp["w_qkv"], None, "TD,DKGH->TKGH", attn)
        qkv = ops.add(qkv, "qkv", h, ll.get("qkv"), lw)
    T = x.shape[0]
    attn_out = qkv[:, :, :G].reshape(T, -1, qkv.shape[-1])
    if "o_fused" in ll:
        x = x + ops.fused_out(attn_out, *ll["o_fused"], lw)
    else:
        out = decoder._proj(attn_out, lp["wo"], None, "TNH,NHD->TD", attn)
        x = ops.add(x + out, "o", attn_out, ll.get("o"), lw)
    h = decoder._norm(x, lp["mlp_norm"], cfg)
    return decoder.mlp(h, lp.get("w_gate_up"), lp.get("w_down"), "silu", attn, ll=ll, lw=lw, residual=x)


def main(argv=None) -> dict:
    args = parse(argv)
    res = dict(env=common.environment(), shape=args.shape, rank=args.rank, layers=args.layers, runs=[])
    for item in args.runs.split(","):
        T, S = map(int, item.split(":"))
        row = probe(args, T, S)
        print(json.dumps({k: v for k, v in row.items() if k != "ms_all"}), flush=True)
        res["runs"].append(row)
        if args.out:
            common.write_result("lora_fused_probe", res, args.out)
    return res


def probe(args, T: int, S: int) -> dict:
    shape = common.SHAPES[args.shape]
    D, N, K = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    H, F = D // N, shape["intermediate_size"]
    R, L = args.rank, args.layers
    dt = jnp.bfloat16
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=shape["vocab_size"],
        num_layers=L,
        hidden_size=D,
        num_heads=N,
        num_kv_heads=K,
        head_dim=H,
        intermediate_size=F,
    )
    attn = AttentionConfig()
    keys = jax.random.split(jax.random.PRNGKey(0), L + 1)
    layers = [make_layer(k, D, N, K, H, F, S, R, dt) for k in keys[:L]]
    x = jax.random.normal(keys[L], (T, D), jnp.float32).astype(dt)
    slots_of = jnp.asarray([t % (S + 1) if t % (S + 1) < S else -1 for t in range(T)], jnp.int32)

    def run(params, ll, x, slots):
        lw = None if ll is None else ops.select(slots, S, dt)
        for i in range(L):
            x = layer_fn(params[i], {} if ll is None else ll[i], x, lw, cfg, attn, N // K)
        return x

    fn = jax.jit(run)
    bases = [b for b, _ in layers]
    fused_ll = [ops.fuse_layer(b, s) for b, s in layers]
    fused_base = [{k: v for k, v in b.items() if k not in ops.FUSED_BASE.values()} for b in bases]

    def split(kinds):  # the fused arrays, with kinds computed as separate GEMMs over their slices
        parts = [unfuse(ll, kinds) for ll in fused_ll]
        return [dict(b, **w) for b, (w, _) in zip(fused_base, parts)], [ll for _, ll in parts]

    modes = {"base": (bases, None), "lora": (bases, [s for _, s in layers]), "fused": (fused_base, fused_ll)}
    for name, kinds in (("sliced", ops.FUSED_BASE), ("fused_in", ("o", "down")), ("fused_out", ("qkv", "gate_up"))):
        if name in args.modes.split(","):
            modes[name] = split(kinds)
    row: dict = dict(tokens=T, slots=S, ms={}, ms_all={}, hlo_kernels={})
    outs = {}
    # as the engine compiles decode steps of T sequences (jaxllm/engine/xla_options.py)
    cublas = args.cublas == "on" or T >= 32
    opts = {"xla_gpu_enable_triton_gemm": False} if jax.default_backend() == "gpu" and cublas else {}
    row["compiler_options"] = opts
    for name, (p, ll) in modes.items():
        compiled = fn.lower(p, ll, x, slots_of).compile(opts)
        outs[name] = compiled(p, ll, x, slots_of).block_until_ready()
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            compiled(p, ll, x, slots_of).block_until_ready()
            times.append(time.perf_counter() - t)
        row["ms"][name] = 1e3 * float(np.median(times))
        row["ms_all"][name] = [round(1e3 * v, 4) for v in times]
        text = compiled.as_text()
        row["hlo_kernels"][name] = {
            "custom_calls": text.count("custom_call_target="),
            "fusions": text.count(" fusion("),
        }
    f32 = {k: v.astype(jnp.float32) for k, v in outs.items()}
    row["max_abs_diff_vs_lora"] = {k: float(jnp.abs(v - f32["lora"]).max()) for k, v in f32.items() if k != "lora"}
    row["max_abs_diff_lora_vs_base"] = float(jnp.abs(f32["lora"] - f32["base"]).max())
    row["max_abs_lora"] = float(jnp.abs(f32["lora"]).max())
    row["per_layer_us"] = {k: 1e3 * v / L for k, v in row["ms"].items()}
    return row


if __name__ == "__main__":
    main()
