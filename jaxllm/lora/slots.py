"""LoRASlots: the adapters the engine knows (by lora_int_id), their weights in host memory (an LRU of max_cpu_loras,
re-read from their folder when evicted) and max_loras device slots that the compiled step reads.

The slot arrays (jaxllm/lora/ops.py's layouts) are arguments of the step, never constants: writing an adapter into
a slot is one small jitted update (the slot index is data, the arrays donated), so swapping adapters or changing a
batch's mix never recompiles. The slot axis is mostly not the leading one (ops.py: so that the step's GEMMs read
the arrays in place), so a write fills a strided region of each array: a rare write pays that, not every step.
Writes are dispatched after the steps already in flight, and the device runs them in order, so a step still reading
a slot's old adapter finishes before it is overwritten.

Tensor parallelism as in vLLM: column-parallel projections (qkv, gate_up) keep A replicated and split B on its
output (kv heads, ffn); row-parallel ones (o, down) split A on its input (heads, ffn) and keep B replicated, so the
shrink's partial sums are all-reduced ([T, S, R], small) before the expand. fully_sharded_loras also splits A's
rank (column-parallel) and B's output (row-parallel) over tp. All of it through jaxllm/sharding.py's rules.

On one device with unquantized base weights in the slots' dtype the slots are fused into the base weights
(ops.py's fused layouts, FUSE_BASE): the runner hands its params to absorb(), which moves each layer's w_qkv,
w_gate_up (the slots' A columns beside them) and wo, w_down (the slots' B rows under them) into the slot arrays
and returns the params without them. Until then (the KV cache is sized, and adapters may be written) the slots are
kept as separate arrays and joined with the base weights by absorb, which frees both: the device memory is the
same. H100, 8B shape, 8 slots of rank 16 (bench/lora.py, lora_h100_*.json): batch-64 ITL 7.36-7.51 ms fused
against 7.87 separate (base 6.39-6.44), batch 1 6.23-6.74 against 6.68 (base 5.50); fusing only qkv and gate_up
(ops.FUSED_KINDS) gave 7.71-8.02 / 6.48-6.53. One GEMM over [input | shrink] also below 32 tokens: the base
weight sliced back out of its fused array was copied every step (memcpy, 93 us a layer at batch 1).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.lora import ops
from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.peft import LAYER_KEYS, LoRAAdapter, load_adapter
from jaxllm.lora.request import LoRARequest
from jaxllm.models.params import ParamSpec
from jaxllm.sharding import LOGICAL_RULES, kv_heads_for, mesh_tp, named_sharding

logger = logging.getLogger(__name__)

FUSE_BASE = True  # fuse the slots into the base weights where fuses_base() allows it (False: separate arrays)


def fuses_base(model: ModelConfig, lora: LoRAConfig, mesh) -> bool:
    """Whether the slots are fused into the base weights: one device, dense unquantized layers in the slots' dtype."""
    return (
        FUSE_BASE
        and mesh.devices.size == 1
        and model.quantization is None
        and model.moe is None
        and jnp.dtype(lora.dtype(model.dtype)) == jnp.dtype(model.dtype)
    )


@dataclass(frozen=True)
class _Where:
    """Where one slot's array goes in a slot array: at index `slot` of `axis` ("axis"), or as `width` columns /
    rows at offset + slot * width of a fused base weight ("cols" / "rows")."""

    how: str
    axis: int = 0
    offset: int = 0
    width: int = 0


