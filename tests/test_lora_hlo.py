"""The structure of a decoder layer's LoRA math as the step lowers it (jaxllm/lora/ops.py): two GEMMs per projection
group (q/k/v share one shrink and one expand, as do gate/up), in the model dtype with no convert (split-K shrinks:
float32 partials, converted once), and each expand's output added straight to the base projection (o / down: to
the residual stream plus the base projection, the base model's add), as the add's first operand, so that XLA's GPU
backend can run the adds in the GEMMs' epilogues. Speed is measured by bench/lora.py on a GPU; this pins the shape of the program that bench
measured."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import pytest

from jaxllm.config import ModelConfig
from jaxllm.lora import ops as lora_ops
from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.slots import slot_specs
from jaxllm.models import decoder
from jaxllm.models.attention import AttentionConfig, AttentionMetadata
from jaxllm.models.params import abstract_params, param_specs
from jaxllm.sharding import ParallelConfig, kv_cache_specs

T, S, R = 8, 4, 8  # tokens, max_loras, max_lora_rank
CFG = ModelConfig(
    "llama",
    vocab_size=64,
    hidden_size=48,
    intermediate_size=80,
    num_layers=1,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    dtype="bfloat16",
)
_LINE = re.compile(r"^\s*(%[\w#]+)(?::\d+)? = \"?([\w.]+)\"?(.*)$")


def _main_ops(text: str) -> dict:
    """SSA name -> (op, operands, result type) of the lowered module's @main (nested regions included)."""
    body = text[text.index("func.func public @main") :]
    body = body[: body.index("\n  }\n")]
    ops = {}
    for line in body.splitlines()[1:]:
        m = _LINE.match(line)
        if m:
            name, op, rest = m.groups()
            head, _, typ = rest.partition(" : ")
            ops[name] = (op, re.findall(r"%[\w#]+", head), typ.rsplit("-> ", 1)[-1])
    return ops


def _lowered_layer(with_lora: bool):
    """@main's ops and the SSA names of the LoRA slot arrays (name -> "A" / "B") of one layer's decode step."""
    mesh = ParallelConfig(1).make_mesh()
    lp = abstract_params(param_specs(CFG), jnp.bfloat16)["layers"][0]
    kv = kv_cache_specs(CFG, mesh, 16, 4)[0]
    i32 = jnp.int32
    meta = AttentionMetadata(
        *(jax.ShapeDtypeStruct(s, i32) for s in ((T,), (T,), (T,), (T + 1,), (T, 4))), decode_only=True
    )
    sds = lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16)  # noqa: E731
    ll = jax.tree.map(sds, slot_specs(CFG, LoRAConfig(max_loras=S, max_lora_rank=R), 1)["layers"][0])
    lw = jax.ShapeDtypeStruct((T, S), jnp.bfloat16)  # forward's lora_ops.select, in the slots' dtype
    x = jax.ShapeDtypeStruct((T, CFG.hidden_size), jnp.bfloat16)

    def layer(lp, x, kv, meta, ll, lw):
        ll, lw = (ll, lw) if with_lora else (None, None)
        return decoder.decoder_layer(lp, x, kv, meta, CFG, AttentionConfig(), CFG.layer_kind(0), ll, lw)

    args = (lp, x, kv, meta, ll, lw)
    text = jax.jit(layer, keep_unused=True).lower(*args).as_text()
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    slot_args = {}
    for i, (path, _) in enumerate(leaves):
        if path[0].idx == 4:  # ll: {kind: (A, B)}
            slot_args[f"%arg{i}"] = "AB"[path[-1].idx]
    return _main_ops(text), slot_args


def _count(ops, op):
    return sum(o[0] == op for o in ops.values())


