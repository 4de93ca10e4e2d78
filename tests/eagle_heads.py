"""Tiny EAGLE / EAGLE-3 heads and draft models saved in the public checkpoints' layout (config.json keys and tensor
names of yuhuili/EAGLE-LLaMA3-Instruct-8B and yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, as vLLM's llama_eagle.py /
llama_eagle3.py read them; see jaxllm/spec_decode/heads.py), with random weights."""

from __future__ import annotations

import json
import os

import torch


def _linear(out_f: int, in_f: int, g: torch.Generator, std: float = 0.2) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=g) * std


def _layer(prefix: str, D: int, D_in: int, N: int, K: int, H: int, F: int, g) -> dict:
    t = {
        f"{prefix}self_attn.q_proj.weight": _linear(N * H, D_in, g),
        f"{prefix}self_attn.k_proj.weight": _linear(K * H, D_in, g),
        f"{prefix}self_attn.v_proj.weight": _linear(K * H, D_in, g),
        f"{prefix}self_attn.o_proj.weight": _linear(D, N * H, g),
        f"{prefix}mlp.gate_proj.weight": _linear(F, D, g),
        f"{prefix}mlp.up_proj.weight": _linear(F, D, g),
        f"{prefix}mlp.down_proj.weight": _linear(D, F, g),
        f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
    }
    return t


def save_eagle_head(
    out_dir: str,
    target_cfg: dict,
    method: str,
    seed: int = 0,
    draft_vocab: int = 32,
    feature_layers: list[int] | None = None,
) -> str:
    """An EAGLE (method "eagle") or EAGLE-3 head for a target with config target_cfg (HF dict), saved as
    config.json + pytorch_model.bin the way the published heads are."""
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    D, N, V = target_cfg["hidden_size"], target_cfg["num_attention_heads"], target_cfg["vocab_size"]
    K, F = target_cfg.get("num_key_value_heads", N), target_cfg["intermediate_size"]
    H = D // N
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": D,
        "initializer_range": 0.02,
        "intermediate_size": F,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": N,
        "num_key_value_heads": K,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": V,
        "rope_theta": target_cfg.get("rope_theta", 10000.0),
    }
    if method == "eagle":
        cfg["bias"] = False
        tensors = _layer("layers.0.", D, D, N, K, H, F, g)
        tensors["fc.weight"] = _linear(D, 2 * D, g)
        tensors["embed_tokens.weight"] = torch.randn(V, D, generator=g)  # the published heads carry a copy
    else:
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
        if feature_layers is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = feature_layers
        n = len(feature_layers or (0, 0, 0))
        tensors = _layer("midlayer.", D, 2 * D, N, K, H, F, g)
        tensors["midlayer.input_layernorm.weight"] = 1 + 0.1 * torch.randn(D, generator=g)
        tensors["midlayer.hidden_norm.weight"] = 1 + 0.1 * torch.randn(D, generator=g)
        tensors["norm.weight"] = 1 + 0.1 * torch.randn(D, generator=g)
        tensors["fc.weight"] = _linear(D, n * D, g)
        tensors["lm_head.weight"] = _linear(draft_vocab, D, g)
        targets = torch.sort(torch.randperm(V, generator=g)[:draft_vocab]).values  # the draft vocabulary's ids
        tensors["d2t"] = targets - torch.arange(draft_vocab)  # offsets: target id = draft id + d2t[draft id]
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[targets] = True
        tensors["t2d"] = t2d
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    torch.save({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "pytorch_model.bin"))
    return out_dir


def save_draft_model(out_dir: str, vocab_size: int, seed: int = 1, **overrides) -> str:
    """A tiny random Llama draft model (1 layer, narrower than the tests' target) with the target's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **(
            {
                "vocab_size": vocab_size,
                "hidden_size": 32,
                "intermediate_size": 48,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "max_position_embeddings": 256,
                "rms_norm_eps": 1e-5,
            }
            | overrides
        )
    )
    LlamaForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def reference_proposals(model, head_dir: str, method: str, tokens: list[int], k: int) -> list[int]:
    """The head's k greedy proposals after tokens, computed in torch from the published layout the way vLLM's
    llama_eagle.py / llama_eagle3.py run it, with the HF target's hidden states (an independent check of the
    loader and of jaxllm's drafter): pairs (feature of position p, token p + 1) over the whole sequence, then the
    head's own output state as the feature of each next proposal."""
    with open(os.path.join(head_dir, "config.json")) as f:
        cfg = json.load(f)
    sd = torch.load(os.path.join(head_dir, "pytorch_model.bin"))
    D, N, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
    Kh, H = cfg["num_key_value_heads"], D // N
    p = "layers.0." if method == "eagle" else "midlayer."
    emb, lm_head = model.model.embed_tokens.weight, model.lm_head.weight

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # [T, heads, H], HF's rotate-half convention
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, H, 2, dtype=torch.float32) / H))
        ang = torch.cat([pos[:, None] * inv] * 2, -1)[:, None, :]
        rot = torch.cat([-x[..., H // 2 :], x[..., : H // 2]], -1)
        return x * ang.cos() + rot * ang.sin()

    def layer(attn_in, resid):  # causal over all rows, positions 0..T-1
        T = attn_in.shape[0]
        pos = torch.arange(T, dtype=torch.float32)
        q = rope((attn_in @ sd[p + "self_attn.q_proj.weight"].T).view(T, N, H), pos)
        kk = rope((attn_in @ sd[p + "self_attn.k_proj.weight"].T).view(T, Kh, H), pos).repeat_interleave(N // Kh, 1)
        v = (attn_in @ sd[p + "self_attn.v_proj.weight"].T).view(T, Kh, H).repeat_interleave(N // Kh, 1)
        s = torch.einsum("tnh,snh->nts", q, kk) / H**0.5
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        o = torch.einsum("nts,snh->tnh", s.softmax(-1), v).reshape(T, N * H) @ sd[p + "self_attn.o_proj.weight"].T
        x = resid + o
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        g, u = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        return x + (torch.nn.functional.silu(g) * u) @ sd[p + "mlp.down_proj.weight"].T

    with torch.no_grad():
        hs = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        if method == "eagle":
            feats = hs[-1][0]  # the target's last hidden states, after its final norm
        else:
            layers = cfg.get("eagle_aux_hidden_state_layer_ids") or (
                2,
                model.config.num_hidden_layers // 2,
                model.config.num_hidden_layers - 3,
            )
            feats = torch.cat([hs[i][0] for i in layers], -1) @ sd["fc.weight"].T
        toks, out = list(tokens[1:]), []
        for _ in range(k):
            e = emb[torch.tensor(toks)]
            if method == "eagle":
                x = torch.cat([e, feats], -1) @ sd["fc.weight"].T
                hidden = layer(x, x)
                logits = hidden[-1] @ lm_head.T
                nxt = int(logits.argmax())
            else:
                attn_in = torch.cat(
                    [rms(e, sd[p + "input_layernorm.weight"]), rms(feats, sd[p + "hidden_norm.weight"])], -1
                )
                hidden = layer(attn_in, feats)
                d = int((rms(hidden[-1], sd["norm.weight"]) @ sd["lm_head.weight"].T).argmax())
                nxt = d + int(sd["d2t"][d])
            out.append(nxt)
            feats = torch.cat([feats, hidden[-1:]], 0)
            toks.append(nxt)
    return out
