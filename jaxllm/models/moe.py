"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE: routing, the experts' grouped matmuls, and
how they split over the tensor-parallel axis with or without expert parallelism.

    moe_mlp(lp, h [T, D], cfg, mesh) -> [T, D]   the routed experts' sum (the shared expert is the decoder's)

Routing (as HF and vLLM): router logits [T, E] in the model dtype, softmax over all experts in float32, the
top_k of them per token; Mixtral, and Qwen with norm_topk_prob, rescale those k weights to sum to 1.

Compute: the T * k (token, expert) pairs are sorted by expert, their tokens' rows gathered [T * k, D], and each
expert's rows multiplied by that expert's weights by one grouped GEMM over all experts with the group sizes from
the routing: no capacity, no dropped tokens. On GPU (the decoder's "pallas" backend) the grouped GEMM is
kernels_pallas.grouped_matmul (Pallas, Triton lowering: tiles of one expert's rows, only the chosen experts'
weights read); elsewhere (CPU) jax.lax.ragged_dot. The rows go back to
their tokens by the inverse permutation and are summed with the routing weights (float32). expert_mlp_dense is
the reference: every token through every expert (an einsum over E), weighted 0 where not routed. Steps with at
most GATHERED_MAX_PAIRS pairs (decode of small batches) can instead gather each pair's expert weights and run
batched matrix-vector products (expert_mlp_gathered): they then read only the chosen experts' weights whatever
ragged_dot's lowering does with the idle ones; off (0) until bench/moe_matmul.py's GPU figures say where it pays.
Quantized experts (GPTQ / AWQ / compressed-tensors checkpoints, jaxllm/models/moe_quant.py): the experts the step's
tokens chose are dequantized to the model dtype inside the step, layer by layer, and run through the same grouped
matmul (a fused int4 / fp8 grouped GEMM is not written yet).

Why not ragged_dot on GPUs: XLA lowers it by its RaggedDotRewriter into one dense dot over all E experts (E times
the grouped FLOPs), and --xla_gpu_experimental_use_ragged_dot_fusion=true did not change that (H200, jax 0.11.2,
Qwen3-30B-A3B shape, both GEMMs of a layer: 261 us at T = 1 and 6522 us at T = 512, against 5.1 and 72 us for a
dense GEMM of the same FLOPs; JAX's Mosaic GPU ragged_dot did not compile within ~100 s). bench/moe_matmul.py
times the Pallas kernel (grouped_gemms_pallas, expert_mlp_pallas) against those.

Tensor parallelism (a mesh with tp > 1) runs the experts inside shard_map over "tp". Attention is tensor
parallel, so every tp rank holds every token of the step; routing is recomputed on each rank (a [T, D] x
[D, E] product) and nothing has to be dispatched:
  - default: each rank holds every expert's ffn slice F / tp (the dense MLP's Megatron split); the partial
    [T, D] outputs are summed by one psum, the same all-reduce as the dense MLP's down projection.
  - expert parallel (enable_expert_parallel): each rank holds E / tp whole experts and runs only the pairs
    routed to them (the others sort past its groups and give zeros); the same one psum combines the ranks.
    That is the all-gather dispatch with nothing to gather, since the tokens are already replicated. An
    all-to-all dispatch pays off only when ranks hold different tokens (data-parallel attention, which jaxllm
    does not have): here it would send T * k rows out and back where the psum moves T rows once.
  Expert parallelism keeps every expert's GEMMs whole (full ffn width per expert), which suits many small
  experts (Qwen3-30B-A3B: 128 experts of width 768, 96 columns each at tp 8 without it).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig, MoeConfig
from jaxllm.models.moe_quant import QuantizedExperts, num_experts, routed_experts, shard_specs
from jaxllm.models.params import ParamSpec
from kernels_pallas.grouped import grouped_matmul

# Steps of at most this many (token, expert) pairs use expert_mlp_gathered (0: never; see the module docstring).
GATHERED_MAX_PAIRS = 0


def moe_param_specs(cfg: ModelConfig) -> dict:
    """A MoE layer's weights in place of w_gate_up / w_down: the router [D, E], the experts' fused gate/up
    [E, D, 2, F] and down [E, F, D], and Qwen2-MoE's shared expert (a dense MLP with a sigmoid gate [D])."""
    m, D = cfg.moe, cfg.hidden_size
    E, F = m.num_experts, m.intermediate_size
    e_axis, f_axis = ("experts", None) if cfg.expert_parallel else (None, "ffn")
    specs = {
        "router": ParamSpec((D, E), ("embed", None)),
        "w_experts_gate_up": ParamSpec((E, D, 2, F), (e_axis, "embed", None, f_axis)),
        "w_experts_down": ParamSpec((E, F, D), (e_axis, f_axis, "embed")),
    }
    if m.shared_intermediate_size:
        Fs = m.shared_intermediate_size
        specs["w_shared_gate_up"] = ParamSpec((D, 2, Fs), ("embed", None, "ffn"))
        specs["w_shared_down"] = ParamSpec((Fs, D), ("ffn", "embed"))
        specs["w_shared_expert_gate"] = ParamSpec((D,), ("embed",))
    return specs


def expert_linear_names(cfg: ModelConfig) -> tuple[str, tuple[str, str, str]]:
    """(prefix, (gate, up, down)) of a MoE layer's checkpoint tensors: Mixtral's block_sparse_moe.experts.{e}.w1 /
    w3 / w2, Qwen's mlp.experts.{e}.gate_proj / up_proj / down_proj (the router is prefix + "gate")."""
    if cfg.architecture == "mixtral":
        return "block_sparse_moe.", ("w1", "w3", "w2")
    return "mlp.", ("gate_proj", "up_proj", "down_proj")


# Other spellings of an architecture's tensor names -> the ones the weight tables use (checkpoint_files.CheckpointReader). Mixtral:
# the Hub's checkpoints (and vLLM) name block_sparse_moe.gate and block_sparse_moe.experts.{e}.w1 / w3 / w2; the
# quantizers of transformers 5 write mlp.gate and mlp.experts.{e}.gate_proj / up_proj / down_proj (gptqmodel) or
# block_sparse_moe.experts.{e}.gate_proj / up_proj / down_proj (llm-compressor).
CHECKPOINT_ALIASES: dict[str, tuple[tuple[re.Pattern, str], ...]] = {
    "mixtral": (
        (re.compile(r"^(model\.layers\.\d+)\.mlp\.(experts\.\d+\.|gate\.)"), r"\1.block_sparse_moe.\2"),
        (re.compile(r"(\.block_sparse_moe\.experts\.\d+)\.gate_proj\."), r"\1.w1."),
        (re.compile(r"(\.block_sparse_moe\.experts\.\d+)\.up_proj\."), r"\1.w3."),
        (re.compile(r"(\.block_sparse_moe\.experts\.\d+)\.down_proj\."), r"\1.w2."),
    ),
}


def route(h, router, m: MoeConfig):
    """h [T, D], router [D, E] -> (weights [T, k] float32, expert ids [T, k] int32)."""
    logits = jnp.einsum("TD,DE->TE", h, router).astype(jnp.float32)  # HF rounds them to the model dtype first
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), m.top_k)
    if m.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def expert_mlp(h, weights, ids, w_gate_up, w_down, first_expert=0, quantize_inputs=None, impl="auto"):
    """The routed pairs of experts first_expert .. first_expert + E' - 1 (w_gate_up [E', D, 2, F'], w_down
    [E', F', D]: all experts, or one rank's), summed per token with their weights: [T, D] float32. Pairs of
    other experts contribute nothing. One grouped GEMM per projection over the pairs sorted by expert.
    quantize_inputs: W8A8 experts' (gate_up's, down's) activation rounding (moe_quant.py), or None.
    impl: the grouped GEMM, "pallas" (kernels_pallas.grouped_matmul; interpret mode off GPU), "ragged_dot", or
    "auto": the Pallas kernel on GPU, ragged_dot elsewhere (see the module docstring)."""
    if impl not in ("auto", "pallas", "ragged_dot"):
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'pallas', 'ragged_dot'.")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "ragged_dot"
    gemm = _pallas_gemm if impl == "pallas" else jax.lax.ragged_dot
    T, k = ids.shape
    E, D = w_gate_up.shape[:2]
    q_gate_up, q_down = quantize_inputs or (_same, _same)
    local = ids.reshape(-1) - first_expert
    local = jnp.where((local >= 0) & (local < E), local, E)  # E: not ours, sorted after every group
    order = jnp.argsort(local, stable=True)  # [T * k] pair indices (t * k + slot) by expert
    sizes = jnp.bincount(local, length=E).astype(jnp.int32)  # pairs per expert; E (not ours) is not counted
    rows = q_gate_up(h)[order // k]  # [T * k, D]: each pair's token
    gate_up = gemm(rows, w_gate_up.reshape(E, D, -1), sizes)  # [T * k, 2 F']: gate | up
    gate, up = jnp.split(gate_up, 2, axis=-1)
    out = gemm(q_down(jax.nn.silu(gate) * up), w_down, sizes)  # [T * k, D]
    # Rows past the groups (other ranks' experts) are zeros from the kernel; ragged_dot leaves them unspecified.
    out = jnp.where((local[order] < E)[:, None], out.astype(jnp.float32), 0.0)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(T * k, dtype=order.dtype))
    return jnp.einsum("TKD,TK->TD", out[inverse].reshape(T, k, D), weights)


