"""Speculative decoding at engine start: speculative_config -> the proposer, the drafter's weights and the policy.

plan() runs before the target's weights load: it resolves the method (a "model" without "method" is detected
from its files, as vLLM does), reads the drafter's config and checks it against the target's (vocabulary, EAGLE-3
feature layers), so a bad config fails early. Speculation.load() then loads the drafter's weights on the target's
mesh (a draft model is sharded over tp as the target is; so is an EAGLE head's layer) and sizes its KV pages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax

from jaxllm.config import ModelConfig
from jaxllm.engine.configs import SpeculativeConfig
from jaxllm.spec_decode.drafter import Drafter
from jaxllm.spec_decode.policy import VERIFY_COSTS, SpecPolicy

# The largest batch whose verify steps are compiled at start-up (the policy never speculates above it).
MAX_SPEC_SEQS = 64


@dataclass
class Speculation:
    config: SpeculativeConfig  # method resolved
    policy: SpecPolicy
    drafter: Drafter | None = None  # a draft model or EAGLE head (None: n-gram lookup on the host)
    draft_hf: dict | None = None
    draft_params: object = None

    def load(self, mesh, load_format: str, seed: int) -> None:
        """Loads the drafter's weights (before the target's KV cache is sized: they take device memory)."""
        d = self.drafter
        if d is None:
            return
        if d.method == "draft_model":
            from jaxllm.models.loader import load_params

            self.draft_params = load_params(self.config.model, d.cfg, mesh, load_format=load_format, seed=seed)
        else:
            from jaxllm.spec_decode.heads import load_head

            self.draft_params = load_head(
                self.config.model,
                d.method,
                d.cfg,
                self.draft_hf,
                d.target_hidden,
                mesh,
                load_format=load_format,
                seed=seed,
            )
        jax.block_until_ready(self.draft_params)

    @property
    def weight_bytes(self) -> int:
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.draft_params or {}))

    def kv_bytes_per_block(self, block_size: int, tp: int) -> int:
        """The drafter's KV bytes per page on one device (0 for n-gram)."""
        if self.drafter is None:
            return 0
        from jaxllm.engine.runner import ModelRunner

        return ModelRunner.kv_bytes_per_block(self.drafter.cfg, block_size, "auto", tp)

    def runner_kwargs(self) -> dict:
        return dict(
            num_spec_tokens=self.config.num_speculative_tokens,
            spec_max_seqs=self.policy.max_seqs,
            drafter=self.drafter,
            draft_params=self.draft_params,
        )


def plan(spec: SpeculativeConfig, target: ModelConfig, *, gpu: bool, max_num_seqs: int) -> Speculation:
    """The method, the drafter's static description and the policy (no weights read; see the module
    docstring). ValueErrors name the problem in vLLM's words where vLLM has them."""
    method, drafter, hf = spec.method, None, None
    if method is None:
        from jaxllm.spec_decode.heads import detect_method

        method = detect_method(spec.model)
        spec = replace(spec, method=method)
    K = spec.num_speculative_tokens
    if method == "draft_model":
        dcfg = ModelConfig.from_hf(spec.model, dtype=target.dtype)
        if dcfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"Target and draft model should have the same vocabulary size. Target model vocab_size="
                f"{target.vocab_size}. Draft model vocab_size={dcfg.vocab_size}. Using models with different "
                "tokenizers can cause out-of-bounds errors during speculative decoding."
            )
        if dcfg.quantization is not None:
            raise ValueError("speculative_config: quantized draft models are not supported yet.")
        drafter = Drafter("draft_model", dcfg, K, target.hidden_size)
    elif method in ("eagle", "eagle3"):
        from jaxllm.spec_decode.heads import feature_layers, head_config

        if target.architecture not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"{method} heads are supported for Llama-family targets; got {target.architecture}.")
        dcfg, hf = head_config(spec.model, method, target.dtype)
        if hf["vocab_size"] != target.vocab_size:
            raise ValueError(
                f"The {method} head's vocab_size={hf['vocab_size']} differs from the target model's "
                f"vocab_size={target.vocab_size}: the head was trained for another model."
            )
        if dcfg.hidden_size != target.hidden_size and (method == "eagle" or "target_hidden_size" not in hf):
            raise ValueError(
                f"The {method} head's hidden_size={dcfg.hidden_size} differs from the target model's "
                f"hidden_size={target.hidden_size}."
            )
        layers = feature_layers(hf, target.num_layers) if method == "eagle3" else ()
        drafter = Drafter(method, dcfg, K, hf.get("target_hidden_size", target.hidden_size), layers)
    policy = SpecPolicy(K, VERIFY_COSTS["gpu" if gpu else "cpu"], spec.disable_by_batch_size)
    # Verify steps are compiled at start-up for the batches that may speculate: below the fixed threshold, or up
    # to where the cost model says it pays with every proposal accepted (at most MAX_SPEC_SEQS sequences).
    policy.max_seqs = min(policy.max_batch(1.0 + K), MAX_SPEC_SEQS, max_num_seqs)
    return Speculation(spec, policy, drafter, hf)