def slot_specs(model: ModelConfig, lora: LoRAConfig, tp: int) -> dict:
    """The slot arrays as ParamSpecs, in jaxllm/lora/ops.py's layouts (the max_loras slots on the "lora_slots" axis;
    kv heads stored as the base weights are)."""
    S, R = lora.max_loras, lora.max_lora_rank
    D, N, H, F, V = model.hidden_size, model.num_heads, model.head_dim, model.intermediate_size, model.vocab_size
    K = kv_heads_for(model.num_kv_heads, tp)
    G = N // K
    a_rank = "lora_a_rank"
    if ops.qkv_block_diagonal(S, R, K, G, H, jnp.dtype(lora.dtype(model.dtype)).itemsize):
        qkv_b = ParamSpec((S, 3, R, K, G + 2, H), ("lora_slots", None, None, "kv_heads", "qkv", "head_dim"))
    else:
        qkv_b = ParamSpec((G + 2, S, R, K, H), ("qkv", "lora_slots", None, "kv_heads", "head_dim"))
    layer = {
        "qkv": (
            ParamSpec((D, S, 3, R), ("embed", "lora_slots", None, a_rank)),
            qkv_b,
        ),
        "o": (
            ParamSpec((N, H, S, R), ("heads", "head_dim", "lora_slots", None)),
            ParamSpec((S, R, D), ("lora_slots", None, "lora_b_out")),
        ),
        "gate_up": (
            ParamSpec((D, S, 2, R), ("embed", "lora_slots", None, a_rank)),
            ParamSpec((2, S, R, F), (None, "lora_slots", None, "ffn")),
        ),
        "down": (
            ParamSpec((F, S, R), ("ffn", "lora_slots", None)),
            ParamSpec((S, R, D), ("lora_slots", None, "lora_b_out")),
        ),
    }
    return {
        "layers": [dict(layer) for _ in range(model.num_layers)],
        "embed": (
            ParamSpec((V, S, R), ("vocab", "lora_slots", None)),
            ParamSpec((S, R, D), ("lora_slots", None, "lora_b_out")),
        ),
        "lm_head": (
            ParamSpec((D, S, R), ("embed", "lora_slots", a_rank)),
            ParamSpec((S, R, V), ("lora_slots", None, "vocab")),
        ),
    }


def _slot_axis(spec: ParamSpec) -> int:
    return spec.axes.index("lora_slots")


def _without_slot(spec: ParamSpec) -> tuple:
    """One slot's axes (the write's input)."""
    i = _slot_axis(spec)
    return spec.axes[:i] + spec.axes[i + 1 :]


def _without_slot_shape(spec: ParamSpec) -> tuple:
    i = _slot_axis(spec)
    return spec.shape[:i] + spec.shape[i + 1 :]


def lora_rules(lora: LoRAConfig) -> dict:
    if not lora.fully_sharded_loras:
        return LOGICAL_RULES
    return dict(LOGICAL_RULES, lora_a_rank="tp", lora_b_out="tp")


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