def expert_mlp_gathered(h, weights, ids, w_gate_up, w_down, first_expert=0, quantize_inputs=None):
    """expert_mlp as batched matrix-vector products over each pair's gathered expert weights ([T * k] copies of
    [D, 2, F'] and [F', D]): reads only the chosen experts, for steps with few pairs."""
    T, k = ids.shape
    E = w_gate_up.shape[0]
    q_gate_up, q_down = quantize_inputs or (_same, _same)
    local = ids.reshape(-1) - first_expert
    mine = (local >= 0) & (local < E)
    local = jnp.clip(local, 0, E - 1)
    rows = jnp.repeat(q_gate_up(h), k, axis=0)  # [T * k, D], pair p = t * k + slot
    gate_up = jnp.einsum("PD,PDCF->PCF", rows, w_gate_up[local])
    out = jnp.einsum("PF,PFD->PD", q_down(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]), w_down[local])
    out = jnp.where(mine[:, None], out.astype(jnp.float32), 0.0)
    return jnp.einsum("TKD,TK->TD", out.reshape(T, k, -1), weights)


def expert_mlp_dense(h, weights, ids, w_gate_up, w_down):
    """Reference of expert_mlp (all experts): every token through every expert, weighted by its routing weight
    (0 for the experts it was not routed to). E / k times expert_mlp's FLOPs."""
    T, E = h.shape[0], w_gate_up.shape[0]
    dense = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], ids].add(weights)
    gate_up = jnp.einsum("TD,EDCF->TECF", h, w_gate_up)
    out = jnp.einsum("TEF,EFD->TED", jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], w_down)
    return jnp.einsum("TED,TE->TD", out.astype(jnp.float32), dense)


