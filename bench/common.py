"""Shared pieces of the benchmark scripts: model folders for dummy weights, workloads, and result JSON.

Every script writes one JSON file under bench/results/ (or --out) holding the device, the jax version, the
git commit, the command line and the workload next to its figures, so a number is never without its context.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from jaxllm.paths import cache_root, default_compilation_cache_dir  # noqa: E402

# Llama-3-8B's config.json (meta-llama/Meta-Llama-3-8B-Instruct), the shape the goals are set for.
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=128000,
    eos_token_id=128009,
    torch_dtype="bfloat16",
    # As in Meta's file. Without it, transformers 5.17 takes a llama folder for a Mistral one and warns that the
    # tokenizer has "an incorrect regex pattern" (the warning the H100 suite logs printed for every start).
    transformers_version="4.40.0.dev0",
)
# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B-Instruct): Llama-3-8B's weights' shapes with 131072 positions
# and llama3 rope scaling; the long-context stages (bench/long_context.py) run it.
LLAMA31_8B = dict(
    LLAMA3_8B,
    max_position_embeddings=131072,
    eos_token_id=[128001, 128008, 128009],
    transformers_version="4.42.3",
    rope_scaling=dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192, rope_type="llama3"
    ),
)
# A tiny Llama for CPU checks of the scripts (same code path, seconds to build).
TINY = dict(
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)
# The tiny Llama with Llama-3.1's rope scaling, scaled down (CPU checks of the long-context stages).
TINY_LONG = dict(
    TINY,
    max_position_embeddings=4096,
    rope_scaling=dict(LLAMA31_8B["rope_scaling"], original_max_position_embeddings=256),
)
# Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B): 48 layers, each a mixture of 128 experts (8 per token, width
# 768), ~3.3B parameters active per token of 30.5B (61 GB in bf16: one H100 80GB holds it with a small KV cache).
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
)
# A tiny Qwen3-MoE for CPU checks of the scripts.
TINY_MOE = dict(
    QWEN3_30B_A3B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)
SHAPES = {
    "llama3-8b": LLAMA3_8B,
    "llama3.1-8b": LLAMA31_8B,
    "tiny": TINY,
    "tiny-long": TINY_LONG,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "tiny-moe": TINY_MOE,
}
# --quantization with --shape (dummy weights): the quantization_config written into the generated folder, as the
# public quantizers write it (issue 29's goals are set for GPTQ int4, group 128, symmetric; --quant-bits and
# --quant-group-size change bits and group). fp8 needs none: quantization="fp8" quantizes a 16-bit model while
# loading (vLLM's dynamic FP8), and dummy weights are drawn in fp8 directly.
DUMMY_QUANT_CONFIGS = {
    "gptq": dict(quant_method="gptq", bits=4, group_size=128, sym=True, desc_act=False, checkpoint_format="gptq"),
    "awq": dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm"),
}


def write_token_id_tokenizer(out_dir: str, vocab_size: int, bos: int, eos: int) -> None:
    """A word-level tokenizer with one word per id ("<t17>"), saved as tokenizer.json. Prompts in these
    benchmarks are token ids, so the engine needs a tokenizer only to detokenize outputs; this one covers
    every id of the vocabulary and needs no download (the real Llama-3 BPE detokenizes at a similar cost)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=f"<t{bos}>", eos_token=f"<t{eos}>", unk_token="<t0>")
    fast.save_pretrained(out_dir)


def make_model_dir(shape: str | dict = "llama3-8b", out_dir: str | None = None) -> str:
    """Writes config.json + generation_config.json + a token-id tokenizer for `shape` (a SHAPES name, or a
    config dict given with out_dir); LLM(dir, load_format="dummy") then builds that shape with random weights on
    the device. Without out_dir the folder is kept under jaxllm.paths.cache_root()/bench_models, keyed by the shape and the
    tokenizer libraries' versions, and reused: like a real checkpoint folder it is on disk before the engine
    starts (building the 128k-word tokenizer took ~3 s, which the warm time-to-ready counted as start-up)."""
    if out_dir is None:
        return _cached_model_dir(shape)
    cfg = SHAPES[shape] if isinstance(shape, str) else shape
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, f)
    eos = cfg["eos_token_id"]  # Llama-3.1 lists three; its tokenizer's eos_token is the last (<|eot_id|>)
    write_token_id_tokenizer(out_dir, cfg["vocab_size"], cfg["bos_token_id"], eos[-1] if isinstance(eos, list) else eos)
    return out_dir


