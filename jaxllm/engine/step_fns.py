"""The pure functions the compiled programs are traced from (what a step computes; programs.py compiles them).

    packed_step_fn        one whole step: unpack the host inputs, the model, logits of the sampled rows,
                          sampling (and prompt logprobs); returns the sampled rows' hidden states too
    packed_sample_rows_fn the sampler-only program: logits of those hidden states, then sampling with other
                          flags (a step "run split": the bucket's start-up step program, then this)
    packed_spec_step_fn   a speculative (verify) step: the model over each sequence's last token and its
                          proposals, logits at every proposed position, the rejection sampler
    pipeline_head_fn      pp > 1: the last stage's hidden states -> logits and sampling

Static arguments (cfg, attn, flags, prompt_k, drafter) select a program; every other argument is an array. With a
drafter (spec_decode/drafter.py: a draft model or EAGLE head) the step programs also return what the drafter
reads of the target (EAGLE: hidden states), for the draft program that follows each step. With LoRA
(jaxllm/lora/; not with speculative decoding), the step's last argument is the adapter slot arrays and its host
inputs' last item each token's slot (None without LoRA); the sampled rows' slots ride in SamplingMetadata.lora_slots
(the lm_head adapters of the sampler-only program too, whose head then carries the slot arrays' "lora_lm_head").
Which adapters a batch mixes is data: never a new program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.engine.packing import PackedLayout, unpack_host_args
from jaxllm.engine.rejection_sampler import rejection_sample
from jaxllm.engine.sampler import SamplerFlags, sample
from jaxllm.lora.ops import LoRAInputs
from jaxllm.models.attention import AttentionConfig
from jaxllm.models.decoder import compute_logits, forward
from jaxllm.sharding import logical_to_spec
from jaxllm.spec_decode.drafter import target_features


def _forward(params, kv_caches, token_ids, meta, cfg: ModelConfig, attn: AttentionConfig, drafter, lora=None):
    """The model -> (kv_caches, hidden [T, D], the drafter's features [T, F] or None)."""
    capture = drafter.feature_layers if drafter is not None and drafter.method == "eagle3" else ()
    out = forward(params, kv_caches, token_ids, meta, cfg, attn, capture=capture, lora=lora)
    feats = target_features(params, out[1], out[2] if capture else None, cfg, drafter)
    if feats is not None:  # the draft program is compiled for replicated features
        feats = jax.lax.with_sharding_constraint(feats, _replicated(attn))
    return out[0], out[1], feats


def _replicated(attn: AttentionConfig):
    return jax.sharding.NamedSharding(attn.mesh, jax.sharding.PartitionSpec())


def gathered_logits(logits, mesh):
    """The sampled rows' logits [B, V] whole on every device of mesh (tp > 1: the lm_head's output is split over
    the vocabulary). The samplers pad, reshape, cumsum and index V in chunks (sampler.categorical), which XLA
    partitioned over tp as collectives around each op, the devices idle ~10 ms a step between them: on two H200s a
    tp 2 decode step of 256 rows took 30-33 ms (13.6-14.8 with this), and tp 2 ran at about half tp 1's throughput
    (bench/results/tp_{bf16,fp8}_tp{1,2}_h200x2_{b045587,54a37ef}.json). One all-gather of the float32 logits
    instead (B 512 x V 128k: 131 MB a device), as vLLM gathers them. The logits are first pinned to the lm_head's
    split, or XLA may gather the weight instead (1 GB of bf16 for Llama-3)."""
    if mesh is None or mesh.size == 1:
        return logits
    split = jax.sharding.NamedSharding(mesh, logical_to_spec((None, "vocab")))
    logits = jax.lax.with_sharding_constraint(logits, split)
    return jax.lax.with_sharding_constraint(logits, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _step_fn(
    params,
    kv_caches,
    token_ids,
    src_rows,
    prev_tokens,
    meta,
    logits_indices,
    smd,
    prompt_targets,
    lora: LoRAInputs | None = None,
    *,
    cfg: ModelConfig,
    attn: AttentionConfig,
    flags: SamplerFlags,
    prompt_k: int,
    drafter=None,
):
    # Inputs that are still on the device: the previous step's sampled token of that sequence.
    token_ids = jnp.where(src_rows >= 0, prev_tokens[jnp.maximum(src_rows, 0)], token_ids)
    kv_caches, hidden, feats = _forward(params, kv_caches, token_ids, meta, cfg, attn, drafter, lora)
    rows = hidden[logits_indices]
    # The sampled rows' hidden states are returned too ([B, D]: small; returning the [B, V] float32 logits
    # instead cost 3.6% of the throughput workload's time on an H100): a step whose sampler flags are not the
    # default can run this program and a sampler-only program on them (ModelRunner.launch).
    lora_head = None if lora is None else lora.weights["lm_head"]
    logits = gathered_logits(compute_logits(params, rows, cfg, lora_head, smd.lora_slots), attn.mesh)
    out = (
        kv_caches,
        *_sample_fn(
            params,
            hidden,
            prev_tokens,
            logits,
            smd,
            prompt_targets,
            cfg=cfg,
            flags=flags,
            prompt_k=prompt_k,
            lora=lora,
            mesh=attn.mesh,
        ),
        rows,
    )
    return out if drafter is None else out + (feats,)


def packed_step_fn(
    params,
    kv_caches,
    ints,
    floats,
    prev_tokens,
    layout: PackedLayout,
    lora_weights=None,
    *,
    cfg: ModelConfig,
    attn: AttentionConfig,
    flags: SamplerFlags,
    prompt_k: int,
    drafter=None,
):
    """_step_fn on the host inputs as pack_host_args made them; with LoRA, lora_weights are the slot arrays
    (jaxllm/lora/slots.py) and the host inputs' last item each token's slot (None without LoRA)."""
    token_ids, src_rows, meta, logits_indices, smd, prompt_targets, token_slots = unpack_host_args(ints, floats, layout)
    lora = None if lora_weights is None else LoRAInputs(lora_weights, token_slots)
    return _step_fn(
        params,
        kv_caches,
        token_ids,
        src_rows,
        prev_tokens,
        meta,
        logits_indices,
        smd,
        prompt_targets,
        lora,
        cfg=cfg,
        attn=attn,
        flags=flags,
        prompt_k=prompt_k,
        drafter=drafter,
    )


def packed_spec_step_fn(
    params,
    kv_caches,
    ints,
    floats,
    prev_tokens,
    layout: PackedLayout,
    *,
    cfg: ModelConfig,
    attn: AttentionConfig,
    flags: SamplerFlags,
    num_spec: int,
    drafter=None,
):
    """A speculative decode step: the model over each sequence's last token and its proposals, logits at every
    proposed position ([B * (K + 1)] rows, logits_indices), and the rejection sampler. Its host inputs are a plain
    step's with (logits_indices [B * (K + 1)], drafts [B, K], num_drafts [B]) in the logits_indices slot.
    Returns a plain step's outputs with num_emitted [B] appended to the sampled ones ([B, K + 1] each), then their
    packed copy (with_packed) (and the drafter's features)."""
    token_ids, src_rows, meta, (logits_indices, drafts, num_drafts), smd, *_ = unpack_host_args(ints, floats, layout)
    token_ids = jnp.where(src_rows >= 0, prev_tokens[jnp.maximum(src_rows, 0)], token_ids)
    kv_caches, hidden, feats = _forward(params, kv_caches, token_ids, meta, cfg, attn, drafter)
    B = drafts.shape[0]
    logits = gathered_logits(compute_logits(params, hidden[logits_indices], cfg), attn.mesh).reshape(
        B, num_spec + 1, -1
    )
    tokens, num_emitted, lp, ranks, top_ids, top_lp = rejection_sample(logits, drafts, num_drafts, smd, flags)
    last = jnp.take_along_axis(tokens, (num_emitted - 1)[:, None], axis=1)[:, 0]
    next_prev = jnp.zeros_like(prev_tokens).at[:B].set(last)
    if drafter is None:
        return kv_caches, next_prev, with_packed((tokens, lp, ranks, top_ids, top_lp, num_emitted)), None, None
    rep = _replicated(attn)  # the draft program reads them, compiled for replicated inputs
    tokens, num_emitted = (jax.lax.with_sharding_constraint(a, rep) for a in (tokens, num_emitted))
    return kv_caches, next_prev, with_packed((tokens, lp, ranks, top_ids, top_lp, num_emitted)), None, None, feats


def _sample_logits_fn(logits, prev_tokens, smd, *, flags: SamplerFlags):
    """Sampling from the logits of the B sampled rows; prev_tokens only gives the next one's shape."""
    tokens, lp, ranks, top_ids, top_lp = sample(logits, smd, flags)
    next_prev = jnp.zeros_like(prev_tokens).at[: tokens.shape[0]].set(tokens)
    return next_prev, with_packed((tokens, lp, ranks, top_ids, top_lp))


def with_packed(outputs: tuple) -> tuple:
    """A step's sampled outputs (int32 / float32 arrays [B, ...]) with all of them packed into one int32 array
    [B, W] appended (float32 values as their bits; step_io.unpack_outputs splits it by the others' shapes): the host
    reads a step's results in one device-to-host copy instead of one per array. At batch 1 each copy cost ~0.1 ms
    of host time per step (copy_to_host_async, its callback, np.asarray), and the quantized batch-1 steps are
    host-bound on some machines (bench/HISTORY.md "Stop 56")."""
    B = outputs[0].shape[0]
    cols = []
    for a in outputs:
        if a.dtype == jnp.float32:
            a = jax.lax.bitcast_convert_type(a, jnp.int32)
        elif a.dtype != jnp.int32:
            raise TypeError(f"a step output of dtype {a.dtype} cannot be packed (int32, float32)")
        cols.append(a.reshape(B, -1))
    return (*outputs, jnp.concatenate(cols, axis=1))


def _sample_rows_fn(head, rows, prev_tokens, smd, *, cfg: ModelConfig, flags: SamplerFlags, mesh=None):
    """The sampler-only program: logits of the sampled rows' hidden states (head: the final norm and output
    weights, and with LoRA the lm_head slot arrays as "lora_lm_head"; mesh: theirs), then sampling."""
    logits = gathered_logits(compute_logits(head, rows, cfg, head.get("lora_lm_head"), smd.lora_slots), mesh)
    return _sample_logits_fn(logits, prev_tokens, smd, flags=flags)


def packed_sample_rows_fn(
    head, rows, prev_tokens, ints, floats, layout: PackedLayout, *, cfg: ModelConfig, flags: SamplerFlags, mesh=None
):
    """_sample_rows_fn on sampling arrays packed as pack_host_args packs a step's: two host-to-device transfers
    per call instead of one per array (~20)."""
    smd = unpack_host_args(ints, floats, layout)
    return _sample_rows_fn(head, rows, prev_tokens, smd, cfg=cfg, flags=flags, mesh=mesh)


def _sample_fn(
    params,
    hidden,
    prev_tokens,
    logits,
    smd,
    prompt_targets,
    *,
    cfg: ModelConfig,
    flags: SamplerFlags,
    prompt_k: int,
    lora: LoRAInputs | None = None,
    mesh=None,
):
    """Sampling and prompt logprobs from the sampled rows' logits and the last layer's hidden states (also
    the pipeline's tail; mesh: the lm_head's)."""
    next_prev, outputs = _sample_logits_fn(logits, prev_tokens, smd, flags=flags)
    prompt = None
    if prompt_k:
        lora_head = (None, None) if lora is None else (lora.weights["lm_head"], lora.token_slots)
        prompt = prompt_logprobs(compute_logits(params, hidden, cfg, *lora_head), prompt_targets, prompt_k, mesh)
    return next_prev, outputs, prompt


def prompt_logprobs(logits, targets, k: int, mesh=None):
    """(logprob [T] and rank [T] of each row's target (-1: none; token 0's then), top ids [T, k], top logprobs
    [T, k]) of the prompt rows' logits [T, V]. As in the sampler's token_logprobs, the rank and the top-k follow the
    raw logits' order, so they do not depend on how the logsumexp's sum was rounded.

    tp > 1 (mesh: the lm_head's, split over the vocabulary): each device works on its own columns and only [T]
    rows and its top-k candidates cross devices, as gathered_logits must not do here: T is up to a prefill chunk,
    and [T, V] float32 whole on every device is 8 GB for 16k tokens of a 128k vocabulary (XLA partitioned the
    log-softmax over the shards but gathered the whole array for the top-k)."""
    targets = jnp.maximum(targets, 0)
    if mesh is None or mesh.size == 1:
        return _prompt_logprobs_shard(logits, targets, k, None)
    spec = logical_to_spec((None, "vocab"))
    return jax.shard_map(
        functools.partial(_prompt_logprobs_shard, k=k, axis=spec[1]),
        mesh=mesh,
        in_specs=(spec, jax.sharding.PartitionSpec()),
        out_specs=jax.sharding.PartitionSpec(),
        check_vma=False,  # the gathered top-k is the same on every device; lax.all_gather still calls it varying
    )(logits, targets)


def _prompt_logprobs_shard(x, targets, k: int, axis):
    """prompt_logprobs on x [T, Vs]: the columns of the logits on this device of the mesh axis `axis` (None: all of
    them, no collectives). The top-k is each shard's own top-k, gathered ([T, tp * k]) and reduced to k: ties keep
    the lower id first, as one top_k over the whole row (lax.top_k keeps the lower index first; the candidates
    are in shard order and each shard's in id order among equal logits)."""
    Vs = x.shape[-1]

    def across(op, a):
        return a if axis is None else op(a, axis)

    lo = 0 if axis is None else jax.lax.axis_index(axis) * Vs
    m = across(jax.lax.pmax, x.max(-1))
    log_s = jnp.log(across(jax.lax.psum, jnp.exp(x - m[:, None]).sum(-1)))  # as jax.nn.log_softmax: (x - m) - log_s
    mine = (targets >= lo) & (targets < lo + Vs)  # the target's logit: from the one shard that holds it
    t_x = jnp.take_along_axis(x, jnp.clip(targets - lo, 0, Vs - 1)[:, None], axis=-1)[:, 0]
    t_x = across(jax.lax.psum, jnp.where(mine, t_x, 0.0))
    rank = across(jax.lax.psum, (x > t_x[:, None]).sum(-1, dtype=jnp.int32)) + 1
    top_x, top_ids = jax.lax.top_k(x, min(k, Vs))
    if axis is not None:
        top_x = jax.lax.all_gather(top_x, axis, axis=1, tiled=True)
        top_ids = jax.lax.all_gather(top_ids + lo, axis, axis=1, tiled=True)
        top_x, best = jax.lax.top_k(top_x, k)
        top_ids = jnp.take_along_axis(top_ids, best, axis=-1)
    return (t_x - m) - log_s, rank, top_ids.astype(jnp.int32), (top_x - m[:, None]) - log_s[:, None]


def pipeline_head_fn(
    params,
    hidden,
    prev_tokens,
    logits_indices,
    smd,
    prompt_targets,
    *,
    cfg: ModelConfig,
    flags: SamplerFlags,
    prompt_k: int,
    mesh=None,
):
    """pp > 1: the last stage's hidden states -> logits and sampling (one jit per flags on the last stage; mesh:
    that stage's)."""
    logits = gathered_logits(compute_logits(params, hidden[logits_indices], cfg), mesh)
    return _sample_fn(
        params, hidden, prev_tokens, logits, smd, prompt_targets, cfg=cfg, flags=flags, prompt_k=prompt_k, mesh=mesh
    )