def _same(x):
    return x


def _pallas_gemm(rows, w, sizes):
    """ragged_dot's signature over the Pallas grouped GEMM (interpret mode off GPU, for tests; the reference
    for shapes the kernel does not take, see kernels_pallas._grouped.supported)."""
    return grouped_matmul(rows, sizes, w, interpret=jax.default_backend() != "gpu")


def _experts(h, weights, ids, w_gate_up, w_down, first_expert=0, impl="auto"):
    quantize_inputs = None
    if isinstance(w_gate_up, QuantizedExperts) or isinstance(w_down, QuantizedExperts):
        # the step's routed experts, dequantized; ids become their indices among them (moe_quant.py)
        ids, w_gate_up, w_down, quantize_inputs = routed_experts(ids, w_gate_up, w_down, first_expert, h.dtype)
        first_expert = 0
    if ids.size <= GATHERED_MAX_PAIRS:  # static: the step's token count
        return expert_mlp_gathered(h, weights, ids, w_gate_up, w_down, first_expert, quantize_inputs)
    return expert_mlp(h, weights, ids, w_gate_up, w_down, first_expert, quantize_inputs, impl)


def moe_mlp(lp, h, cfg: ModelConfig, mesh=None, impl="auto"):
    """The routed experts' output [T, D] (h.dtype) of one MoE layer (lp: its weights, moe_param_specs).
    impl: expert_mlp's grouped GEMM ("auto" | "pallas" | "ragged_dot"; the decoder follows its attention backend)."""
    m = cfg.moe
    tp = 1 if mesh is None else int(mesh.shape.get("tp", 1))
    args = (h, lp["router"], lp["w_experts_gate_up"], lp["w_experts_down"])
    if tp == 1:
        weights, ids = route(h, lp["router"], m)
        return _experts(h, weights, ids, *args[2:], impl=impl).astype(h.dtype)
    from jax.sharding import PartitionSpec as P

    def local(h, router, w_gate_up, w_down):
        weights, ids = route(h, router, m)
        first = jax.lax.axis_index("tp") * num_experts(w_gate_up) if cfg.expert_parallel else 0
        # Summed in the model dtype, as the dense MLP's all-reduce is.
        out = _experts(h, weights, ids, w_gate_up, w_down, first, impl)
        return jax.lax.psum(out.astype(h.dtype), "tp")

    if cfg.expert_parallel:
        specs = (P("tp", None, None, None), P("tp", None, None))
    else:
        specs = (P(None, None, None, "tp"), P(None, "tp", None))
    specs = tuple(
        shard_specs(w) if isinstance(w, QuantizedExperts) else spec for w, spec in zip(args[2:], specs, strict=True)
    )
    # check_vma=False: the psum makes the output the same on every rank, which out_specs P() states.
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), *specs), out_specs=P(), check_vma=False)(*args)