class LoRASlots:
    def __init__(self, lora: LoRAConfig, model: ModelConfig, mesh):
        tp = mesh_tp(mesh)
        if lora.fully_sharded_loras and (lora.max_lora_rank % tp or model.hidden_size % tp):
            raise ValueError(
                f"fully_sharded_loras splits max_lora_rank ({lora.max_lora_rank}) and hidden_size "
                f"({model.hidden_size}) over tensor_parallel_size ({tp}): both must be divisible by it."
            )
        self.config, self.model, self.mesh = lora, model, mesh
        self.dtype = jnp.dtype(lora.dtype(model.dtype))
        rules = lora_rules(lora)
        self.specs = slot_specs(model, lora, tp)
        self.shardings = jax.tree.map(lambda s: named_sharding(mesh, s.axes, rules), self.specs, is_leaf=_is_spec)
        self._slot_shardings = jax.tree.map(
            lambda s: named_sharding(mesh, _without_slot(s), rules), self.specs, is_leaf=_is_spec
        )
        self._slot_axes = jax.tree.map(lambda s: _Where("axis", _slot_axis(s)), self.specs, is_leaf=_is_spec)
        self.arrays = jax.tree.map(
            lambda s, sh: jax.jit(lambda: jnp.zeros(s.shape, self.dtype), out_shardings=sh)(),
            self.specs,
            self.shardings,
            is_leaf=_is_spec,
        )
        self._write = jax.jit(functools.partial(_write_slot, where=self._slot_axes), donate_argnums=(0,))
        self.fused = fuses_base(model, lora, mesh)  # the layers' slots go into the base weights (absorb)
        self.absorbed = False  # absorb() has fused them
        self.requests: dict[int, LoRARequest] = {}  # every adapter added (by lora_int_id)
        self._keys: dict[int, str] = {}  # lora_int_id -> prefix-cache key (one per registration)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU: oldest first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.removing: set[int] = set()  # removed while requests still used them: forgotten after the last
        self.num_swaps = 0

    @property
    def num_slots(self) -> int:
        return self.config.max_loras

    def abstract(self):
        """The slot arrays as shape / dtype / sharding specs (lowering the step without them); fused (once absorb()
        has run or not) where the slots go into the base weights."""
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)  # noqa: E731
        if not self.fused or self.absorbed:
            return jax.tree.map(spec, self.arrays)
        base = self._base_specs()
        fused = jax.eval_shape(ops.fuse_layer, base, jax.tree.map(spec, self.arrays["layers"][0]))
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._replicated()), fused)
        return dict(jax.tree.map(spec, self.arrays), layers=[layer] * self.model.num_layers)

    # ---- fused into the base weights (fuses_base) ----
    def _replicated(self):
        """The fused arrays' sharding (one device)."""
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def _base_specs(self) -> dict:
        """The shapes / dtype of one layer's base weights that absorb() takes (tp 1: the model's kv heads)."""
        m = self.model
        K, H, D, F = m.num_kv_heads, m.head_dim, m.hidden_size, m.intermediate_size
        shapes = {"w_qkv": (D, K, m.num_heads // K + 2, H), "wo": (m.num_heads, H, D), "w_gate_up": (D, 2, F)}
        shapes["w_down"] = (F, D)
        return {k: jax.ShapeDtypeStruct(v, self.dtype) for k, v in shapes.items()}

    def absorb(self, params):
        """Fused mode (self.fused): the params without each layer's w_qkv, wo, w_gate_up and w_down, which move
        into the slot arrays (ops.fuse_layer; the separate slot arrays and the base weights are freed). Abstract
        params (ShapeDtypeStruct: the steps compile before the weights are loaded) lose the keys only. A no-op
        otherwise, and on params absorbed before (a runner rebuilt on them)."""
        keys = tuple(ops.FUSED_BASE[k] for k in ops.FUSED_KINDS)
        if not self.fused or keys[0] not in params["layers"][0]:
            return params
        layers = [{k: v for k, v in lp.items() if k not in keys} for lp in params["layers"]]
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params["layers"][0])):
            return dict(params, layers=layers)
        if self.absorbed:
            raise RuntimeError("LoRA slots were fused into base weights already; weights cannot be replaced.")
        want = {k: v for k, v in self._base_specs().items() if k in keys}
        join = jax.jit(ops.join_base, static_argnames="columns", out_shardings=self._replicated())
        for i, lp in enumerate(params["layers"]):
            for k, spec in want.items():
                if lp[k].shape != spec.shape or lp[k].dtype != spec.dtype:
                    raise ValueError(f"LoRA: layer {i}'s {k} is {lp[k].shape} {lp[k].dtype}, not {spec.shape}.")
            pieces = self.arrays["layers"][i]
            fused = {k: v for k, v in pieces.items() if k not in ops.FUSED_KINDS}
            for kind in ops.FUSED_KINDS:  # one weight at a time: each joined pair is freed before the next
                a, b, key = *pieces[kind], ops.FUSED_BASE[kind]
                fused[f"{kind}_fused"] = ops.fuse_pair(kind, lp[key], a, b, join)
                (a if kind in ops.COLUMN_KINDS else b).delete()
                lp[key].delete()
            self.arrays["layers"][i] = fused
        self.absorbed = True
        self._write = jax.jit(functools.partial(_write_slot, where=self._fused_where()), donate_argnums=(0,))
        if not self.num_swaps:  # compiles the fused write (zeros into slot 0, which holds nothing yet)
            self.warm_up()
        return dict(params, layers=layers)

    def _fused_where(self):
        """_write_slot's targets once fused: the fused weights' slot columns / rows (after the base weight's, one
        slot's A [D, P, R] / B [R, D] wide), the other arrays' slot axis."""
        R, base = self.config.max_lora_rank, self._base_specs()
        layer = self._slot_axes["layers"][0]
        fused = {k: v for k, v in layer.items() if k not in ops.FUSED_KINDS}
        for kind in ops.FUSED_KINDS:
            shape = base[ops.FUSED_BASE[kind]].shape
            if kind in ops.COLUMN_KINDS:  # A's columns beside w [D, ..]
                parts = self.specs["layers"][0][kind][0].shape[-2]  # A [D, S, P, R]
                fused[f"{kind}_fused"] = (_Where("cols", offset=math.prod(shape[1:]), width=parts * R), layer[kind][1])
            else:  # B's rows under w [.., D]
                fused[f"{kind}_fused"] = (layer[kind][0], _Where("rows", offset=math.prod(shape[:-1]), width=R))
        return dict(self._slot_axes, layers=[fused] * self.model.num_layers)

    # ---- adapters ----
    def add(self, request: LoRARequest) -> bool:
        """Registers request's adapter, reading and checking it now (ValueError naming the field); False when this
        lora_int_id is already registered with the same folder. One id, one folder: another folder under a known
        id is an error (the engine would otherwise serve the old weights under the new name). Adding an adapter
        that is waiting to be removed keeps it."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}.")
        self.removing.discard(request.lora_int_id)
        known = self.requests.get(request.lora_int_id)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is already used by adapter {known.lora_name!r} "
                    f"({known.lora_path}); give {request.lora_name!r} ({request.lora_path}) another id, "
                    "or remove the other adapter first."
                )
            return False
        adapter = load_adapter(request.lora_path, self.model, self.config.max_lora_rank)
        self.requests[request.lora_int_id] = request
        # A fresh key per registration (re-adding an id after removing it may mean other weights), random so that
        # no request's cache_salt can hash like it (block_manager._salt_hash)
        self._keys[request.lora_int_id] = f"lora:{request.lora_int_id}:{os.urandom(16).hex()}"
        self._cache(request.lora_int_id, adapter)
        logger.info(
            "Loaded LoRA adapter %r (id %d, rank %d, %.1f MB) from %s",
            request.lora_name,
            request.lora_int_id,
            adapter.rank,
            adapter.nbytes / 2**20,
            request.lora_path,
        )
        return True

    def remove(self, lora_id: int) -> bool:
        """Forgets the adapter (its slot is free again). Requests still running with it keep their slot's weights
        until the slot is reused; the engine removes an adapter only when none of its requests is left."""
        if self.requests.pop(lora_id, None) is None:
            return False
        self._keys.pop(lora_id, None)
        self._host.pop(lora_id, None)
        self._slot_of.pop(lora_id, None)
        return True

    def remove_when_unused(self, lora_id: int, in_use: set[int]) -> bool:
        """vLLM's remove_lora: False if unknown; else it is no longer listed and is forgotten once no request
        uses it (in_use: the adapters of the engine's requests; drop_removed does the rest)."""
        if lora_id not in self.requests:
            return False
        self.removing.add(lora_id)
        self.drop_removed(in_use)
        return True

    def drop_removed(self, in_use: set[int]) -> None:
        for lora_id in list(self.removing - in_use):
            self.removing.discard(lora_id)
            self.remove(lora_id)

    def listed(self) -> set[int]:
        """vLLM's list_loras: the ids of the adapters added and not removed."""
        return set(self.requests) - self.removing

    def cache_key(self, lora_id: int) -> str:
        return self._keys[lora_id]

    def _cache(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)

    def _host_adapter(self, lora_id: int) -> LoRAAdapter:
        adapter = self._host.get(lora_id)
        if adapter is None:  # evicted from host memory: read its folder again
            adapter = load_adapter(self.requests[lora_id].lora_path, self.model, self.config.max_lora_rank)
        self._cache(lora_id, adapter)
        return adapter

    # ---- slots ----
    def assign(self, lora_ids) -> tuple[dict[int, int], list[tuple[int, dict]]]:
        """Host half of a step's slots (ModelRunner.prepare): lora_int_id -> slot for the step's adapters (at most
        max_loras: the scheduler's limit), putting the ones not in a slot over the least recently used slots the
        step does not need; and the writes that takes, for write() (ModelRunner.launch): (slot, its host arrays)."""
        need = [i for i in dict.fromkeys(lora_ids) if i]
        if len(need) > self.num_slots:
            raise RuntimeError(f"A step needs {len(need)} adapters, more than max_loras ({self.num_slots}).")
        out, loads = {}, []
        missing = []
        for i in need:
            if i in self._slot_of:
                self._slot_of.move_to_end(i)
                out[i] = self._slot_of[i]
            else:
                missing.append(i)
        if missing:
            used = set(self._slot_of.values())
            free = [s for s in range(self.num_slots) if s not in used]
            for i in missing:
                if free:
                    slot = free.pop(0)
                else:  # the least recently used adapter this step does not need
                    victim = next(j for j in self._slot_of if j not in out)
                    slot = self._slot_of.pop(victim)
                loads.append((slot, self._slot_values(self._host_adapter(i))))
                self._slot_of[i] = out[i] = slot
        return out, loads

    def write(self, loads: list[tuple[int, dict]]) -> None:
        """Device half: writes assign()'s adapters into their slots. Dispatched after the steps already in flight
        (the device runs them in order), so a step still reading a slot's old adapter finishes first."""
        for slot, host in loads:
            self._load_slot(slot, host)

    def activate(self, lora_ids) -> dict[int, int]:
        """assign() and write() at once (tests, tools): lora_int_id -> slot."""
        out, loads = self.assign(lora_ids)
        self.write(loads)
        return out

    def _load_slot(self, slot: int, host) -> None:
        new = jax.device_put(host, self._slot_shardings)
        if self.absorbed:  # the same per-slot arrays, under the fused layers' keys
            fused = lambda k: f"{k}_fused" if k in ops.FUSED_KINDS else k  # noqa: E731
            new = dict(new, layers=[{fused(k): v for k, v in layer.items()} for layer in new["layers"]])
        self.arrays = self._write(self.arrays, jnp.int32(slot), new)
        self.num_swaps += 1

    def _slot_values(self, adapter: LoRAAdapter):
        """One slot's arrays on the host, in the slot dtype and ops.py's layouts without the slot axis: the adapter's
        modules (peft.py's layouts) rank-padded, zeros elsewhere."""
        R = self.config.max_lora_rank
        kv_repeat = kv_heads_for(self.model.num_kv_heads, mesh_tp(self.mesh)) // self.model.num_kv_heads

        def values(key, spec_a, spec_b):
            ab = adapter.modules.get(key)
            if ab is None:
                return tuple(np.zeros(_without_slot_shape(s), self.dtype) for s in (spec_a, spec_b))
            a, b = ab
            r = a.shape[-1]
            a = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, R - r)])
            b = np.pad(b, [(0, R - r)] + [(0, 0)] * (b.ndim - 1))
            if key[-1] == "qkv":  # [R, K, G + 2, H]: kv heads stored repeated when tp > K, as the base weights
                b = ParamSpec(b.shape, (None, "kv_heads", "qkv", "head_dim"), kv_repeat=kv_repeat).expand(b)
                if len(spec_b.shape) == 6:  # block-diagonal [3, R, K, G + 2, H]: part p's rows, its columns only
                    parts = np.asarray(ops.qkv_parts(b.shape[2] - 2))
                    b = b[None] * (parts == np.arange(3)[:, None])[:, None, None, :, None]
                else:  # per column: the column of a kv head leads, [G + 2, R, K, H]
                    b = np.moveaxis(b, 2, 0)
            elif key[-1] == "gate_up":
                b = np.moveaxis(b, 1, 0)  # [2, R, F]
            return a.astype(self.dtype), np.ascontiguousarray(b, self.dtype)

        return {
            "layers": [
                {k: values(("layers", i, k), *layer[k]) for k in LAYER_KEYS}
                for i, layer in enumerate(self.specs["layers"])
            ],
            "embed": values(("embed",), *self.specs["embed"]),
            "lm_head": values(("lm_head",), *self.specs["lm_head"]),
        }

    def warm_up(self) -> None:
        """Compiles the slot write (zeros into slot 0, which holds nothing yet) so the first swap does not wait."""
        self._load_slot(0, self._slot_values(LoRAAdapter("", 0)))
        self.num_swaps = 0


def _write_slot(arrays, slot, new, where):
    def put(a, n, w: _Where):
        n = n.astype(a.dtype)
        if w.how == "axis":
            return jax.lax.dynamic_update_index_in_dim(a, n, slot, w.axis)
        start = w.offset + slot * w.width
        if w.how == "cols":  # [D, base | S * width]
            return jax.lax.dynamic_update_slice(a, n.reshape(a.shape[0], w.width), (jnp.int32(0), start))
        return jax.lax.dynamic_update_slice(a, n.reshape(w.width, a.shape[1]), (start, jnp.int32(0)))

    return jax.tree.map(put, arrays, new, where)
