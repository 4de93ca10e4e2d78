"""Device mesh and the one table that maps logical axis names to mesh axes.

Every parameter and cache array is declared with logical axes (see jaxllm/models/params.py); the table
below is the only place that says how they are split. Mesh axes: ("pp", "tp").

Tensor parallelism (Megatron layout, expressed only through the table): the fused qkv and gate_up weights
are split on their output axis ("kv_heads", "ffn": column-parallel; each kv head carries its own q heads,
see jaxllm/models/params.py), o and down on their input axis ("heads", "ffn": row-parallel, XLA inserts one
all-reduce after each), embedding and lm_head on "vocab". KV heads are split over tp; when tp > K each kv
head is repeated tp // K times at load (kv_heads_for) so every tp shard owns one whole kv head and its
pages: the KV cache [K', P, S, H] splits on axis 0 the same way.

Mixture-of-experts layers (jaxllm/models/moe.py) split each expert's ffn over tp like a dense MLP, or, with expert
parallelism (vLLM's enable_expert_parallel), whole experts: their weights then carry the "experts" axis instead.

Pipeline parallelism: layers are split into pp contiguous stages (stage_layers); a stage's weights and KV
pages live on its row of the mesh (stage_mesh), a ("pp", "tp") mesh of shape (1, tp). jaxllm/engine/
pipeline.py runs one jitted function per stage and moves hidden states between rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical axis -> mesh axis (None: replicated).
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": "tp",
    "embed": None,
    "heads": "tp",
    "kv_heads": "tp",
    "qkv": None,  # within a kv head of the fused qkv weight: its q heads, then k, then v
    "head_dim": None,
    "ffn": "tp",
    "experts": "tp",  # MoE expert weights with expert parallelism (jaxllm/models/moe.py); without it their ffn
    "layers": "pp",
    "pages": None,
    "page_slots": None,
    # LoRA slot arrays (jaxllm/lora/slots.py): the slots, A's rank (column-parallel) and B's output (row-parallel)
    # stay whole; fully_sharded_loras maps the last two to "tp" (lora_rules)
    "lora_slots": None,
    "lora_a_rank": None,
    "lora_b_out": None,
}


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}.")

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def make_mesh(self, devices=None) -> Mesh:
        """(pp, tp) mesh over tp * pp devices; tp is the minor axis, so a stage's tp group is devices that are
        adjacent (same host, NVLink) in jax.devices() order. On one host: the first tp * pp devices. Over several
        processes (hosts) with devices to spare, the stages are spread evenly over the processes, each on its
        process's first devices (mesh_devices)."""
        devices = list(jax.devices() if devices is None else devices)
        if self.world_size > len(devices):
            raise ValueError(
                f"tensor_parallel_size * pipeline_parallel_size = {self.tensor_parallel_size} * "
                f"{self.pipeline_parallel_size} = {self.world_size} exceeds the {len(devices)} available devices."
            )
        grid = np.array(mesh_devices(devices, self.tensor_parallel_size, self.pipeline_parallel_size)).reshape(
            self.pipeline_parallel_size, self.tensor_parallel_size
        )
        return Mesh(grid, ("pp", "tp"))

    def validate(self, cfg) -> None:
        """Raises ValueError if cfg (a ModelConfig) cannot be split this way."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        checks = [("num_attention_heads", cfg.num_heads), ("vocab_size", cfg.vocab_size)]
        moe = cfg.moe
        if moe is None or moe.dense_layers:
            checks.append(("intermediate_size", cfg.intermediate_size))
        if moe is not None:
            if cfg.expert_parallel:
                checks.append(("the number of experts", moe.num_experts))
            else:  # Mixtral's experts are intermediate_size wide, Qwen's moe_intermediate_size
                name = "intermediate_size" if cfg.architecture == "mixtral" else "moe_intermediate_size"
                checks.append((name, moe.intermediate_size))
            if moe.shared_intermediate_size:
                checks.append(("shared_expert_intermediate_size", moe.shared_intermediate_size))
        for name, n in checks:
            if n % tp:
                raise ValueError(f"{name} ({n}) must be divisible by tensor_parallel_size ({tp}).")
        K = cfg.num_kv_heads
        if K % tp and tp % K:
            raise ValueError(
                f"num_key_value_heads ({K}) must be divisible by tensor_parallel_size ({tp}), or "
                f"tensor_parallel_size a multiple of it (kv heads are then replicated)."
            )
        if pp > cfg.num_layers:
            raise ValueError(f"pipeline_parallel_size ({pp}) exceeds the model's num_hidden_layers ({cfg.num_layers}).")


def mesh_devices(devices: list, tp: int, pp: int) -> list:
    """The tp * pp devices of the mesh, stage by stage. The first tp * pp devices, except over several processes
    with devices to spare, where pp stages spread evenly over the processes (pp a multiple of their number,
    each process's stages fitting its devices): stage s on process s // (pp / processes), so that pp crosses
    hosts and tp stays inside one (2 hosts x 4 GPUs, tp 2 pp 2: devices 0, 1 of each host; not all four of
    host 0)."""
    world = tp * pp
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(getattr(d, "process_index", 0), []).append(d)
    n = len(by_process)
    if n == 1 or world >= len(devices) or pp % n:
        return devices[:world]
    per = pp // n
    if any(per * tp > len(local) for local in by_process.values()):
        return devices[:world]
    return [d for local in by_process.values() for d in local[: per * tp]]


def mesh_tp(mesh: Mesh) -> int:
    return int(mesh.shape.get("tp", 1))


def mesh_pp(mesh: Mesh) -> int:
    return int(mesh.shape.get("pp", 1))


def kv_heads_for(num_kv_heads: int, tp: int) -> int:
    """KV heads as stored on devices: K, or tp when tp > K (each kv head repeated tp // K times, so shard i
    holds the kv head of its q heads: q head n -> kv head n // (N // K) -> copy n // (N // tp))."""
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) is not divisible by tensor_parallel_size ({tp}).")
        return num_kv_heads
    if tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp}) is larger than num_key_value_heads ({num_kv_heads}) but not a "
            f"multiple of it, so kv heads cannot be replicated evenly."
        )
    return tp


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges of the pp stages; earlier stages take the remainder (stage pp-1 also
    computes logits)."""
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp}) exceeds the number of layers ({num_layers}).")
    base, extra = divmod(num_layers, pp)
    out, lo = [], 0
    for s in range(pp):
        n = base + (s < extra)
        out.append(range(lo, lo + n))
        lo += n
    return out


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """Row `stage` of a (pp, tp) mesh, as a (1, tp) mesh with the same axis names."""
    return Mesh(mesh.devices[stage : stage + 1], mesh.axis_names)


def logical_to_spec(axes: tuple[str | None, ...], rules: dict[str, str | None] = LOGICAL_RULES) -> PartitionSpec:
    """PartitionSpec for one array's logical axes; two axes mapped to the same mesh axis raise."""
    mesh_axes = []
    for name in axes:
        if name is not None and name not in rules:
            raise ValueError(f"Unknown logical axis {name!r}; add it to LOGICAL_RULES.")
        mesh_axes.append(None if name is None else rules[name])
    used = [a for a in mesh_axes if a is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"Logical axes {axes} map two dimensions to the same mesh axis: {mesh_axes}.")
    return PartitionSpec(*mesh_axes)


