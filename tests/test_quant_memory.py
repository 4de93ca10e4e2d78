"""Device memory of the quantized step programs: the temporaries a step holds beside the weights and the KV cache.

An 8B GPTQ int4 engine ran out of memory at its first step on an H100 (a 9.30 GiB temporary buffer,
bench/results/quant_h100_23c93ec_log.txt): the prefill path dequantizes each weight and multiplies it with
XLA's GEMM, and since a weight's dequantization depends on nothing the step computes, XLA scheduled the
dequantizations of many layers ahead of the layers that use them, all live at once. kernels_pallas.quant
.tie_to_input ties each one to its matmul's input with an optimization barrier.

XLA honours the barrier while it schedules on a GPU (its OptimizationBarrierExpander runs after scheduling), but
its CPU compiler removes barriers before scheduling. So the steps here are compiled with that pass disabled
(GPU_ORDER), which gives the CPU's scheduler the GPU's constraints; their temporary bytes (memory_analysis) then
show what the schedule keeps live."""

from __future__ import annotations

import math

import jax
import pytest

from jaxllm.config import ModelConfig
from jaxllm.engine.runner import ModelRunner
from jaxllm.models import decoder, quant_matmul
from jaxllm.models.loader import abstract_weights
from jaxllm.models.quant import QuantizedWeight
from jaxllm.sharding import ParallelConfig
from kernels_pallas import quant as kernels_quant

GPU_ORDER = {"xla_disable_hlo_passes": "cse_barrier_expander"}  # see the module docstring

# Llama-shaped, scaled down so that a layer's dequantized weights (~60 MB in float32) dwarf a 128-token step's
# activations; float32, so that XLA's CPU dots convert no weight (bf16 dots on a CPU widen both operands, which
# holds a float32 copy of every dense weight too).
HF = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=1024,
    hidden_size=1024,
    intermediate_size=4096,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    torch_dtype="float32",
    quantization_config=dict(quant_method="gptq", bits=4, group_size=128, sym=True, desc_act=False),
)
TOKENS = 128


def _prefill_temp_bytes(layers: int) -> tuple[int, int]:
    """(temporary bytes of the compiled TOKENS-token prefill step, one layer's dequantized weights in bytes)."""
    cfg = ModelConfig.from_hf(dict(HF, num_hidden_layers=layers), dtype="float32")
    mesh = ParallelConfig(1, 1).make_mesh()
    params = abstract_weights(cfg, mesh)
    runner = ModelRunner(
        cfg,
        params,
        mesh,
        num_blocks=64,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=TOKENS,
        max_model_len=256,
    )
    v = next(v for v in runner.programs.variants() if not v.decode_only and v.num_tokens == TOKENS)
    exe = runner.programs._lower(v, runner.programs.dummy_args(v, params, runner.prev_tokens)).compile(
        compiler_options=GPU_ORDER
    )
    dense = sum(
        w.layout.k * w.layout.shards * math.prod(w.packed.shape[1:]) * 4  # [K, N] float32
        for w in params["layers"][0].values()
        if isinstance(w, QuantizedWeight)
    )
    return exe.memory_analysis().temp_size_in_bytes, dense


@pytest.mark.parametrize("dispatch", ["reference", "gpu"])
def test_prefill_step_holds_one_layers_dequantized_weights(dispatch, monkeypatch):
    """A 4-layer prefill step's temporaries exceed a 1-layer step's by less than half of one layer's dequantized
    weights: each is dequantized next to its use (with them all dequantized up front the difference was 3 layers'
    worth). "reference": the CPU engine's path (qmatmul's pure-jnp reference); "gpu": the GPU's dispatch
    (quantized_matmul, whose prefill path off a GPU dequantizes at every batch size)."""
    calls = []
    if dispatch == "gpu":
        monkeypatch.setattr(
            decoder, "qmatmul", lambda x, w, **kw: quant_matmul.qmatmul(x, w, **{**kw, "kernels": True})
        )
        real = kernels_quant._dequant_matmul
        monkeypatch.setattr(kernels_quant, "_dequant_matmul", lambda x, w, *a: calls.append(x.shape) or real(x, w, *a))
    jax.clear_caches()  # the decoder layer is a cached jit: trace it again with (or without) the patched dispatch
    one, per_layer = _prefill_temp_bytes(1)
    four, _ = _prefill_temp_bytes(4)
    assert len(calls) == (8 if dispatch == "gpu" else 0), calls  # 4 projections, traced once per model
    assert per_layer > 50 << 20
    assert four - one < per_layer / 2, (one, four, per_layer)


def test_step_reserve_counts_the_largest_dequantized_weight():
    """The KV cache's sizing keeps room for the largest weight a step dequantizes (this device's shard, in the
    model's dtype): Llama-3-8B GPTQ int4's gate_up, 4096 x 28672 bf16, at tp 1; half of it at tp 2."""
    from bench.common import DUMMY_QUANT_CONFIGS, LLAMA3_8B
    from jaxllm.engine import setup

    hf = dict(LLAMA3_8B, num_hidden_layers=2, quantization_config=DUMMY_QUANT_CONFIGS["gptq"])
    cfg = ModelConfig.from_hf(hf, dtype="bfloat16")
    assert setup._dequantized_bytes(abstract_weights(cfg, ParallelConfig(1, 1).make_mesh()), cfg) == 4096 * 28672 * 2
    plain = ModelConfig.from_hf(dict(LLAMA3_8B, num_hidden_layers=2), dtype="bfloat16")
    assert setup._dequantized_bytes(abstract_weights(plain, ParallelConfig(1, 1).make_mesh()), plain) == 0
    big = 8 << 30  # larger than the autotuning headroom (2 x the lm_head): it counts in full
    assert setup._step_reserve(2048, 64, cfg, big) - setup._step_reserve(2048, 64, cfg) > big - (3 << 30)


def test_blocks_for_step_temps():
    from jaxllm.engine import setup

    gib, slack = 2**30, setup._STEP_SLACK_BYTES
    assert setup._blocks_for_step_temps(1000, gib // 16, 2 * gib, 0) == 1000  # no figure: the estimate stands
    assert setup._blocks_for_step_temps(1000, gib // 16, 2 * gib, 2 * gib - slack) == 1000
    assert setup._blocks_for_step_temps(1000, gib // 16, 2 * gib, 9 * gib) == 1000 - 7 * 16 - 4  # 7.25 GiB more


# The engine's shrink and recompile (setup._build_parts) with a quantized checkpoint: tests/test_quant.py.
