"""Pieces shared by the decode and ragged kernels: static tiling choices and the online-softmax step.

Scores live in the log2 domain (the q.k multiplier carries scale * k_scale * log2(e), ALiBi slopes carry
log2(e)), so the kernels use exp2, which is one MUFU instruction on NVIDIA GPUs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def kernel_supported(q, k_pages) -> bool:
    """Shapes the Triton-lowered kernels handle; anything else goes to the reference."""
    T, N, H = q.shape
    K, _, S, _ = k_pages.shape
    return (
        N % K == 0
        and H in (64, 128, 256)
        and S == next_pow2(S)
        and S >= 8
        and jnp.dtype(q.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
    )


def kernel_named(body, name: str):
    """body (a Mosaic GPU kernel's body function) renamed: Mosaic GPU names the CUDA kernel after it, and XProf traces
    show NAME_mosaic_gpu_kernel (bench/profile_summary.kernel_category files it by that name)."""
    body.__name__ = body.__qualname__ = name
    return body


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def on_hopper() -> bool:
    """An sm_90 GPU (H100 / H200): the Mosaic GPU kernels use wgmma, which only sm_90a has."""
    if not on_gpu():
        return False
    return getattr(jax.devices()[0], "compute_capability", None) == "9.0"


def whole_blocks_table(block_tables, pages_per_block: int):
    """The table as int32 with its page axis a multiple of pages_per_block: enough for kernels whose blocks
    start at multiples of pages_per_block and never pass the last one that holds a live page (no pad op
    when the width already is one, as with the engine's power-of-two tables)."""
    pad = -block_tables.shape[1] % pages_per_block
    bt = block_tables.astype(jnp.int32)
    return jnp.pad(bt, ((0, 0), (0, pad))) if pad else bt


def pad_block_tables(block_tables, multiple: int):
    """Pads the page axis so a kernel may read a whole group of `multiple` entries past the last page."""
    M = block_tables.shape[1]
    pad = -M % multiple + multiple
    return jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pad)))


def scalars(scale, k_scale, v_scale):
    """[2] f32: the log2-domain q.k multiplier and the v dequantization scale (may be traced)."""
    qk = jnp.asarray(scale, jnp.float32) * jnp.asarray(k_scale, jnp.float32) * LOG2E
    return jnp.stack([qk, jnp.asarray(v_scale, jnp.float32)]).reshape(2)


def cap_scores(s, soft_cap):
    """Soft-capping (Gemma 2) of log2-domain scores: cap * tanh(x / cap) of the natural-log score x = s / log2(e)
    is, in the log2 domain, the same with the cap times log2(e)."""
    if soft_cap is None:
        return s
    c = soft_cap * LOG2E
    return c * jnp.tanh(s / c)


def mma(a, b, trans_b=False):
    """[M, C] x [C, N] (or [N, C] with trans_b) -> f32, lowered to one tensor-core MMA by Triton."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def sum_partials(parts, dtype):
    """Split-K partials of the qkv projection (f32 values, in split order) summed in that order and rounded to
    dtype once: what reference.qkv_write_kv's sum + cast gives (the kernels' bit-exact tests check it)."""
    acc = parts[0]
    for x in parts[1:]:
        acc = acc + x
    return acc.astype(dtype)


def triton_params(num_warps, num_stages):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def kv_blocks(ids, fetch, step, state, lo, mid, hi, *, prefetch, start=None):
    """Runs state = step(i, state, k, v, masked) over KV blocks lo..mid (unmasked), then mid..hi (masked).
    ids(i) loads block i's page ids from the block table; fetch(ids) -> (k, v) loads those pages.
    start(state) -> state, if given, runs once the first blocks' loads are issued (math whose inputs were
    loaded earlier then waits alongside those loads, not before them).

    Triton's software pipeliner does not pipeline loads whose addresses come from the block table, so the
    loop carries its own prefetch in registers:
      0: each block is loaded in its own iteration;
      1: block i + 1's KV loads are issued before block i's math, so they are in flight while it runs;
      2: as 1, and the page ids one block further ahead, so the KV loads never wait on a block-table load
         (one dependent memory round trip per iteration instead of two);
      3: as 2 with the KV of two blocks in flight (more registers, more bytes in flight per program).
    Prefetches past hi re-read the last block (an L2 hit), never a block past it."""
    depth, early_ids = (0, 1, 1, 2)[prefetch], prefetch >= 2
    clamp = lambda j: jnp.maximum(jnp.minimum(j, hi - 1), lo)  # noqa: E731

    def body(i, carry, masked):
        if depth == 0:
            return step(i, carry, *fetch(ids(i)), masked)
        state, kvs, *next_ids = carry
        new = fetch(next_ids[0] if early_ids else ids(clamp(i + depth)))  # block i + depth
        next_ids = [ids(clamp(i + depth + 1))] if early_ids else []
        state = step(i, state, *kvs[0], masked)
        return (state, kvs[1:] + (new,), *next_ids)

    if depth:
        kvs = tuple(fetch(ids(clamp(lo + j))) for j in range(depth))
        next_ids = [ids(clamp(lo + depth))] if early_ids else []
        state = (start(state) if start else state, kvs, *next_ids)
    elif start:
        state = start(state)
    state = jax.lax.fori_loop(lo, mid, functools.partial(body, masked=False), state)
    state = jax.lax.fori_loop(mid, hi, functools.partial(body, masked=True), state)
    return state[0] if depth else state


def softmax_step(carry, s, v, p_dtype):
    """One online-softmax update. s: [R, C] f32 log2-domain scores (-inf where masked); v: [C, H]."""
    m_prev, l_prev, acc = carry
    m_new = jnp.maximum(m_prev, s.max(axis=1))
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 there so nothing becomes NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l_new = alpha * l_prev + p.sum(axis=1)
    acc = alpha[:, None] * acc + mma(p.astype(p_dtype), v)
    return m_new, l_new, acc