def _cached_model_dir(shape: str, quantization_config: dict | None = None) -> str:
    import hashlib
    import shutil
    from importlib.metadata import version

    cfg = SHAPES[shape] if quantization_config is None else dict(SHAPES[shape], quantization_config=quantization_config)
    key = json.dumps([cfg, version("transformers"), version("tokenizers")], sort_keys=True)
    root = os.path.join(cache_root(), "bench_models")
    name = shape if quantization_config is None else f"{shape}-{quantization_config['quant_method']}"
    path = os.path.join(root, f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = make_model_dir(cfg, tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        os.rename(tmp, path)  # atomic: a concurrent script either finds the whole folder or builds its own
    except OSError:  # another script got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def timed(fn, record: dict, key: str):
    """fn, adding each call's wall seconds to record[key]."""

    def call(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            record[key] = record.get(key, 0.0) + time.perf_counter() - t0

    return call


def call_seconds(obj, names) -> dict[str, list[float]]:
    """Wraps obj's methods `names` (instance attributes; `del obj.name` undoes one) to append each call's wall
    seconds to the returned lists, one per name (clear them to start over): calls, totals and percentiles of where a
    step's host time goes."""
    out: dict[str, list[float]] = {}
    for name in names:
        fn, spent = getattr(obj, name), out.setdefault(name, [])

        def call(*a, _fn=fn, _spent=spent, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _spent.append(time.perf_counter() - t0)

        setattr(obj, name, call)
    return out


def time_calls(obj, name: str, record: dict, key: str):
    """Replaces obj.name with timed(obj.name, record, key); returns the original (setattr(obj, name,
    original) undoes it)."""
    fn = getattr(obj, name)
    setattr(obj, name, timed(fn, record, key))
    return fn


def build_llm(args):
    """The LLM for the parsed model args: (llm, perf_counter before LLM(), perf_counter once it is ready)."""
    from jaxllm import LLM

    model = resolve_model(args)
    t0 = time.perf_counter()
    llm = LLM(model, **engine_kwargs(args, model))
    return llm, t0, time.perf_counter()


def resolve_model(args) -> str | None:
    """--model PATH, or --shape NAME (a generated folder, dummy weights; with --quantization gptq / awq its
    quantization_config, see DUMMY_QUANT_CONFIGS), or None (the demo model)."""
    if getattr(args, "shape", None):
        qc = dummy_quant_config(args)
        return make_model_dir(args.shape) if qc is None else _cached_model_dir(args.shape, qc)
    return args.model


def dummy_quant_config(args) -> dict | None:
    """The quantization_config a generated --shape folder gets for --quantization (None: none needed)."""
    from jaxllm.quantization import METHODS

    method = getattr(args, "quantization", None)
    if method is None or METHODS[method] == "fp8":
        return None
    if METHODS[method] not in DUMMY_QUANT_CONFIGS:
        raise SystemExit(
            f"--quantization {method} with --shape: no dummy config for it (use gptq, awq or fp8, or "
            "--model with a real checkpoint)"
        )
    return dict(DUMMY_QUANT_CONFIGS[METHODS[method]], bits=args.quant_bits, group_size=args.quant_group_size)


# ---- workloads ---------------------------------------------------------------------------------------------
def random_token_prompts(n: int, input_len: int, vocab_size: int, seed: int = 0, lens=None) -> list[list[int]]:
    """Random token ids in [100, vocab) (clear of special ids at the low end), like vLLM's random dataset."""
    rng = np.random.default_rng(seed)
    lens = [input_len] * n if lens is None else lens
    hi = max(vocab_size, 101)
    return [rng.integers(min(100, vocab_size - 1), hi, size=int(L)).tolist() for L in lens]


def synthetic_sharegpt(n: int, seed: int = 0, max_input: int = 1024, max_output: int = 1024):
    """A fixed-seed ShareGPT-like length mix: log-normal input and output lengths with ShareGPT's rough
    medians (about 220 prompt / 200 output tokens, long tails), clipped to [4, max]. Returns (in, out) lists."""
    rng = np.random.default_rng(seed)
    inp = np.clip(rng.lognormal(np.log(220), 0.9, n), 4, max_input).astype(int)
    out = np.clip(rng.lognormal(np.log(200), 0.8, n), 4, max_output).astype(int)
    return inp.tolist(), out.tolist()


# ---- arithmetic of a Llama-shaped model ---------------------------------------------------------------------
@dataclass(frozen=True)
class ModelMath:
    """FLOPs and bytes of a Llama-shaped config, for rooflines (L layers, D model, F ffn, N q heads, K kv heads,
    H head dim, V vocab). Dense matmuls: 2 FLOPs per weight per token (q/k/v/o and the three MLP projections of
    every layer; the lm_head only for the rows a step samples). Causal attention: a query at position p attends
    to p + 1 keys, 4 N H (p + 1) FLOPs per layer (QK^T and PV). Norms, RoPE, softmax and the embedding gather are
    left out (under 1% of either figure at these shapes)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    weight_itemsize: int = 2
    kv_itemsize: int = 2

    @classmethod
    def from_config(cls, cfg: dict, weight_itemsize: int = 2, kv_itemsize: int = 2) -> ModelMath:
        heads = cfg["num_attention_heads"]
        return cls(
            cfg["num_hidden_layers"],
            cfg["hidden_size"],
            cfg["intermediate_size"],
            heads,
            cfg.get("num_key_value_heads") or heads,
            cfg.get("head_dim") or cfg["hidden_size"] // heads,
            cfg["vocab_size"],
            weight_itemsize,
            kv_itemsize,
        )

    @property
    def layer_params(self) -> int:
        D, H = self.hidden, self.head_dim
        return D * (self.heads + 2 * self.kv_heads) * H + self.heads * H * D + 3 * D * self.ffn

    @property
    def matmul_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def weight_bytes(self) -> int:
        """Weights a step reads: every layer's matmuls and the lm_head (the embedding table only per token)."""
        return (self.matmul_params + self.hidden * self.vocab) * self.weight_itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.kv_itemsize

    def dense_flops(self, tokens, sampled):
        """Matmul FLOPs of a step computing `tokens` tokens and sampling `sampled` rows."""
        return 2 * self.matmul_params * tokens + 2 * self.hidden * self.vocab * sampled

    def attn_flops(self, new, start):
        """Causal attention FLOPs of a chunk of `new` tokens at positions start .. start + new - 1 (works on
        numpy arrays of chunks too)."""
        return 4 * self.layers * self.heads * self.head_dim * (new * start + new * (new + 1) / 2)


# ---- engine flags shared by the jaxllm scripts ---------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder; omitted: the demo model")
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="generate a config + tokenizer of this shape in a temp dir (use with --load-format dummy)",
    )
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument("--dtype", default="auto")
    from jaxllm.quantization import METHODS

    p.add_argument(
        "--quantization",
        "-q",
        choices=sorted(METHODS),
        default=None,
        help="as vLLM's; with --shape, gptq / awq write a quantization_config for dummy weights",
    )
    p.add_argument("--quant-bits", type=int, default=4, help="--shape with --quantization gptq: bits (4 or 8)")
    p.add_argument("--quant-group-size", type=int, default=128, help="--shape with --quantization gptq / awq")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--compilation-cache-dir", default=default_compilation_cache_dir())
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8 / fp8_e4m3 / fp8_e5m2")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="off by default here: random prompts share nothing, as in vLLM's bench",
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true", help="MoE shapes: whole experts per tp device")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result JSON path (default bench/results/<script>_<device>.json)")
    p.add_argument("--log-level", default="info")


def setup_logging(level: str = "info") -> None:
    import logging

    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%H:%M:%S",
    )


def engine_kwargs(args, model: str | None) -> dict:
    kw = dict(
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        seed=args.seed,
        compilation_cache_dir=args.compilation_cache_dir or None,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        quantization=getattr(args, "quantization", None),
    )
    if getattr(args, "tokenizer", None):
        kw["tokenizer"] = args.tokenizer
    return kw


def engine_summary(llm) -> dict:
    """What the engine was built with: limits, buckets, KV size, backend."""
    eng = llm.llm_engine
    r = eng.runner
    sc = eng.scheduler.config if hasattr(eng.scheduler, "config") else None
    return dict(
        max_model_len=eng.max_model_len,
        max_num_seqs=getattr(sc, "max_num_seqs", None),
        max_num_batched_tokens=getattr(sc, "max_num_batched_tokens", None),
        seq_buckets=list(r.seq_buckets),
        token_buckets=list(r.token_buckets),
        num_variants_compiled=len(r.programs.compiled),
        kv_cache_blocks=r.num_blocks,
        block_size=r.block_size,
        kv_cache_tokens=(r.num_blocks - 1) * r.block_size,
        attention_backend=r.attn.backend,
        step_temp_bytes=r.programs.temp_bytes(),  # the compiled steps' largest temporary buffer (per device)
        dtype=str(eng.model_config.dtype),
        kv_cache_dtype=str(r.kv_values_dtype),
        enforce_eager=llm.engine_args.enforce_eager,
        quantization=None if eng.model_config.quantization is None else eng.model_config.quantization.describe(),
    )


# ---- results -------------------------------------------------------------------------------------------------
def git_commit() -> str | None:
    """$GIT_COMMIT (or $BENCH_COMMIT) when set: the device copy of the tree has no .git; else git's HEAD."""
    for var in ("GIT_COMMIT", "BENCH_COMMIT"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(with_jax: bool = True) -> dict:
    env = dict(
        host=platform.node(),
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        commit=git_commit(),
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    # settings a run can take from its environment rather than its command line (A/B knobs, XLA flags)
    settings = {k: v for k, v in os.environ.items() if k.startswith("JAXLLM_") or k == "XLA_FLAGS"}
    if settings:
        env["env_vars"] = settings
    if with_jax:
        import jax

        d = jax.devices()[0]
        env.update(
            jax=jax.__version__, backend=jax.default_backend(), device=d.device_kind, num_devices=jax.device_count()
        )
    return env


def device_tag(env: dict) -> str:
    return "".join(c if c.isalnum() else "-" for c in env.get("device", "cpu")).strip("-").lower()


def write_result(script: str, result: dict, out: str | None = None) -> str:
    path = out or os.path.join(RESULTS, f"{script}_{device_tag(result.get('env', {}))}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}", flush=True)
    return path


def pct(values, qs=(50, 90, 99)) -> dict:
    if not len(values):
        return {f"p{q}": None for q in qs} | {"mean": None}
    a = np.asarray(values, np.float64)
    return {f"p{q}": float(np.percentile(a, q)) for q in qs} | {"mean": float(a.mean())}
