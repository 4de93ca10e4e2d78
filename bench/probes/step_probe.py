"""Finding: the batch-1 decode step (5.44 ms, 8B) is at its weight-read roofline; it set the smallest decode
bucket (2 rows) and cuBLAS for decode steps of 32+ rows (runner.SMALLEST_SEQ_BUCKET, programs.compile_options).

Probe: where a decode step's kernel time goes (batch 1 by default), and what changes it.

Builds the engine's decode step shape (Llama-3-8B shape, bf16 dummy weights; --rows padded rows, --live of them
holding a sequence of --ctx tokens, Pallas attention) from the model code itself (decoder.forward +
compute_logits + argmax, KV cache donated), then for each variant:
  - writes the optimized HLO (compiled.as_text(), gzipped) so the fusion decisions can be read,
  - times --steps chained steps (wall per step, dispatch pipelined) and sums an XProf trace per kernel.
Variants are decoder code variants (a function replacing decoder.decoder_layer, or decoder module settings
such as the small-batch split-K qkv projection) and XLA options passed to compile() (env_option_overrides),
so they share one process and one set of weights; "name@2" repeats a variant.

  python bench/probes/step_probe.py --out OUT.json [--hlo-dir DIR] [--variants base,cublas,...]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import SHAPES, environment, write_result  # noqa: E402
from jaxllm.config import ModelConfig  # noqa: E402
from jaxllm.models import attention, decoder  # noqa: E402
from jaxllm.models.attention import AttentionConfig, AttentionMetadata  # noqa: E402
from jaxllm.models.params import dummy_params, param_shardings, param_specs  # noqa: E402
from jaxllm.sharding import make_kv_caches  # noqa: E402

BASE_LAYER = decoder.decoder_layer


def split_gate_up_layer(lp, x, kv_cache, meta, cfg, attn, kind=None):
    """decoder_layer with gate and up as two weights (two GEMMs), so silu(gate) * up can fuse into the down
    projection's operand instead of being a kernel of its own (Llama's shape: kind, the LayerKind, is unused)."""
    lp = dict(lp)
    wg, wu = lp.pop("w_gate"), lp.pop("w_up")
    x_in = x
    h = decoder.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    qkv = jnp.einsum("TD,DKGH->TKGH", h, lp["w_qkv"])
    inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim), jnp.float32)
    out, kv_cache = decoder.paged_attention(
        qkv, kv_cache, meta, scale=cfg.head_dim**-0.5, rope_inv_freq=inv_freq, config=attn
    )
    x = x_in + jnp.einsum("TNH,NHD->TD", out, lp["wo"])
    h = decoder.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    g, u = jnp.einsum("TD,DF->TF", h, wg), jnp.einsum("TD,DF->TF", h, wu)
    return x + jnp.einsum("TF,FD->TD", jax.nn.silu(g) * u, lp["w_down"]), kv_cache


def split_gate_up_params(params):
    layers = []
    for lp in params["layers"]:
        lp = dict(lp)
        w = lp.pop("w_gate_up")
        lp["w_gate"], lp["w_up"] = jnp.array(w[:, 0]), jnp.array(w[:, 1])
        layers.append(lp)
    return dict(params, layers=layers)


# name -> (decoder_layer replacement or None, XLA options for compile(), params transform or None,
#          module settings: decoder.NAME, or attention.NAME for "attention.NAME"). The small-batch split-K qkv
#          projection (decoder.qkv_splits) and the fused decode kernel (attention.FUSED_DECODE) are off unless set.
NO_SPLIT = {"QKV_SPLIT_MAX_TOKENS": 0, "attention.FUSED_DECODE": False}
VARIANTS = {
    "base": (None, {}, None, NO_SPLIT),
    "cublas": (None, {"xla_gpu_enable_triton_gemm": False}, None, NO_SPLIT),
    "split_gate_up": (split_gate_up_layer, {}, split_gate_up_params, NO_SPLIT),
}
for _q in (2, 4, 8):
    VARIANTS[f"split_qkv_{_q}"] = (
        None,
        {},
        None,
        {"QKV_SPLIT_MAX_TOKENS": 16, "QKV_SPLITS": _q, "attention.FUSED_DECODE": False},
    )
_FUSED = {"QKV_SPLIT_MAX_TOKENS": 16, "QKV_SPLITS": 4, "attention.FUSED_DECODE": True}
VARIANTS["fused"] = (None, {}, None, _FUSED)
for _n in (1, 2):
    VARIANTS[f"fused_{_n}split"] = (
        None,
        {},
        None,
        dict(_FUSED, **{"attention.FUSED_DECODE_TUNING": {"num_splits": _n}}),
    )
VARIANTS["fused_plain_qkv"] = (None, {}, None, dict(_FUSED, QKV_SPLIT_MAX_TOKENS=0))
VARIANTS["fused_cublas"] = (None, {"xla_gpu_enable_triton_gemm": False}, None, _FUSED)


def _setting(key):
    """(module, attribute) of a variant's setting key."""
    return (attention, key.split(".", 1)[1]) if key.startswith("attention.") else (decoder, key)


