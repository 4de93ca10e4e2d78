"""XLA compiler options per step program (programs.py compiles with them; a separate module only to keep
programs.py to its life cycle). compile_options reads a StepVariant's shape fields only."""

from __future__ import annotations

import os

import jax

from jaxllm.distributed import env_int

# decode-only steps of at least this many sequences (bucket) are compiled with XLA's Triton GEMMs off (cuBLAS);
# JAXLLM_CUBLAS_MIN_DECODE_SEQS overrides it (bench A/B runs: a large value keeps Triton GEMMs at every batch)
_override = env_int("JAXLLM_CUBLAS_MIN_DECODE_SEQS")
CUBLAS_MIN_DECODE_SEQS = 32 if _override is None else _override
# decode-only steps' command buffers (CUDA graphs): XLA's default command types when unset; JAXLLM_DECODE_COMMAND_BUFFER
# replaces them for A/B runs: "" (none: one launch a kernel) or a comma list of XLA's types (FUSION, CUBLAS, CUBLASLT,
# CUDNN, CUSTOM_CALL, ...; without CUSTOM_CALL the Mosaic GPU calls run outside the graphs)
DECODE_COMMAND_BUFFER = os.environ.get("JAXLLM_DECODE_COMMAND_BUFFER")


def compile_options(v) -> dict:
    """XLA options of v's step program on a GPU (none elsewhere).

    Steps with prompt tokens (prefill, mixed) are compiled without command buffers (CUDA graphs): a prefill that
    arrives at an idle device otherwise waits for the graph's update (when the step's buffers moved since it last
    ran) and launch before its first kernel, and its kernels are long enough to hide one launch each. Decode-only
    steps keep them: one launch per kernel cost batch 1 5.44 -> 5.64 ms per token (h100_command_buffers_ab_5e05ff0
    .json). H100, one call: batch-1 TTFT 13.6 / 13.9 -> 11.3 / 11.0 ms, ITL and throughput unchanged
    (h100_prefill_without_command_buffers_ab_2dade1a_vs_cd09718.json in bench/results).

    They also use cuBLAS instead of XLA's Triton GEMMs, which compile in half the time and run as fast or
    faster. One H100 process compiling each step alone, then timing the two alternately (T x B, ms per step;
    compile_probe_h100_b691aa4_ab_steps.json): 16x16 6.33 -> 6.51, 128x128 8.27 -> 7.68, 512x512 16.32 ->
    15.86, 512x2048 47.7 -> 46.8, 512x8192 174.9 -> 154.1; compiles 8.3-9.9 -> 4.6-6.3 s. In a cold start's
    8 parallel compiles the longest took 32-36 -> 14-17 s and LLM() 73.8 -> 60.5 s (compile_probe_h100_ce2244f
    .json: the 8B shape, 19 steps; tracing them, ~25-35 s with compiles alongside, is now what ready waits on).

    Decode-only steps of CUBLAS_MIN_DECODE_SEQS or more sequences use cuBLAS instead of XLA's Triton GEMMs: the
    autotuner keeps Triton GEMM fusions there (with the residual add and norm scale fused around them), which
    bench/probes/step_probe.py measured slower per step on the H100 at ctx 192 (step_probe_h100_e104111_rows*.json):
    32 rows 6.35 -> 6.26 ms, 64 rows 7.03 -> 6.50-6.54, 128 rows 8.15 -> 7.54, 256 rows 10.48 -> 10.13, 512 rows
    (500 live, ctx 600) 26.45 -> 26.08; at 8 and 16 rows Triton wins (5.67 vs 5.93, 5.89 vs 5.97).

    Speculative verify steps (B * (K + 1) rows, ragged but decode-sized) follow the decode-only rule on their
    rows, command buffers included: they are the latency case."""
    if jax.default_backend() != "gpu":
        return {}
    if v.num_spec:  # a verify step: decode-sized (B * (K + 1) rows), latency-bound: command buffers kept
        return {"xla_gpu_enable_triton_gemm": False} if v.num_tokens >= CUBLAS_MIN_DECODE_SEQS else {}
    if not v.decode_only:
        return {"xla_gpu_enable_command_buffer": "", "xla_gpu_enable_triton_gemm": False}
    options = {} if DECODE_COMMAND_BUFFER is None else {"xla_gpu_enable_command_buffer": DECODE_COMMAND_BUFFER}
    if v.num_seqs >= CUBLAS_MIN_DECODE_SEQS:
        options["xla_gpu_enable_triton_gemm"] = False
    return options