@pytest.mark.parametrize("qkv_block_diagonal, split", [(True, False), (False, False), (True, True)])
def test_lora_layer_is_two_gemms_per_group_in_the_model_dtype_added_in_gemm_epilogues(
    qkv_block_diagonal, split, monkeypatch
):
    if not qkv_block_diagonal:  # more slots / a larger rank: qkv's B per column of a kv head
        monkeypatch.setattr(lora_ops, "QKV_BLOCK_DIAGONAL_MAX_ZEROS", 0)
    # the tiny widths take the decode-sized split-K shrinks (ops._shrink) when slices of 8 are allowed
    monkeypatch.setattr(lora_ops, "SHRINK_SPLITS", 2)
    monkeypatch.setattr(lora_ops, "SHRINK_SPLIT_MIN_INPUTS", 8 if split else 10**6)
    base, _ = _lowered_layer(False)
    ops, slot_args = _lowered_layer(True)
    users = collections.defaultdict(list)
    for name, (_, operands, _) in ops.items():
        for o in operands:
            users[o].append(name)
    for name, (op, operands, _) in ops.items():  # the split shrinks read A through a reshape (a bitcast)
        if op == "stablehlo.reshape" and operands[0] in slot_args:
            slot_args[name] = slot_args[operands[0]]
    lora_dots = {
        n: slot_args[o]
        for n, (op, args, _) in ops.items()
        if op.endswith("dot_general")
        for o in args
        if o in slot_args
    }
    # q/k/v: one shrink and one expand, as gate/up, o and down: 8 GEMMs a layer (14 with a GEMM per slice)
    assert sorted(lora_dots.values()) == ["A"] * 4 + ["B"] * 4, lora_dots
    assert _count(ops, "stablehlo.dot_general") == _count(base, "stablehlo.dot_general") + 8
    # no shrink shares its activation with a base GEMM: XLA's GPU DotMerger would merge the two by concatenating
    # the base weight with the slots' A, a copy of the base weight every step
    base_lhs = {
        o for n, (op, args, _) in ops.items() if op.endswith("dot_general") and n not in lora_dots for o in args
    }
    shrink_lhs = {o for n, k in lora_dots.items() if k == "A" for o in ops[n][1] if o not in slot_args}
    assert shrink_lhs and not shrink_lhs & base_lhs, (shrink_lhs, base_lhs)
    # no float32 round trips: every expand's result in bf16; the shrinks' too, or with split-K their float32
    # partials, summed and masked in float32 and converted once (the mask's convert and the sum's per shrink)
    shrinks = [n for n, k in lora_dots.items() if k == "A"]
    expands = [n for n, k in lora_dots.items() if k == "B"]
    assert all(ops[n][2].endswith("bf16>") for n in expands), [ops[n][2] for n in expands]
    assert all(ops[n][2].endswith("f32>" if split else "bf16>") for n in shrinks), [ops[n][2] for n in shrinks]
    assert _count(ops, "stablehlo.convert") == _count(base, "stablehlo.convert") + (8 if split else 0)
    # gate_up's shrink output [T, S, 2, R] is transposed (its part leads the batched expand), no expand's output;
    # with qkv's B per column its shrink output and its expand's output are too
    extra = 1 if qkv_block_diagonal else 3
    assert _count(ops, "stablehlo.transpose") == _count(base, "stablehlo.transpose") + extra
    epilogue = []
    for n in expands:
        user = users[n][0]
        if ops[user][0] != "stablehlo.add":
            continue  # gate_up's parts, sliced where the activation reads them; qkv's transposed columns
        # the delta first: XLA's GemmRewriter tries operand 0 as the GEMM first and stops at one that already adds
        first, other = ops[user][1]
        assert first == n, ops[user]
        if ops[other][0] == "stablehlo.dot_general":
            epilogue.append("base")  # qkv: delta + base GEMM
            continue
        # o / down: delta + (residual + base GEMM), the inner add the base model's, each with a GEMM to run it
        assert ops[other][0] == "stablehlo.add", ops[other]
        assert any(ops[o][0] == "stablehlo.dot_general" for o in ops[other][1] if o in ops), ops[other]
        epilogue.append("residual")
    # qkv's expand added to the base qkv GEMM; o's and down's to the residual stream plus the base GEMM
    qkv = ["base"] if qkv_block_diagonal else []
    assert sorted(epilogue) == qkv + ["residual", "residual"], epilogue
