"""Multi-host start-up: jax.distributed.initialize from command-line flags, falling back to jax's own
environment variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID). It must run before
anything touches a jax backend; afterwards jax.devices() lists every host's devices and a ParallelConfig
mesh spans them (tp inside a host, pp across hosts is the usual layout: mesh rows are consecutive devices).

    python -m jaxllm.convert ... --coordinator-address 10.0.0.1:1234 --num-processes 2 --process-id 0
"""

from __future__ import annotations

import argparse
import logging
import os

logger = logging.getLogger(__name__)

ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--coordinator-address", default=None,
                   help="host:port of process 0's coordinator (env JAX_COORDINATOR_ADDRESS). Unset: one host.")
    g.add_argument("--num-processes", type=int, default=None, help="Processes in all (env JAX_NUM_PROCESSES).")
    g.add_argument("--process-id", type=int, default=None, help="This process's rank (env JAX_PROCESS_ID).")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None) -> bool:
    """Joins the jax.distributed cluster if a coordinator is given (argument or environment). Returns
    whether it did. Single-host runs (nothing given) do nothing."""
    coordinator_address = coordinator_address or os.environ.get(ENV["coordinator_address"])
    if not coordinator_address:
        return False
    num_processes = num_processes if num_processes is not None else _env_int("num_processes")
    process_id = process_id if process_id is not None else _env_int("process_id")
    if num_processes is None or process_id is None:
        raise ValueError("--coordinator-address needs --num-processes and --process-id "
                         "(or JAX_NUM_PROCESSES / JAX_PROCESS_ID).")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}.")
    import jax

    if num_processes > 1 and _cpu_only():
        # CPU "hosts" (tests, CPU clusters) need a cross-process collectives backend.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids=local_device_ids)
    logger.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
                jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def maybe_initialize(args: argparse.Namespace) -> bool:
    return initialize(getattr(args, "coordinator_address", None), getattr(args, "num_processes", None),
                      getattr(args, "process_id", None))


def _env_int(name: str) -> int | None:
    v = os.environ.get(ENV[name])
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{ENV[name]}={v!r} is not an integer.") from None


def _cpu_only() -> bool:
    return os.environ.get("JAX_PLATFORMS", "").strip() == "cpu"
