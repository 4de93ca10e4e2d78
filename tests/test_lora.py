"""LoRA without an engine: the batched math against its per-token reference, PEFT adapters read (and refused,
naming the field), decoder logits against HF + PEFT at tp 1 and 2, slots' LRU, config checks, prefix-cache keys,
the scheduler's adapter limit, --lora-modules parsing. Adapters are made by PEFT itself (get_peft_model +
save_pretrained)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxllm.config import ModelConfig
from jaxllm.engine.args import EngineArgs
from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.configs import CacheConfig, SchedulerConfig
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Sequence
from jaxllm.lora import ops
from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.peft import load_adapter
from jaxllm.lora.request import LoRARequest
from jaxllm.lora.slots import LoRASlots, slot_specs
from jaxllm.sharding import ParallelConfig
from tests.tiny_models import make_hf_model, make_tiny_model_dir

peft = pytest.importorskip("peft")

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]


def make_adapter(out_dir: str, seed: int, scale: float = 4.0, **lora_kw):
    """A PEFT adapter of the tiny Llama (seed 0 base weights), saved by PEFT; returns the PeftModel. B is scaled
    up from PEFT's random init so that greedy tokens differ from the base model's."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(make_hf_model("llama"), peft.LoraConfig(init_lora_weights=False, **lora_kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.mul_(scale)
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("base")))[0]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    a1 = make_adapter(str(root / "a1"), 1, r=4, lora_alpha=8, target_modules=ALL_MODULES)
    a2 = make_adapter(
        str(root / "a2"),
        2,
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"down_proj": 4},
    )
    return {"a1": (str(root / "a1"), a1), "a2": (str(root / "a2"), a2)}


# ---- the math --------------------------------------------------------------------------------------------------
def split_shrinks(monkeypatch):
    """Tiny widths take ops._shrink's split-K path (decode-sized batches on the 8B shape do): 2 slices of >= 4."""
    monkeypatch.setattr(ops, "SHRINK_SPLITS", 2)
    monkeypatch.setattr(ops, "SHRINK_SPLIT_MIN_INPUTS", 4)


def test_shrink_splits_divide_the_input_into_the_most_slices_of_at_least_the_minimum():
    assert ops.SHRINK_SPLITS == 16 and ops.SHRINK_SPLIT_MIN_INPUTS == 128
    # Llama 8B's hidden / MLP widths, Qwen2.5-7B's (3584 = 7 x 512), a width 16 slices would cut under 128, tiny
    got = {k: ops.shrink_splits(k) for k in (4096, 14336, 3584, 1000, 1536, 200, 96)}
    assert got == {4096: 16, 14336: 16, 3584: 16, 1000: 4, 1536: 8, 200: 1, 96: 1}


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("kind", ["qkv", "qkv_columns", "o", "gate_up", "down", "embed", "lm_head"])
def test_batched_delta_matches_per_token_reference(kind, split, monkeypatch):
    if split:
        split_shrinks(monkeypatch)
    S, R, T, D, N, K, H, F, V = 3, 4, 11, 16, 4, 2, 4, 24, 32
    G = N // K
    shapes = {  # ops.py's slot layouts
        "qkv": ((D, S, 3, R), (S, 3, R, K, G + 2, H), (T, D)),  # block-diagonal B
        "qkv_columns": ((D, S, 3, R), (G + 2, S, R, K, H), (T, D)),  # B per column of a kv head
        "o": ((N, H, S, R), (S, R, D), (T, N, H)),
        "gate_up": ((D, S, 2, R), (2, S, R, F), (T, D)),
        "down": ((F, S, R), (S, R, D), (T, F)),
        "embed": ((V, S, R), (S, R, D), None),
        "lm_head": ((D, S, R), (S, R, V), (T, D)),
    }
    sa, sb, sx = shapes[kind]
    rng = np.random.default_rng(0)
    A, B = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (sa, sb))
    x = (
        jnp.asarray(rng.integers(0, V, T), jnp.int32)
        if sx is None
        else jnp.asarray(rng.standard_normal(sx), jnp.float32)
    )
    slots = jnp.asarray([-1, 0, 1, 2, 2, -1, 0, 1, 1, 2, 0], jnp.int32)
    kind = kind.removesuffix("_columns")
    got = ops.delta(kind, x, A, B, ops.select(slots, S))
    want = ops.delta_reference(kind, x, A, B, slots)
    jaxpr = jax.make_jaxpr(lambda x, A, B, w: ops.delta(kind, x, A, B, w))(x, A, B, ops.select(slots, S))
    batched = "(([2], [1]), ([1], [0]))" in str(jaxpr)
    assert batched == (split and kind != "embed")  # the split shrink: one GEMM batched over the input's slices
    if kind == "gate_up":  # its parts lead: [2, T, F]
        got, want = (jnp.moveaxis(a, 0, 1) for a in (got, want))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(got)[np.asarray(slots) < 0] == 0)  # the base model's tokens get nothing
    assert np.abs(np.asarray(got)).max() > 1  # not vacuous


