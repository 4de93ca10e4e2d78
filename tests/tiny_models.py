"""Tiny random HF checkpoints for every supported architecture, saved the way hubs ship them."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

ARCHS = ("llama", "llama31", "mistral", "qwen2", "baichuan7b", "baichuan13b")
# Issue 36's architectures. Gemma's soft-caps are low and its weights larger than HF's init so that the caps, the
# windows (5 tokens; the parity prompts are longer) and the global layers' RoPE scaling change the logits.
NEW_ARCHS = ("qwen3", "llama32", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def hf_config(arch: str):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if arch == "llama":
        return LlamaConfig(**_COMMON, rope_theta=10000.0)
    if arch == "llama31":
        return LlamaConfig(
            **_COMMON,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        )
    if arch == "mistral":
        return MistralConfig(**_COMMON, sliding_window=7)
    if arch == "qwen2":
        return Qwen2Config(**_COMMON, tie_word_embeddings=True)
    if arch == "qwen3":  # head_dim 32 != hidden / heads, as Qwen3-0.6B's 128 != 1024 / 16
        return Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True)
    if arch in ("qwen2_yarn", "qwen3_yarn"):  # Qwen's long-context recipe, its original context shrunk to 64
        # Larger weights than HF's init: peaked attention, which YaRN's attention factor changes visibly.
        config = Qwen2Config if arch == "qwen2_yarn" else Qwen3Config
        extra = dict(tie_word_embeddings=True) if arch == "qwen2_yarn" else dict(head_dim=32)
        return config(
            **dict(_COMMON, max_position_embeddings=64),
            **extra,
            initializer_range=0.1,
            rope_theta=10000.0,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        )
    if arch == "qwen2_dynamic":  # dynamic NTK: HF's base at 64 tokens is vLLM's (and jaxllm's) at every length
        return Qwen2Config(
            **dict(_COMMON, max_position_embeddings=32), rope_scaling=dict(rope_type="dynamic", factor=2.0)
        )
    if arch == "llama32":  # Llama-3.2-1B's layout: tied embeddings, llama3 RoPE scaling (factor 32)
        return LlamaConfig(
            **_COMMON,
            head_dim=32,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        )
    if arch == "gemma2":  # layers: sliding, global, sliding
        return Gemma2Config(
            **dict(_COMMON, num_hidden_layers=3),
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=5,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=3.0,
            initializer_range=0.1,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    if arch == "gemma3":  # layers: sliding, sliding, global (Gemma 3 alternates 5 : 1)
        return Gemma3TextConfig(
            **dict(_COMMON, num_hidden_layers=3),
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=5,
            sliding_window_pattern=3,
            initializer_range=0.2,
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
            },
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    if arch == "mixtral":
        return MixtralConfig(**dict(_COMMON, intermediate_size=32), num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2_moe":  # layer 1 is a dense MLP (mlp_only_layers); a shared expert beside the routed ones
        return Qwen2MoeConfig(
            **_COMMON,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **_COMMON, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
        )
    if arch in ("baichuan7b", "baichuan13b"):  # the equivalent Llama: MHA, no biases
        return LlamaConfig(**dict(_COMMON, num_key_value_heads=_COMMON["num_attention_heads"]))
    raise ValueError(arch)


def make_hf_model(arch: str, seed: int = 0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():  # small random norms and biases so they matter in the parity check
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # MoE routers: clear top-k margins, as trained ones have
                p.mul_(20.0)
    return model


def save_checkpoint(model, arch: str, out_dir: str, fmt: str = "safetensors") -> str:
    """Saves model as arch's checkpoint: HF format for the native ones, Baichuan's W_pack layout and
    config for baichuan*. fmt: safetensors | bin | sharded (safetensors with an index)."""
    os.makedirs(out_dir, exist_ok=True)
    if not arch.startswith("baichuan"):
        if fmt == "bin":
            model.save_pretrained(out_dir, safe_serialization=False)
            if not any(f.endswith(".bin") for f in os.listdir(out_dir)):  # transformers 5 always writes safetensors
                _write_bin(model.state_dict(), out_dir)
        else:
            model.save_pretrained(out_dir, max_shard_size="20KB" if fmt == "sharded" else "10GB")
        return out_dir
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = model.config
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        state[p + "W_pack.weight"] = torch.cat(
            [state.pop(p + "q_proj.weight"), state.pop(p + "k_proj.weight"), state.pop(p + "v_proj.weight")]
        )
    arch_name = "BaiChuanForCausalLM" if arch == "baichuan7b" else "BaichuanForCausalLM"
    bc = dict(
        architectures=[arch_name],
        model_type="baichuan",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        hidden_act="silu",
        torch_dtype="float32",
    )
    if arch == "baichuan7b":
        bc["max_position_embeddings"] = cfg.max_position_embeddings
    else:
        bc["model_max_length"] = cfg.max_position_embeddings
        bc["position_embedding"] = "alibi"  # tiny 13B stand-in: hidden 64, so say it explicitly
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(bc, f)
    if fmt == "bin":
        _write_bin(state, out_dir)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def _write_bin(state, out_dir):
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(out_dir, f))
    torch.save({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "pytorch_model.bin"))


def alibi_reference_logits(model, token_ids: list[int]) -> np.ndarray:
    """Numpy forward pass of the Llama weights with ALiBi instead of RoPE (Baichuan-13B's attention),
    float64. Returns [len, V] logits."""
    from jaxllm.models.attention import alibi_slopes

    sd = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    N, H, eps = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads, cfg.rms_norm_eps
    T = len(token_ids)

    def norm(x, w):
        return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)

    x = sd["model.embed_tokens.weight"][token_ids]
    slopes = alibi_slopes(N).astype(np.float64)
    rel = np.arange(T)[None, :] - np.arange(T)[:, None]  # key - query
    bias = slopes[:, None, None] * rel[None]
    causal = np.where(rel <= 0, 0.0, -np.inf)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, sd[p + "input_layernorm.weight"])
        q, k, v = (h @ sd[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        q, k, v = (a.reshape(T, N, H).transpose(1, 0, 2) for a in (q, k, v))
        s = q @ k.transpose(0, 2, 1) / np.sqrt(H) + bias + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        x = x + o.transpose(1, 0, 2).reshape(T, N * H) @ sd[p + "self_attn.o_proj.weight"].T
        h = norm(x, sd[p + "post_attention_layernorm.weight"])
        g = h @ sd[p + "mlp.gate_proj.weight"].T
        u = h @ sd[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ sd[p + "mlp.down_proj.weight"].T
    x = norm(x, sd["model.norm.weight"])
    return x @ sd["lm_head.weight"].T


_TEXT = """In the beginning was the engine, and the engine was paged. Blocks were counted and hashed,
and every request that came was given its pages, and when it finished they returned. The scheduler saw
the waiting and the running, and it chose by the budget of tokens. Then the sampler drew from the logits,
greedy or with a seed, and the detokenizer spoke the words aloud, one delta at a time."""


_JSON_TEXT = """{"name": "Ada", "age": 36, "tags": ["math", "engines"], "ok": true, "score": -1.5e3}
[{"id": 1, "city": "Paris"}, {"id": 2, "city": "Berlin"}, null, false, 0.25, "yes", "no"]"""
JSON_ALPHABET = list('{}[]":,0123456789-+.eE_ ')
_TOOL_TEXT = """<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> [TOOL_CALLS]"""
TOOL_ALPHABET = list("<>/|")


def save_tiny_tokenizer(out_dir: str, vocab_size: int = 128, json_text: bool = False, tool_text: bool = False) -> None:
    """A small BPE tokenizer (ids < vocab_size) with bos/eos and a chat template, saved in HF layout; json_text:
    trained on JSON too, with JSON's punctuation and digits in its alphabet (for structured-output tests);
    tool_text: also on tool-call markup, with <>/| in its alphabet (for tool-calling tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!? ")
    if json_text or tool_text:
        alphabet += [c for c in JSON_ALPHABET if c not in alphabet]
    if tool_text:
        alphabet += TOOL_ALPHABET
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(
        [_TEXT] * 4 + ([_JSON_TEXT] * 4 if json_text or tool_text else []) + ([_TOOL_TEXT] * 4 if tool_text else []),
        trainer,
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    fast.save_pretrained(out_dir)


def make_tiny_model_dir(arch: str, out_dir: str, seed: int = 0, json_text: bool = False, tool_text: bool = False):
    """A complete tiny model directory (weights, config, tokenizer; see save_tiny_tokenizer for json_text and
    tool_text); returns (dir, HF model)."""
    model = make_hf_model(arch, seed=seed)
    save_checkpoint(model, arch, out_dir)
    save_tiny_tokenizer(out_dir, model.config.vocab_size, json_text, tool_text)
    return out_dir, model


def tiny_serve_args(model_dir: str, *extra: str):
    """The server flags the real-engine server tests share for a tiny model: float32, eager, 128 positions, 96 KV
    blocks of 8, 8 sequences, 64 batched tokens, served as "tiny" (extra flags appended)."""
    from server.args import parse_args

    return parse_args(
        [
            model_dir,
            *("--dtype", "float32", "--max-model-len", "128", "--enforce-eager", "--num-gpu-blocks-override", "96"),
            *("--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "8"),
            *("--served-model-name", "tiny", "--disable-access-log", *extra),
        ]
    )
