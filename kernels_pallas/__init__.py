"""Paged attention kernels for NVIDIA GPUs (Pallas: Triton lowering, and Mosaic GPU for prefill and decode on
Hopper), each beside the pure-jnp reference.

KV layout (fixed, see reference.py): per layer k_pages, v_pages: [K, P, S, H]. One page of one kv head is
one contiguous S * H run, so a program that owns (sequence, kv head) gathers whole pages with unit
stride (16-byte vector loads) and serves all G query heads of that kv head from one read.

Entry points (same keyword arguments as the reference):
  ragged_paged_attention(q [T, N, H], k_pages, v_pages, seq_lens [B], query_start_loc [B+1],
                         block_tables [B, M], *, scale, k_scale, v_scale, alibi_slopes, sliding_window, soft_cap,
                         decode_only=False, interpret=False) -> [T, N, H]
      decode_only is a static promise that every live sequence has exactly one query token and that padding
      sequences (seq_len 0) come after the live ones; it dispatches to the split-K decode kernel. Otherwise
      the chunks go to the ragged prefill kernel: Mosaic GPU (_prefill_mgpu.py) on H100 / H200 for bf16 /
      fp16 pages without ALiBi, sliding window, soft-capping or fp8, the Triton one (_ragged.py) for everything else.
  paged_decode_attention(q [B, N, H], k_pages, v_pages, seq_lens, block_tables, *, ...) -> [B, N, H]: the
      split-K decode kernel, Mosaic GPU (_decode_mgpu.py) on H100 / H200 for bf16 / fp16 pages without ALiBi,
      window or fp8, the Triton one (_decode.py) for everything else; the decode tokens of ragged batches too.
      The engine's decode-only steps call fused_decode_attention (Triton: RoPE and the KV write folded in; the
      qkv/RoPE/write launch then the Mosaic GPU kernel with decode_backend="mosaic").
  write_kv(k_pages, v_pages, k, v, slot_mapping, *, k_scale, v_scale, interpret=False): the new tokens' K/V
      into their slots; on GPU one Pallas launch for both caches (_write.py), else the reference's scatter.
  qkv_write_kv(qkv [T, K, G + 2, H], positions [T], inv_freq [H / 2] | None, k_pages, v_pages, slot_mapping,
               *, k_scale, v_scale, dtype=None, interpret=False) -> (q [T, N, H], k_pages, v_pages): the fused
      projection's output split into q, RoPE on q and k, and the KV write, in one launch on GPU; qkv may be
      the projection's split-K partials [S, T, K, G + 2, H] (float32), summed and rounded to dtype in the launch.

soft_cap (Gemma 2's attention soft-capping, cap * tanh(score / cap) before the softmax) is applied by the Triton
kernels and the reference; the Mosaic GPU kernels do not take it, so such models run the Triton ones on Hopper too.

fp8 KV (float8_e4m3fn / float8_e5m2 pages, per-tensor k_scale / v_scale): pages are widened to q's dtype
inside the kernel; k_scale is folded into the score multiplier and v_scale into the output.

Mosaic GPU kernels refuse inputs whose address is not a multiple of 256 bytes, and XLA hands a custom call a
static slice of another buffer as that buffer at the slice's offset (its dynamic-slice fusion): a seq_lens or
block table sliced out of a larger array must start on a 256-byte boundary (bench/probes/mosaic_align_probe.py; the
engine's packed step inputs are laid out so, packing.pack_host_args). An input computed in the step is a buffer
of its own and always aligned.

Off GPU (and not interpret), and for shapes the kernels do not take (head dim not 64/128/256, page size
not a power of two >= 8), the entry points call the reference; that is the CPU path of the engine.

Quantized linear layers (quant.py; layout and load-time helpers in qlayout.py):
  quantized_matmul(x [..., K], w: QuantizedWeight, *, split=False, ...) -> [..., N]: weight-only int4 / int8
      (GPTQ, AWQ, compressed-tensors W4A16 / W8A16); the Pallas kernel (_qmatmul.py) for decode-sized batches,
      dequantize + XLA's GEMM above them. quantized_matmul_ref beside it.
  fp8_matmul(x [..., K], w [N, K] float8_e4m3fn, w_scale, *, x_scale=None, act_scale="token") -> [..., N]: FP8
      W8A8 through XLA's fp8 dot, activation scales computed in the call. fp8_matmul_ref beside it.
  fp8_gemv(x [..., K], w, w_scale, *, residual=None) -> [..., N]: the same W8A8 function for 1-2 rows (decode) with
      the activation quantization inside one split-K Pallas GEMV (_fp8_gemv.py). fp8_gemv_ref beside it.

Mixture-of-experts grouped GEMM (grouped.py; the kernel in _grouped.py):
  grouped_matmul(rows [M, K] sorted by expert, sizes [E] int32, w [E, K, N], *, out_dtype=None, backend="auto",
                 interpret=False, **tuning) -> [M, N]: each expert's rows times its weights, rows past sum(sizes)
      zero; the Pallas kernel on GPU reads only the experts that have rows. grouped_matmul_ref beside it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from . import _decode_mgpu, _prefill_mgpu, reference
from ._common import kernel_supported, on_gpu, on_hopper
from ._decode import fused_decode_attention_kernel, paged_decode_attention_kernel
from ._ragged import ragged_paged_attention_kernel
from ._write import qkv_write_kv_kernel, write_kv_kernel
from .grouped import grouped_matmul, grouped_matmul_ref
from .quant import fp8_gemv, fp8_gemv_ref, fp8_matmul, fp8_matmul_ref, quantized_matmul, quantized_matmul_ref
from .reference import paged_decode_attention_ref, ragged_paged_attention_ref

__all__ = [
    "ragged_paged_attention",
    "paged_decode_attention",
    "write_kv",
    "qkv_write_kv",
    "fused_decode_attention",
    "ragged_paged_attention_ref",
    "paged_decode_attention_ref",
    "reference",
    "quantized_matmul",
    "quantized_matmul_ref",
    "fp8_matmul",
    "fp8_matmul_ref",
    "fp8_gemv",
    "fp8_gemv_ref",
    "grouped_matmul",
    "grouped_matmul_ref",
]


def _use_kernel(q, k_pages, interpret):
    return (interpret or on_gpu()) and kernel_supported(q, k_pages)


def _use_write_kernel(k_pages, interpret):
    return (interpret or on_gpu()) and k_pages.shape[-1] in (64, 128, 256)


def _check_partials(qkv, dtype):
    if qkv.ndim == 5 and dtype is None:
        raise ValueError(
            "qkv given as split-K partials [S, T, K, G + 2, H] needs dtype= (the model's dtype, "
            "which the summed partials are rounded to)"
        )


def write_kv(k_pages, v_pages, k, v, slot_mapping, *, k_scale=1.0, v_scale=1.0, interpret=False):
    """k, v: [T, K, H] into their slots (page * S + offset) of both caches; slot -1 is dropped."""
    if _use_write_kernel(k_pages, interpret):
        return write_kv_kernel(
            k_pages, v_pages, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale, interpret=interpret
        )
    return reference.write_kv(k_pages, v_pages, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def qkv_write_kv(
    qkv, positions, inv_freq, k_pages, v_pages, slot_mapping, *, k_scale=1.0, v_scale=1.0, dtype=None, interpret=False
):
    """See reference.qkv_write_kv; on GPU one Pallas launch (_write.py) instead of XLA's RoPE fusions for q
    and k, the slice for v and the write, for batches of < 2048 tokens. Measured on an H100 (same run,
    bench/results/kernels_h100_97c2470.json): 8 tokens 3.3 vs 7.9 us, 512: 6.9 vs 11.3, but 2048: 27.1 vs
    19.4 and 8192: 104 vs 98 us (one program per token and kv head); larger batches keep XLA's RoPE + the
    Pallas write. Split-K partials (qkv [S, T, ...], float32; dtype: the model's) are summed in the launch."""
    _check_partials(qkv, dtype)
    args = (qkv, positions, inv_freq, k_pages, v_pages, slot_mapping)
    kw = dict(k_scale=k_scale, v_scale=v_scale, dtype=dtype)
    if not _use_write_kernel(k_pages, interpret):
        return reference.qkv_write_kv(*args, **kw)
    if qkv.shape[-4] >= 2048 and not interpret:
        return reference.qkv_write_kv(*args, write=write_kv_kernel, **kw)
    return qkv_write_kv_kernel(*args, interpret=interpret, **kw)


def fused_decode_attention(
    qkv,
    positions,
    inv_freq,
    k_pages,
    v_pages,
    slot_mapping,
    seq_lens,
    block_tables,
    *,
    scale,
    k_scale=1.0,
    v_scale=1.0,
    alibi_slopes=None,
    sliding_window=None,
    soft_cap=None,
    dtype=None,
    decode_backend=None,
    long_context=False,
    interpret=False,
    **tuning,
):
    """A decode step's attention from the qkv projection (token b is sequence b's one new token; padding
    sequences, seq_len 0 and slot -1, come last): what qkv_write_kv followed by the decode kernel does.
    -> (out [B, N, H], k_pages, v_pages). decode_backend: None ($JAXLLM_DECODE_BACKEND, else "auto"), "auto" or
    "triton" run it as one launch (_decode.fused_decode_attention_kernel; tuning: its static arguments);
    "mosaic" runs the qkv/RoPE/write launch, then the Mosaic GPU decode kernel (tuning: plan_seqs only).
    long_context: the caller's hint that the step's longest live context is long (the engine's
    AttentionMetadata.long_context, set per step from the host's sequence lengths): "auto" then takes the Mosaic
    path where _decode_backend would (Hopper, inputs it supports), else the fused launch as without it.

    "auto" keeps the fused launch on Hopper for short contexts, by measurement (H200, chain time per call with the
    write, bench/results/kernels_h200_a2a5b98_fused_pool.json; fused vs write + Mosaic): 2 rows (1 live) x 200 tokens
    6.1 vs 8.5 us, 8 x 200 9.2 vs 10.3, 2 (1 live) x 32k 42.8 vs 48.1; Mosaic is faster with many long
    sequences (64 x 2k 165.7 vs 140.8, 16 x 8k 149.3 vs 133.2, 512 (500 live) x 600 364.2 vs 356.5). In the
    engine's steps Mosaic was faster at contexts of 2k and more (1.6-8 %; batch 1 at 32k too: ITL 5.17 vs 5.28
    ms) and slower at short ones (8B bf16, 128 + 128 tokens: batch-1 ITL 4.18 vs 4.06 ms, batch 64 5.99 vs 5.81;
    bench/HISTORY.md "Stop 63"). A step program knows only the table's width (max_model_len), not its contexts,
    hence long_context: the engine compiles a second decode program per bucket for its long steps."""
    _check_partials(qkv, dtype)
    T, K, G2, H = qkv.shape[-4:]
    if T != seq_lens.shape[0]:
        raise ValueError(
            f"fused_decode_attention needs one token per sequence: {T} tokens, {seq_lens.shape[0]} sequences"
        )
    kw = dict(
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    probe = jax.ShapeDtypeStruct((T, K * (G2 - 2), H), qkv.dtype if qkv.ndim == 4 else dtype)
    requested = requested_decode_backend(decode_backend)
    kernels = _use_kernel(probe, k_pages, interpret) and _use_write_kernel(k_pages, interpret)
    choose = requested != "auto" or long_context  # "auto" alone is the fused launch (see above)
    if not kernels or (choose and _decode_backend(probe, k_pages, kw, requested, interpret) == "mosaic"):
        # two launches (the reference off GPU): the qkv/RoPE/write, then the decode entry point
        q, k_pages, v_pages = qkv_write_kv(
            qkv,
            positions,
            inv_freq,
            k_pages,
            v_pages,
            slot_mapping,
            dtype=dtype,
            k_scale=k_scale,
            v_scale=v_scale,
            interpret=interpret,
        )
        out = paged_decode_attention(
            q,
            k_pages,
            v_pages,
            seq_lens,
            block_tables,
            decode_backend=requested,
            plan_seqs=tuning.get("plan_seqs"),
            interpret=interpret,
            **kw,
        )
        return out, k_pages, v_pages
    return fused_decode_attention_kernel(
        qkv,
        positions,
        inv_freq,
        k_pages,
        v_pages,
        slot_mapping,
        seq_lens,
        block_tables,
        dtype=dtype,
        interpret=interpret,
        **kw,
        **tuning,
    )


def paged_decode_attention(
    q,
    k_pages,
    v_pages,
    seq_lens,
    block_tables,
    *,
    scale,
    k_scale=1.0,
    v_scale=1.0,
    alibi_slopes=None,
    sliding_window=None,
    soft_cap=None,
    decode_backend=None,
    plan_seqs=None,
    interpret=False,
):
    """One query token per sequence (q: [B, N, H]); sequences with seq_len 0 give zeros.
    decode_backend: "auto" | "mosaic" | "triton", or None: $JAXLLM_DECODE_BACKEND, else "auto" (see
    _decode_backend). plan_seqs: the live sequences the kernel plans its splits for (default B; the engine's
    batch-1 step has a padding row)."""
    kw = dict(
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    if not _use_kernel(q, k_pages, interpret):
        return paged_decode_attention_ref(q, k_pages, v_pages, seq_lens, block_tables, **kw)
    return _run_decode(q, k_pages, v_pages, seq_lens, block_tables, kw, decode_backend, interpret, plan_seqs)


def requested_decode_backend(decode_backend: str | None = None) -> str:
    """The decode backend asked for: decode_backend, else $JAXLLM_DECODE_BACKEND (as vLLM's
    VLLM_ATTENTION_BACKEND), else "auto"; ValueError for anything but "auto", "mosaic" or "triton"."""
    name, requested = "decode_backend", decode_backend
    if not requested:
        name, requested = "JAXLLM_DECODE_BACKEND", os.environ.get("JAXLLM_DECODE_BACKEND") or "auto"
    if requested not in ("auto", "mosaic", "triton"):
        raise ValueError(f"{name}={requested!r} is not one of 'auto', 'mosaic', 'triton'.")
    return requested


def _decode_backend(q, k_pages, kw, requested, interpret) -> str:
    """ "mosaic" (Mosaic GPU kernel, _decode_mgpu.py) on sm_90 GPUs for what it supports (bf16 / fp16, no ALiBi,
    window or fp8); "triton" otherwise (and by default in interpret mode: the Mosaic GPU interpreter is much
    slower on CPU). XProf kernel time per call, Mosaic vs Triton, same run: on an H200 (bench/results/
    kernels_h200_29176ac_goal.json) B64 x 2k 131.5 vs 172.4-172.7 us, B1 x 32k 37.0-37.6 vs 43.4-43.5; on an
    H100 at 3baf4dc (bench/KERNELS_NOTES.md "Stop 22": that run's JSON was lost with its session) B1 x 32k
    51.9 vs 53.8, B64 x 2k 185.2 vs 202.5, B16 x 16k 361.9 vs 381.7, B128 x 1k 188.8 vs 205.9, and the throughput
    run's batch (500 of 512 sequences of ~600 tokens) 451.3 vs 449.8: equal. The engine's throughput is the
    same with either (H200, 500 x 462 / 256: 41.5-41.6 vs 41.4-42.3 req/s, throughput_h200_*_{auto,triton}),
    but in those runs the choice reached only the mixed steps' decode tokens: the decode-only steps ran
    fused_decode_attention's one Triton launch either way (see there for when they take the Mosaic kernel)."""
    requested = requested_decode_backend(requested)
    ok = _decode_mgpu.supported(q, k_pages, **kw)
    if requested == "mosaic" and not ok:
        raise ValueError("the Mosaic GPU decode kernel does not take these inputs (see _decode_mgpu.supported)")
    if requested == "auto":
        return "mosaic" if ok and not interpret and on_hopper() else "triton"
    return requested


def _run_decode(q, k_pages, v_pages, seq_lens, block_tables, kw, requested, interpret, plan_seqs=None):
    """The decode kernel _decode_backend picks (named apart from the _decode module, which it would shadow)."""
    args = (q, k_pages, v_pages, seq_lens, block_tables)
    if _decode_backend(q, k_pages, kw, requested, interpret) == "mosaic":
        return _decode_mgpu.paged_decode_mgpu(*args, scale=kw["scale"], plan_seqs=plan_seqs, interpret=interpret)
    return paged_decode_attention_kernel(*args, plan_seqs=plan_seqs, interpret=interpret, **kw)


def _prefill_backend(q, k_pages, kw, requested, interpret) -> str:
    """ "mosaic" (Mosaic GPU kernel, _prefill_mgpu.py: 0.64-0.77 of the bf16 matmul rate on an H100 where the
    Triton kernel reaches 0.47-0.55, bench/results/kernels_h100_2088a1e_mgpu_prefill.json) on sm_90 GPUs for
    what it supports (bf16 / fp16, no ALiBi, window or fp8); "triton" otherwise (and by default in interpret
    mode: the Mosaic GPU interpreter is much slower on CPU)."""
    if requested not in ("auto", "mosaic", "triton"):
        raise ValueError(f"prefill_backend={requested!r} is not one of 'auto', 'mosaic', 'triton'.")
    ok = _prefill_mgpu.supported(q, k_pages, **kw)
    if requested == "mosaic" and not ok:
        raise ValueError("the Mosaic GPU prefill kernel does not take these inputs (see _prefill_mgpu.supported)")
    if requested == "auto":
        return "mosaic" if ok and not interpret and on_hopper() else "triton"
    return requested


def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    seq_lens,
    query_start_loc,
    block_tables,
    *,
    scale,
    k_scale=1.0,
    v_scale=1.0,
    alibi_slopes=None,
    sliding_window=None,
    soft_cap=None,
    decode_only=False,
    split_decode=True,
    prefill_backend="auto",
    decode_backend=None,
    interpret=False,
):
    """Causal attention of every new token of a flat ragged batch over its paged context ([T, N, H]).
    split_decode: in a mixed batch, the sequences with one new token (decode steps) go to the decode kernel
    and only the others get ragged tiles (a one-token tile would run 128-row MMAs over the same KV).
    prefill_backend: "auto" | "mosaic" | "triton" for the ragged tiles (see _prefill_backend); decode_backend the
    same for the one-token sequences (see _decode_backend)."""
    kw = dict(
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    if not _use_kernel(q, k_pages, interpret):
        return ragged_paged_attention_ref(q, k_pages, v_pages, seq_lens, query_start_loc, block_tables, **kw)
    T = q.shape[0]
    if decode_only and T == seq_lens.shape[0]:
        # The engine's decode steps: one token per sequence, padding sequences (seq_len 0) last, so token b
        # is sequence b's and a padding token meets a padding sequence (zeros): no gathers needed.
        return _run_decode(q, k_pages, v_pages, seq_lens, block_tables, kw, decode_backend, interpret)
    backend = _prefill_backend(q, k_pages, kw, prefill_backend, interpret)

    def prefill(skip_single):
        args = (q, k_pages, v_pages, seq_lens, query_start_loc, block_tables)
        if backend == "mosaic":
            return _prefill_mgpu.ragged_prefill_mgpu(*args, scale=scale, skip_single=skip_single, interpret=interpret)
        return ragged_paged_attention_kernel(*args, skip_single=skip_single, interpret=interpret, **kw)

    if not (decode_only or split_decode):
        return prefill(skip_single=False)
    qsl = query_start_loc.astype(jnp.int32)
    single = qsl[1:] - qsl[:-1] == 1
    qd = q[jnp.clip(qsl[:-1], 0, T - 1)]  # [B, N, H]: each one-token sequence's token
    od = _run_decode(qd, k_pages, v_pages, jnp.where(single, seq_lens, 0), block_tables, kw, decode_backend, interpret)
    if decode_only:
        out = jnp.zeros_like(q)
    else:  # the one-token sequences' rows of this output are unspecified until the scatter below
        out = prefill(skip_single=True)
    rows = jnp.where(single, qsl[:-1], T)  # T: out of range, dropped
    return out.at[rows].set(od, mode="drop")