# ---- decoder logits against HF + PEFT ---------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg", "attn"))
def _logits(params, kv, token_ids, meta, weights, token_slots, cfg, attn):
    from jaxllm.models.decoder import compute_logits, forward

    kv, hidden = forward(params, kv, token_ids, meta, cfg, attn, lora=ops.LoRAInputs(weights, token_slots))
    return compute_logits(params, hidden, cfg, weights["lm_head"], token_slots)


_HLO_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = \w+\[([\d,]*)\]\S* ([\w\-]+)\(", re.M)


@pytest.mark.parametrize("T, qkv_block_diagonal, split", [(1, True, False), (5, True, True), (5, False, False)])
def test_delta_reads_the_slot_arrays_in_place(T, qkv_block_diagonal, split, monkeypatch):
    """ops.py's layouts: the compiled delta() never transposes / copies a slot array (XLA does when a GEMM's
    operand has its contracted or kept axes apart, or a batch axis in the middle: the slot-leading layouts copied
    every A and B each step). Checked in XLA:CPU's optimized HLO, slot arrays as slots.py lays them out."""
    cfg = ModelConfig(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
    )
    if not qkv_block_diagonal:
        monkeypatch.setattr(ops, "QKV_BLOCK_DIAGONAL_MAX_ZEROS", 0)
    if split:
        split_shrinks(monkeypatch)
    specs = slot_specs(cfg, LoRAConfig(max_loras=3, max_lora_rank=8), tp=1)
    assert len(specs["layers"][0]["qkv"][1].shape) == (6 if qkv_block_diagonal else 5)
    pairs = dict(specs["layers"][0], embed=specs["embed"], lm_head=specs["lm_head"])
    x_shapes = {"qkv": (T, 32), "o": (T, 4, 8), "gate_up": (T, 32), "down": (T, 48), "lm_head": (T, 32)}
    for kind, (sa, sb) in pairs.items():
        A, B = (jax.ShapeDtypeStruct(s.shape, jnp.float32) for s in (sa, sb))
        x = jax.ShapeDtypeStruct(x_shapes.get(kind, (T,)), jnp.int32 if kind == "embed" else jnp.float32)
        fn = jax.jit(lambda x, A, B, s, kind=kind: ops.delta(kind, x, A, B, ops.select(s, 3)))
        hlo = fn.lower(x, A, B, jax.ShapeDtypeStruct((T,), jnp.int32)).compile().as_text()
        slot_sizes = {int(np.prod(sa.shape)), int(np.prod(sb.shape))}
        ops_seen = [(op, int(np.prod([int(d) for d in dims.split(",") if d]))) for dims, op in _HLO_OP.findall(hlo)]
        assert {n for op, n in ops_seen if op == "parameter"} >= slot_sizes, hlo  # the parse sees the arrays
        moved = [(op, n) for op, n in ops_seen if op in ("transpose", "copy") and n in slot_sizes]
        assert not moved, f"{kind}: {moved}\n{hlo}"


# tp 4 > K 2: kv heads repeated; qkv's B per column of a kv head (ops.qkv_block_diagonal False) at tp 2.
# absorb: the slots fused into the base weights (LoRASlots.absorb) before the adapters are written into them
# ("first") or after ("after"), for ops.FUSED_KINDS: all four projections or two of them.
@pytest.mark.parametrize(
    "tp, fully_sharded, qkv_columns, absorb, fused_kinds",
    [
        (1, False, False, None, ops.FUSED_KINDS),
        (2, False, False, None, ops.FUSED_KINDS),
        (4, True, False, None, ops.FUSED_KINDS),
        (2, False, True, None, ops.FUSED_KINDS),
        (1, False, False, "first", ops.FUSED_KINDS),
        (1, False, False, "after", ops.FUSED_KINDS),
        (1, False, True, "first", ops.FUSED_KINDS),
        (1, False, False, "after", ("qkv", "gate_up")),
        (1, False, False, "first", ("o", "down")),
    ],
)
def test_decoder_logits_match_hf_peft_with_two_adapters_and_base_in_one_batch(
    base, adapters, tp, fully_sharded, qkv_columns, absorb, fused_kinds, monkeypatch
):
    from jaxllm.engine.inputs import SeqChunk, build_step_inputs
    from jaxllm.models.attention import AttentionConfig, AttentionMetadata
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import make_kv_caches

    cfg = ModelConfig.from_hf(base, dtype="float32")
    mesh = ParallelConfig(tp).make_mesh()
    params = load_params(base, cfg, mesh)
    if qkv_columns:
        monkeypatch.setattr(ops, "QKV_BLOCK_DIAGONAL_MAX_ZEROS", 0)
    monkeypatch.setattr(ops, "FUSED_KINDS", fused_kinds)
    slots = LoRASlots(LoRAConfig(max_loras=2, max_lora_rank=8, fully_sharded_loras=fully_sharded), cfg, mesh)
    assert slots.arrays["layers"][0]["qkv"][1].ndim == (5 if qkv_columns else 6)
    assert slots.fused == (tp == 1)
    if absorb == "first":
        params = slots.absorb(params)
    for i, name in enumerate(("a1", "a2"), 1):
        slots.add(LoRARequest(name, i, adapters[name][0]))
    slot_of = slots.activate([2, 1])
    if absorb == "after":
        params = slots.absorb(params)
    if absorb:  # the base projections' weights live in the slot arrays now
        k = fused_kinds[0]
        assert ops.FUSED_BASE[k] not in params["layers"][0] and f"{k}_fused" in slots.arrays["layers"][0]
        assert jax.tree.structure(slots.arrays) == jax.tree.structure(slots.abstract())
    prompts = [[3, 17, 42, 9, 100], [5, 77, 6], [8, 1, 2, 3]]
    owners = [1, 0, 2]  # lora_int_id per prompt (0: the base model)
    chunks = [SeqChunk(p, 0, [1 + 2 * i, 2 + 2 * i]) for i, p in enumerate(prompts)]
    inp = build_step_inputs(chunks, 4, 16, 4, 4)
    meta = AttentionMetadata(
        *(
            jnp.asarray(getattr(inp, f))
            for f in ("positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables")
        ),
        inp.decode_only,
    )
    token_slots = np.full(16, -1, np.int32)
    token_slots[: inp.num_tokens] = np.repeat([slot_of.get(o, -1) for o in owners], [len(p) for p in prompts])
    out = np.asarray(
        _logits(
            params,
            make_kv_caches(cfg, mesh, 16, 4),
            jnp.asarray(inp.token_ids),
            meta,
            slots.arrays,
            jnp.asarray(token_slots),
            cfg,
            AttentionConfig(mesh=mesh),
        )
    )
    hf = {0: adapters["a1"][1].get_base_model(), 1: adapters["a1"][1], 2: adapters["a2"][1]}
    lo = 0
    for p, owner in zip(prompts, owners, strict=True):
        model = hf[owner]
        with torch.no_grad():
            if owner == 0:
                with adapters["a1"][1].disable_adapter():
                    ref = adapters["a1"][1](torch.tensor([p])).logits[0].numpy()
            else:
                ref = model(torch.tensor([p])).logits[0].numpy()
        np.testing.assert_allclose(out[lo : lo + len(p)], ref, atol=2e-4, rtol=1e-4)
        lo += len(p)


# ---- adapters refused, naming the field ---------------------------------------------------------------------------
def _edited_copy(src: str, dst: str, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_bad_adapters_are_refused_naming_the_field(base, adapters, tmp_path):
    cfg = ModelConfig.from_hf(base, dtype="float32")
    a1 = adapters["a1"][0]
    with pytest.raises(ValueError, match=r"^r: LoRA rank 4 is greater than max_lora_rank 1"):
        load_adapter(a1, cfg, 1)
    with pytest.raises(ValueError, match=r"^r: LoRA rank 8 is greater than max_lora_rank 1"):  # rank_pattern's too
        load_adapter(_edited_copy(a1, str(tmp_path / "rp"), rank_pattern={"q_proj": 8}), cfg, 1)
    for name, value in (("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "all")):
        with pytest.raises(ValueError, match=rf"^{name}: "):
            load_adapter(_edited_copy(a1, str(tmp_path / name), **{name: value}), cfg, 16)
    with pytest.raises(ValueError, match="^No adapter found"):
        load_adapter(str(tmp_path / "missing"), cfg, 16)
    added = _edited_copy(a1, str(tmp_path / "added"))
    open(os.path.join(added, "new_embeddings.safetensors"), "wb").close()
    with pytest.raises(ValueError, match=r"^new_embeddings\.safetensors: .* adds tokens"):
        load_adapter(added, cfg, 16)
    # a module jaxllm has no LoRA for (PEFT's own tensor naming, another module name)
    from safetensors.numpy import load_file, save_file

    odd = _edited_copy(a1, str(tmp_path / "odd"))
    t = load_file(os.path.join(odd, "adapter_model.safetensors"))
    t = {k.replace("layers.0.mlp.up_proj", "layers.0.mlp.fc_in"): v for k, v in t.items()}
    save_file(t, os.path.join(odd, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"^target_modules: .*model\.layers\.0\.mlp\.fc_in"):
        load_adapter(odd, cfg, 16)
    # base model mismatch: an adapter made by PEFT for a wider model
    from transformers import AutoModelForCausalLM

    hf_cfg = make_hf_model("llama").config
    hf_cfg.hidden_size, hf_cfg.intermediate_size = 32, 48
    wide = peft.get_peft_model(
        AutoModelForCausalLM.from_config(hf_cfg), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    )
    wide.peft_config["default"].base_model_name_or_path = "other/llama-32"
    wide.save_pretrained(str(tmp_path / "wide"))
    with pytest.raises(
        ValueError,
        match=r"^base_model_name_or_path: .*'other/llama-32'.*: model\.layers\.0\.self_attn\.q_proj maps 32 -> ",
    ):
        load_adapter(str(tmp_path / "wide"), cfg, 16)


def test_slots_fuse_into_base_weights_only_where_they_can(base, monkeypatch):
    """slots.fuses_base: one device, unquantized, no MoE, the slots in the model's dtype, FUSE_BASE on."""
    from jaxllm.lora import slots as slots_mod

    cfg = ModelConfig.from_hf(base, dtype="float32")
    one, two = ParallelConfig(1).make_mesh(), ParallelConfig(2).make_mesh()
    lora = LoRAConfig(max_loras=2, max_lora_rank=8)
    assert slots_mod.fuses_base(cfg, lora, one) and not slots_mod.fuses_base(cfg, lora, two)
    assert not slots_mod.fuses_base(cfg, LoRAConfig(max_loras=2, max_lora_rank=8, lora_dtype="float16"), one)
    monkeypatch.setattr(slots_mod, "FUSE_BASE", False)
    assert not slots_mod.fuses_base(cfg, lora, one)


def test_lora_config_and_request_checks():
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        EngineArgs(enable_lora=True, max_lora_rank=12).validate()
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineArgs(enable_lora=True, max_loras=2, max_cpu_loras=1).validate()
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1"):
        EngineArgs(enable_lora=True, max_loras=0).validate()
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineArgs(enable_lora=True, pipeline_parallel_size=2).validate()
    with pytest.raises(ValueError, match="enable_lora is not supported with speculative decoding"):
        EngineArgs(
            enable_lora=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
        ).validate()
    EngineArgs(max_lora_rank=12).validate()  # LoRA off: its options are not read
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3
    with pytest.raises(ValueError, match="id must be > 0, got 0"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="lora_path cannot be empty"):
        LoRARequest("x", 1)
    assert LoRARequest("x", 1, "/a") == LoRARequest("x", 2, "/b")  # vLLM: equal by name


def test_slots_lru_and_host_cache(base, adapters):
    cfg = ModelConfig.from_hf(base, dtype="float32")
    slots = LoRASlots(LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1), cfg, ParallelConfig(1).make_mesh())
    assert slots.add(LoRARequest("a1", 1, adapters["a1"][0])) and slots.add(LoRARequest("a2", 2, adapters["a2"][0]))
    assert not slots.add(LoRARequest("a1", 1, adapters["a1"][0]))  # known: nothing read again
    with pytest.raises(ValueError, match="lora_int_id 1 is already used by adapter 'a1'"):
        slots.add(LoRARequest("other", 1, adapters["a2"][0]))
    assert list(slots._host) == [2]  # max_cpu_loras 1: a1 was evicted from host memory
    assert slots.activate([1]) == {1: 0}  # a1 read from its folder again, into the one slot
    a_q = np.asarray(slots.arrays["layers"][0]["qkv"][0][:, 0])  # A [D, S, 3, R]: slot 0
    assert slots.activate([1]) == {1: 0} and slots.num_swaps == 1  # already there
    assert slots.activate([2]) == {2: 0} and slots.num_swaps == 2  # swapped: same program, new values
    assert not np.array_equal(a_q, np.asarray(slots.arrays["layers"][0]["qkv"][0][:, 0]))
    with pytest.raises(RuntimeError, match="more than max_loras"):
        slots.activate([1, 2])
    assert slots.remove(2) and not slots.remove(2)


# ---- host side: prefix cache keys, the scheduler's limit ----------------------------------------------------------
def test_two_adapters_never_share_kv_blocks():
    bm = BlockManager(32, 4)
    seqs = [
        Sequence(str(i), list(range(12)), lora_id=lid, lora_key=key)
        for i, (lid, key) in enumerate([(0, None), (1, "lora:1:x"), (2, "lora:2:y"), (1, "lora:1:x")])
    ]
    for s in seqs[:3]:
        assert bm.find_cached_prefix(s) == []
        bm.allocate_prompt(s, 12, [])
        s.num_computed_tokens = 12
        bm.commit_full_blocks(s)
    assert len(bm.find_cached_prefix(seqs[3])) == 2  # the same adapter shares its own blocks
    assert bm.find_cached_prefix(seqs[3]) == seqs[1].block_table[:2]
    assert Sequence("x", [1], cache_salt="lora:1:x").block_hashes == []
    salted = Sequence("y", list(range(12)), cache_salt="lora:1:x")
    assert bm.find_cached_prefix(salted) == []  # a salt equal to an adapter's key is another key


def test_scheduler_runs_at_most_max_loras_adapters():
    sched = Scheduler(
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8, max_loras=2),
        CacheConfig(num_blocks=64, block_size=4),
    )
    for i, lid in enumerate([1, 2, 3, 0, 1]):
        sched.add(Sequence(f"s{i}", [1, 2, 3], lora_id=lid))
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["s0", "s1", "s3", "s4"]  # s2's adapter waits for a slot
    sched.finish("s1", sched.get("s1").status.FINISHED_STOPPED)
    out = sched.schedule()
    assert "s2" in [s.seq.seq_id for s in out.scheduled]


def test_lora_modules_flag_forms():
    from server.args import parse_args
    from server.lora import parse_lora_module

    m = parse_lora_module('{"name": "sql", "path": "/a/sql", "base_model_name": "base"}')
    assert (m.name, m.path, m.base_model_name) == ("sql", "/a/sql", "base")
    args = parse_args(
        ["m", "--enable-lora", "--lora-modules", "sql=/a/sql", '{"name": "x", "path": "/x"}'],
        environ={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    assert [(m.name, m.path) for m in args.lora_modules] == [("sql", "/a/sql"), ("x", "/x")]
    assert args.allow_runtime_lora_updating
    assert not parse_args(["m", "--enable-lora"], environ={}).allow_runtime_lora_updating
    for bad in ("sql", "=p", '{"name": 1, "path": "p"}', '{"name": "a", "path": "p", "rank": 2}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)
    with pytest.raises(SystemExit):
        parse_args(["m", "--lora-modules", "sql=/a"], environ={})  # needs --enable-lora
