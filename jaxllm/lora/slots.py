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
"""

from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict

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
        self._slot_axes = jax.tree.map(_slot_axis, self.specs, is_leaf=_is_spec)
        self.arrays = jax.tree.map(
            lambda s, sh: jax.jit(lambda: jnp.zeros(s.shape, self.dtype), out_shardings=sh)(),
            self.specs,
            self.shardings,
            is_leaf=_is_spec,
        )
        self._write = jax.jit(functools.partial(_write_slot, axes=self._slot_axes), donate_argnums=(0,))
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
        """The slot arrays as shape / dtype / sharding specs (lowering the step without them)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.arrays)

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


def _write_slot(arrays, slot, new, axes):
    return jax.tree.map(
        lambda a, n, axis: jax.lax.dynamic_update_index_in_dim(a, n.astype(a.dtype), slot, axis), arrays, new, axes
    )