def named_sharding(mesh: Mesh, axes: tuple[str | None, ...], rules=LOGICAL_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules))


KV_CACHE_AXES = ("kv_heads", "pages", "page_slots", "head_dim")  # [K', P, S, H]


def kv_cache_shardings(cfg, mesh: Mesh, rules=LOGICAL_RULES) -> list:
    """Per layer, the NamedSharding of its (k_pages, v_pages): kv heads over tp, on the layer's stage row."""
    stages = stage_layers(cfg.num_layers, mesh_pp(mesh))
    out = []
    for s, layers in enumerate(stages):
        sub = stage_mesh(mesh, s) if mesh_pp(mesh) > 1 else mesh
        out += [named_sharding(sub, KV_CACHE_AXES, rules)] * len(layers)
    return out


def kv_cache_specs(cfg, mesh: Mesh, num_pages: int, page_size: int, dtype=None) -> list:
    """Per layer (k_pages, v_pages) as jax.ShapeDtypeStructs with their shardings: what make_kv_caches
    allocates, for lowering the step programs before (or without) the memory."""
    import jax.numpy as jnp

    dtype = jnp.dtype(cfg.dtype if dtype is None else dtype)
    shape = (kv_heads_for(cfg.num_kv_heads, mesh_tp(mesh)), num_pages, page_size, cfg.head_dim)
    return [(jax.ShapeDtypeStruct(shape, dtype, sharding=sh),) * 2 for sh in kv_cache_shardings(cfg, mesh)]


def remote_array(shape, sharding, dtype):
    """The global array for a sharding with no device in this process (another host's pipeline stage): it
    holds no local data. Made directly, not by a jit: a jit placed only on other processes' devices fails on
    GPUs ("executable expects 0 computations")."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


def make_kv_caches(cfg, mesh: Mesh, num_pages: int, page_size: int, dtype=None, fill=0.0):
    """Per layer (k_pages, v_pages) [K', P, S, H], created sharded (each device allocates its own shard)."""
    import jax.numpy as jnp

    caches, fns = [], {}
    for spec, _ in kv_cache_specs(cfg, mesh, num_pages, page_size, dtype):
        sh = spec.sharding
        if not sh.addressable_devices:  # another process's pipeline stage (see remote_array)
            caches.append((remote_array(spec.shape, sh, spec.dtype), remote_array(spec.shape, sh, spec.dtype)))
            continue
        if sh not in fns:
            full = functools.partial(jnp.full, spec.shape, fill, spec.dtype)
            fns[sh] = jax.jit(lambda full=full: (full(), full()), out_shardings=(sh, sh))
        caches.append(fns[sh]())
    return caches
