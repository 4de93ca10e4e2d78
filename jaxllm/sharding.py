"""Device mesh and the one table that maps logical axis names to mesh axes.

Every parameter and cache array is declared with logical axes (see jaxllm/models/params.py); the table
below is the only place that says how they are split. Mesh axes: ("pp", "tp").
"""

from __future__ import annotations

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
    "head_dim": None,
    "ffn": "tp",
    "layers": "pp",
    "pages": None,
    "page_slots": None,
}


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def make_mesh(self, devices=None) -> Mesh:
        devices = list(jax.devices() if devices is None else devices)
        if self.world_size > len(devices):
            raise ValueError(
                f"tensor_parallel_size * pipeline_parallel_size = {self.world_size} exceeds the "
                f"{len(devices)} available devices."
            )
        grid = np.array(devices[: self.world_size]).reshape(
            self.pipeline_parallel_size, self.tensor_parallel_size
        )
        return Mesh(grid, ("pp", "tp"))


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