def build_inputs(cfg, ctx: int, rows: int = 8, max_len: int = 1024, S: int = 16, live: int = 1):
    """A decode step's inputs: `live` of `rows` sequences hold ctx tokens each (pages shuffled, none shared),
    the rest are padding rows."""
    used = ctx // S + 1  # pages each live sequence holds; the rest of its table row is the padding page 0
    bt = np.zeros((rows, max_len // S), np.int32)
    perm = np.random.default_rng(0).permutation(live * used)
    for b in range(live):
        bt[b, :used] = 1 + perm[b * used : (b + 1) * used]
    slot = [int(bt[b, (ctx - 1) // S]) * S + (ctx - 1) % S for b in range(live)]
    meta = AttentionMetadata(
        positions=jnp.asarray([ctx - 1] * live + [0] * (rows - live), jnp.int32),
        slot_mapping=jnp.asarray(slot + [-1] * (rows - live), jnp.int32),
        seq_lens=jnp.asarray([ctx] * live + [0] * (rows - live), jnp.int32),
        query_start_loc=jnp.arange(rows + 1, dtype=jnp.int32),
        block_tables=jnp.asarray(bt),
        decode_only=True,
    )
    return jnp.zeros((rows,), jnp.int32), meta, live * used + 1


def make_step(cfg, attn):
    def step(params, kv, tokens, meta):
        kv, hidden = decoder.forward(params, kv, tokens, meta, cfg, attn)
        logits = decoder.compute_logits(params, hidden, cfg)
        return kv, jnp.argmax(logits, -1).astype(jnp.int32)

    return jax.jit(step, donate_argnums=(1,))


def xprof(fn, n):
    from bench.profile_summary import summarize

    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        fn(n)
    s = summarize(d, top=60)
    dev = s["devices"][0] if s.get("devices") else {}
    ks = dev.get("top_kernels", [])
    return dict(
        busy_ms_per_step=dev.get("busy_ms", 0) / n,
        span_ms_per_step=dev.get("span_ms", 0) / n,
        kernels=[
            dict(
                name=k["name"][:80],
                us=round(k["us_per_run"], 2),
                per_step=round(k["runs"] / n, 2),
                us_per_step=round(k["ms"] * 1e3 / n, 2),
            )
            for k in ks
        ],
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--hlo-dir", default=None)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--ctx", type=int, default=200)
    p.add_argument(
        "--rows",
        type=int,
        default=8,
        help="padded batch rows: 8 as in the earlier probes; the engine pads batch 1 to 2 since stop 17",
    )
    p.add_argument("--live", type=int, default=1, help="rows holding a sequence of --ctx tokens (the rest pad)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU smoke test)")
    a = p.parse_args()
    cfg = ModelConfig.from_hf(SHAPES[a.shape], dtype="bfloat16")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("pp", "tp"))
    specs = param_specs(cfg)
    params = dummy_params(specs, jnp.bfloat16, param_shardings(specs, mesh))
    tokens, meta, num_pages = build_inputs(cfg, a.ctx, rows=a.rows, live=a.live)
    kv = make_kv_caches(cfg, mesh, num_pages, 16)
    attn = AttentionConfig(backend="pallas", interpret=a.interpret)
    rows = []
    for name in a.variants.split(","):
        layer, opts, transform, settings = VARIANTS[name.split("@")[0]]  # "base@2": a repeat
        vparams = transform(params) if transform else params
        decoder.decoder_layer = layer or BASE_LAYER
        saved = {k: getattr(*_setting(k)) for k in settings}
        for k, v in settings.items():
            setattr(*_setting(k), v)
        # the decoder layer's nested jit caches its trace by argument shapes, not by module settings
        decoder._traced_once.cache_clear()
        jax.clear_caches()
        row = dict(variant=name, xla_options={k: str(v) for k, v in opts.items()}, decoder_settings=settings)
        try:
            t0 = time.perf_counter()
            compiled = make_step(cfg, attn).lower(vparams, kv, tokens, meta).compile(compiler_options=opts or None)
            row["compile_s"] = time.perf_counter() - t0
            if a.hlo_dir:
                os.makedirs(a.hlo_dir, exist_ok=True)
                with gzip.open(os.path.join(a.hlo_dir, f"step_b1_{name}.hlo.txt.gz"), "wt") as f:
                    f.write(compiled.as_text())

            def run(n, compiled=compiled, vparams=vparams):  # called within this iteration only
                nonlocal kv
                out = None
                for _ in range(n):
                    kv, out = compiled(vparams, kv, tokens, meta)
                jax.block_until_ready(out)

            run(5)
            walls = []
            for _ in range(3):
                t0 = time.perf_counter()
                run(a.steps)
                walls.append((time.perf_counter() - t0) / a.steps * 1e3)
            row["wall_ms_per_step"] = walls
            row["tok_s"] = 1e3 / min(walls)
            row.update(xprof(run, 10))
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others' rows
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        finally:
            decoder.decoder_layer = BASE_LAYER
            for k, v in saved.items():
                setattr(*_setting(k), v)
            vparams = None  # frees a transformed copy before the next variant
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        for k in row.get("kernels", [])[:16]:
            print("   ", k, flush=True)
    write_result(
        "step_probe",
        dict(env=environment(), ctx=a.ctx, batch_rows=a.rows, live=a.live, shape=a.shape, rows=rows),
        a.out,
    )


if __name__ == "__main__":
    main()
