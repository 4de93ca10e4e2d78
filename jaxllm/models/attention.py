"""The one attention function the decoder calls: split the fused qkv projection, apply RoPE, write the new
tokens' K/V into the paged cache, then attend over it. Backends sit behind it: "reference" (pure jnp, CPU
and tests) and "pallas" (GPU kernels in kernels_pallas/). The batch layout is described in
kernels_pallas/reference.py.

With tensor parallelism (AttentionConfig.mesh with tp > 1) both backends run inside shard_map over "tp":
a Pallas kernel cannot be partitioned by XLA, and each tp shard owns whole kv heads (q heads N/tp, kv
heads K'/tp and their pages), so attention needs no communication. The reference takes the same path so
CPU tests exercise it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import reference

# Working-set cap of the reference path: the per-step gathered K/V slice stays under this many bytes.
_REFERENCE_STEP_BYTES = 64 << 20
# ... and at most this many keys, so the loop over the block table ends soon after the longest live context.
_REFERENCE_STEP_TOKENS = 256
# Decode-only steps on the Pallas backend (one token per sequence, the engine's layout): RoPE, the KV write and
# the attention in one kernel launch (kernels_pallas.fused_decode_attention) instead of two. Llama-3-8B shape
# on an H100, per call (bench/kernels.py --only fused, bench/results/kernels_h100_61c7612_fused_decode.json):
# 2 rows (1 live) x 200 tokens 6.2 vs 8.0 us, 8 x 200 9.1 vs 10.4, 64 x 2k 202.5 vs 207.1, 256 x 700 285.4 vs
# 286.2, 512 (500 live) x 600 466.3 vs 466.4; the batch-1 step 5.68 -> 5.61 ms (step_probe_h100_30bea4e_rows8.json).
# FUSED_DECODE_TUNING: static tuning arguments of that kernel (num_splits, block_k, ...) for probes.
FUSED_DECODE = True
FUSED_DECODE_TUNING: dict = {}
# A decode step of this many rows, where it is the engine's smallest bucket (runner.smallest_seq_bucket, passed as
# AttentionConfig.smallest_decode_rows; int-weight models have a 1-row bucket below it), nearly always holds
# one live sequence and a padding row: the kernel plans its split-K for one sequence. Planned for the two rows,
# half the splits went to the padding row, whose programs exit at once: H100, one sequence at 32k context, 74.4 us
# a layer with 24 splits, 58.8 with 49; ITL 7.71 -> 7.19 ms (bench/results/long32k_h100_8c6a91a_*.json); 52.9 us
# once the kernel's grid dispatches the live row's programs first (kernels_pallas/_decode.py). The cost:
# the padding row's programs now take a second wave, which a short context pays for. 128 tokens in an 8k table:
# 9.3 us a layer (43 splits, combine included) against 7.4, ITL 5.58 vs 5.52 ms
# (latency_llama3-8b_bf16_8k_table*_h100_d5f32f8.json). 0 turns it off.
ONE_SEQ_DECODE_ROWS = 2


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables"],
    meta_fields=["decode_only", "long_context"],
)
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # [T] int32 position of each token in its sequence
    slot_mapping: jax.Array  # [T] int32 cache slot (page * S + offset) of each token; -1 for padding
    seq_lens: jax.Array  # [B] int32 context length after this step; 0 for padding sequences
    query_start_loc: jax.Array  # [B+1] int32 offset of each sequence's first token in the batch
    block_tables: jax.Array  # [B, M] int32 page ids of each sequence
    decode_only: bool = False  # static: every sequence has exactly one new token
    # static: a decode-only step whose longest live context is long (the runner's long_decode_from): its decode
    # attention takes the kernel that is faster there (kernels_pallas.fused_decode_attention's long_context)
    long_context: bool = False


@dataclass(frozen=True)
class AttentionConfig:
    backend: str = "reference"  # reference | pallas
    interpret: bool = False  # pallas interpret mode (CPU tests of the kernels through the model)
    mesh: jax.sharding.Mesh | None = None  # ("pp", "tp") mesh of the arrays; tp > 1 -> shard_map over "tp"
    # The KV values' dtype where the pages hold its bit patterns as uint8 (fp8 on CPU, runner.kv_storage_dtype);
    # None: the pages' own dtype. Reference backend only.
    kv_dtype: str | None = None
    # The engine's smallest decode bucket (runner.smallest_seq_bucket): ONE_SEQ_DECODE_ROWS applies where it is that
    # bucket (one live sequence and a padding row); with a 1-row bucket a 2-row step holds two live sequences.
    smallest_decode_rows: int = 2


def paged_attention(
    qkv,
    kv_cache,
    meta: AttentionMetadata,
    *,
    scale,
    rope_inv_freq=None,
    alibi_slopes=None,
    sliding_window=None,
    soft_cap=None,
    k_scale=1.0,
    v_scale=1.0,
    config=AttentionConfig(),
    dtype=None,
):
    """qkv: [T, K, G + 2, H] (per kv head: its G query heads, then k, v), kv_cache: (k_pages, v_pages)
    [K, P, S, H] -> ([T, K * G, H], kv_cache). RoPE (rope_inv_freq [H / 2]) is applied to q and k here, in
    the same kernel that writes k and v on GPU. qkv may be the projection's split-K partials [S, T, K, G + 2,
    H] (float32, one tp shard only), summed and rounded to dtype first (in that kernel on GPU). sliding_window
    (keys within that many positions of the query) and soft_cap (Gemma 2: scores -> cap * tanh(scores / cap))
    are static, per layer."""
    mesh = config.mesh
    if mesh is not None and mesh.shape.get("tp", 1) > 1:
        if qkv.ndim != 4:
            raise ValueError("split-K qkv partials are for one tp shard only (decoder.qkv_partials)")
        from jax.sharding import PartitionSpec as P

        heads = P(None, "tp", None)
        pages = P("tp", None, None, None)
        local = functools.partial(
            _paged_attention,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            config=config,
        )
        slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32)
        # check_vma=False: the Pallas kernels do not declare how their outputs vary over mesh axes.
        return jax.shard_map(
            local,
            mesh=mesh,
            check_vma=False,
            in_specs=(
                P(None, "tp", None, None),
                (pages, pages),
                P(),
                None if rope_inv_freq is None else P(),
                None if slopes is None else P("tp"),
            ),
            out_specs=(heads, (pages, pages)),
        )(qkv, kv_cache, meta, rope_inv_freq, slopes)
    return _paged_attention(
        qkv,
        kv_cache,
        meta,
        rope_inv_freq,
        alibi_slopes,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        config=config,
        dtype=dtype,
    )


def _paged_attention(
    qkv,
    kv_cache,
    meta,
    inv_freq,
    alibi_slopes,
    *,
    scale,
    sliding_window,
    k_scale,
    v_scale,
    config,
    soft_cap=None,
    dtype=None,
):
    k_pages, v_pages = kv_cache
    if config.kv_dtype is not None and config.backend != "reference":
        raise ValueError(
            f"KV pages stored as bit patterns of {config.kv_dtype} are read by the reference backend only."
        )
    kwargs = dict(
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    if config.backend == "pallas" and meta.decode_only and FUSED_DECODE and qkv.shape[-4] == meta.seq_lens.shape[0]:
        import kernels_pallas

        tuning = dict(FUSED_DECODE_TUNING)
        if meta.seq_lens.shape[0] == ONE_SEQ_DECODE_ROWS == config.smallest_decode_rows:
            tuning.setdefault("plan_seqs", 1)
        out, k_pages, v_pages = kernels_pallas.fused_decode_attention(
            qkv,
            meta.positions,
            inv_freq,
            k_pages,
            v_pages,
            meta.slot_mapping,
            meta.seq_lens,
            meta.block_tables,
            dtype=dtype,
            long_context=meta.long_context,
            interpret=config.interpret,
            **kwargs,
            **tuning,
        )
    elif config.backend == "pallas":
        import kernels_pallas

        q, k_pages, v_pages = kernels_pallas.qkv_write_kv(
            qkv,
            meta.positions,
            inv_freq,
            k_pages,
            v_pages,
            meta.slot_mapping,
            k_scale=k_scale,
            v_scale=v_scale,
            dtype=dtype,
            interpret=config.interpret,
        )
        out = kernels_pallas.ragged_paged_attention(
            q,
            k_pages,
            v_pages,
            meta.seq_lens,
            meta.query_start_loc,
            meta.block_tables,
            decode_only=meta.decode_only,
            interpret=config.interpret,
            **kwargs,
        )
    elif config.backend == "reference":
        q, k_pages, v_pages = reference.qkv_write_kv(
            qkv,
            meta.positions,
            inv_freq,
            k_pages,
            v_pages,
            meta.slot_mapping,
            k_scale=k_scale,
            v_scale=v_scale,
            dtype=dtype,
            kv_dtype=config.kv_dtype,
        )
        K, _, S, H = k_pages.shape
        per_page = q.shape[0] * S * K * H * 4 * 2
        out = reference.ragged_paged_attention_ref(
            q,
            k_pages,
            v_pages,
            meta.seq_lens,
            meta.query_start_loc,
            meta.block_tables,
            pages_per_step=max(1, min(_REFERENCE_STEP_BYTES // per_page, _REFERENCE_STEP_TOKENS // S)),
            kv_dtype=config.kv_dtype,
            **kwargs,
        )
    else:
        raise ValueError(f"attention backend={config.backend!r} is not one of 'reference', 'pallas'.")
    return out, (k_pages, v_pages)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi head slopes (Press et al.), with the interleaved extra slopes for non-power-of-2 head counts."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = base ** np.arange(1, closest + 1, dtype=np.float64)
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        extra = extra_base ** np.arange(1, 1 + 2 * (num_heads - closest), 2, dtype=np.float64)
        slopes = np.concatenate([slopes, extra])
    return slopes.astype(np.float32)
