"""Multi-host start-up: jax.distributed.initialize from command-line flags, falling back to jax's own
environment variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID). It must run before
anything touches a jax backend; afterwards jax.devices() lists every host's devices and a ParallelConfig
mesh spans them (tp inside a host, pp across hosts: sharding.ParallelConfig.make_mesh).

    python -m jaxllm.serve MODEL -tp 4 -pp 2 --coordinator-address 10.0.0.1:1234 --num-processes 2 --process-id 0

Two things jax.distributed leaves to us:
  - Joining. jax's client waits for every process and then aborts (LOG(FATAL)) without saying which one never
    came. So before it, the processes join through a one-line handshake on the coordinator's port (process 0
    listens there until all have joined, then hands the port to jax's coordination service): a process that does
    not join within --distributed-timeout fails start-up on every process with its id in the message.
  - Losing a process. By default jax's coordination service aborts every process when one stops sending
    heartbeats. We run it recoverable and watch the live processes ourselves (Watchdog): an engine then fails its
    requests with an error that names the lost process and exits non-zero, instead of dying mid-response (and,
    on GPUs, instead of waiting forever in a collective whose peer is gone).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

ENV = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}
DEFAULT_TIMEOUT_S = 300.0  # jax.distributed's own initialization_timeout
DEFAULT_COORDINATOR = "127.0.0.1:29500"  # vLLM's --master-addr default, torch's default port
# A process that sends no heartbeat for this long is lost. The coordination service's live-process query (the
# Watchdog's) answers only once a dead process's heartbeats have timed out: jax's default, 100 s, kept a server
# with a killed worker up that long. Heartbeats come from a C++ thread, so a busy Python process still sends them.
HEARTBEAT_TIMEOUT_S = 10


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-host (jax.distributed)")
    g.add_argument(
        "--coordinator-address",
        default=None,
        help="host:port of process 0's coordinator (env JAX_COORDINATOR_ADDRESS). Unset: one host.",
    )
    g.add_argument("--num-processes", type=int, default=None, help="Processes in all (env JAX_NUM_PROCESSES).")
    g.add_argument("--process-id", type=int, default=None, help="This process's rank (env JAX_PROCESS_ID).")
    g.add_argument(
        "--distributed-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="Seconds every process waits for the others to join; past it start-up fails, naming the "
        "processes that did not join.",
    )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids=None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> bool:
    """Joins the jax.distributed cluster if a coordinator or several processes are given (arguments or environment;
    several processes without an address meet at DEFAULT_COORDINATOR, this host's loopback). Returns whether it
    did. Single-process runs (nothing given) do nothing; so does a second call once joined."""
    coordinator_address = coordinator_address or os.environ.get(ENV["coordinator_address"])
    num_processes = num_processes if num_processes is not None else env_int(ENV["num_processes"])
    if not coordinator_address:
        if (num_processes or 1) <= 1:
            return False
        # several processes and no address: this host's loopback, as vLLM's --master-addr defaults to 127.0.0.1
        coordinator_address = DEFAULT_COORDINATOR
        logger.info(
            "%d processes and no --coordinator-address / --master-addr: they meet at %s (this host only)",
            num_processes,
            coordinator_address,
        )
    process_id = process_id if process_id is not None else env_int(ENV["process_id"])
    if num_processes is None or process_id is None:
        raise ValueError(
            "--coordinator-address needs --num-processes and --process-id (or JAX_NUM_PROCESSES / JAX_PROCESS_ID)."
        )
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}.")
    if not timeout > 0:
        raise ValueError(f"--distributed-timeout must be positive, got {timeout}.")
    import jax

    if jax.distributed.is_initialized():
        return True
    if num_processes > 1:
        join(coordinator_address, num_processes, process_id, timeout)
        if _cpu_only():
            # CPU "hosts" (tests, CPU clusters) need a cross-process collectives backend.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:  # losing a process is handled by the Watchdog below, not by aborting every process
            jax.config.update("jax_enable_recoverability", True)
        except (AttributeError, KeyError):  # a jax without the option keeps its default
            logger.warning("This jax cannot run jax.distributed recoverable: a lost process aborts the others")
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=max(int(timeout), 1),
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )
    if num_processes > 1:
        atexit.register(shutdown, timeout)
    logger.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def shutdown(timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Leaves the cluster together with the other processes (at exit, or call it; use it instead of
    jax.distributed.shutdown). Recoverable jax.distributed does not synchronize its shutdown, and a process whose
    coordinator (process 0) has gone aborts when it disconnects: so every process waits for the others here, and
    process 0 lets them disconnect before its coordination service stops. Nothing without a cluster."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    try:
        client.wait_at_barrier("jaxllm_exit", int(timeout * 1000))
        if distributed.global_state.process_id == 0 and hasattr(client, "get_live_nodes"):
            everyone = list(range(distributed.global_state.num_processes))
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and len(client.get_live_nodes(everyone)) > 1:
                time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 - leaving anyway
        logger.warning("Leaving the jax.distributed cluster without the others: %s", e)
    jax_shutdown = getattr(sys.modules.get("jax"), "distributed", None)
    if jax_shutdown is not None:
        jax_shutdown.shutdown()


def maybe_initialize(args: argparse.Namespace) -> bool:
    return initialize(
        getattr(args, "coordinator_address", None),
        getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        timeout=getattr(args, "distributed_timeout", None) or DEFAULT_TIMEOUT_S,
    )


def env_int(var: str) -> int | None:
    """The integer in environment variable var, None when unset or empty; ValueError naming var otherwise."""
    v = os.environ.get(var)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{var}={v!r} is not an integer.") from None


def _cpu_only() -> bool:
    return os.environ.get("JAX_PLATFORMS", "").strip() == "cpu"


# ---------------------------------------------------------------------------------------------------- joining


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator-address must be HOST:PORT, got {address!r}.")
    return host.strip("[]"), int(port)


def join(address: str, num_processes: int, process_id: int, timeout: float) -> None:
    """Waits until all num_processes processes are up, on the coordinator's port, before jax.distributed takes it
    over: process 0 collects a hello from each other process and answers all of them once every one has come
    (or, at timeout, tells them who is missing); the others retry connecting until process 0 listens. Raises
    RuntimeError naming what is missing or inconsistent."""
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout
    if process_id == 0:
        _collect_joins(port, num_processes, deadline, address, timeout)
    else:
        _send_join(host, port, num_processes, process_id, deadline, address, timeout)


def _collect_joins(port: int, n: int, deadline: float, address: str, timeout: float) -> None:
    try:
        if socket.has_dualstack_ipv6():
            srv = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            srv = socket.create_server(("", port))
    except OSError as e:
        raise RuntimeError(
            f"Process 0 cannot listen on the coordinator port {port}: {e.strerror or e}. Pick "
            "another port in --coordinator-address."
        ) from None
    joined: dict[int, socket.socket] = {}
    error = None
    try:
        while len(joined) < n - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, n)) - set(joined))
                error = (
                    f"Process{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {n} did not "
                    f"join within {timeout:g} s (--distributed-timeout): start the same command with "
                    f"--process-id {missing[0]} --num-processes {n} --coordinator-address {address} on its "
                    "host, and check that this address and port are reachable from there."
                )
                break
            srv.settimeout(min(left, 1.0))
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            hello = _read_line(conn, deadline)
            pid = hello.get("process_id") if isinstance(hello, dict) else None
            if not isinstance(pid, int) or "jaxllm_join" not in hello:
                conn.close()  # not one of ours (a port scanner, a stale client)
                continue
            problem = None
            if hello.get("num_processes") != n:
                problem = (
                    f"Process {pid} was started with --num-processes {hello.get('num_processes')}, process 0 with {n}."
                )
            elif not 0 < pid < n:
                problem = f"--process-id {pid} is not in [1, {n}) for --num-processes {n}."
            elif pid in joined:
                problem = f"Two processes were started with --process-id {pid}."
            if problem:
                error = problem
                _send_line(conn, {"error": problem})
                conn.close()
                break
            joined[pid] = conn
        for conn in joined.values():
            _send_line(conn, {"error": error} if error else {"ok": True})
    finally:
        for conn in joined.values():
            conn.close()
        srv.close()
    if error:
        raise RuntimeError(error)
    logger.info("All %d processes joined", n)


def _send_join(host: str, port: int, n: int, pid: int, deadline: float, address: str, timeout: float) -> None:
    unreachable = (
        f"Process {pid}: process 0 did not answer at {address} within {timeout:g} s "
        "(--distributed-timeout): start process 0 there (--process-id 0), or check the address and port."
    )
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 2.0), 0.1))
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise RuntimeError(unreachable) from None
            time.sleep(0.25)
    try:
        _send_line(conn, {"jaxllm_join": 1, "process_id": pid, "num_processes": n})
        # process 0 answers when everyone has joined, or at its own deadline: allow for the clocks' offset
        reply = _read_line(conn, deadline + 5.0)
    finally:
        conn.close()
    if not isinstance(reply, dict) or not (reply.get("ok") or reply.get("error")):
        raise RuntimeError(unreachable)
    if reply.get("error"):
        raise RuntimeError(reply["error"])


def _send_line(conn: socket.socket, obj) -> None:
    try:
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass  # the peer is gone: it fails on its own side


def _read_line(conn: socket.socket, deadline: float):
    """One JSON line from conn, or None (closed, timed out, not JSON)."""
    buf = b""
    while b"\n" not in buf and len(buf) < 4096:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    try:
        return json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------- losing a process


class Watchdog:
    """Watches the cluster's live processes (jax.distributed's coordination service) while an engine needs all of
    them: between arm() and disarm() (an offline generate, a worker following steps, a server's life). When one is
    gone, on_lost(message) runs once (the engine fails its requests); if the process is still alive
    `grace_s` later, it exits with status 1 (a step may wait forever in a collective whose peer is gone).

    Outside armed spans nothing happens: processes may end their scripts at different times."""

    def __init__(self, interval_s: float = 0.5, grace_s: float = 10.0):
        import jax

        self.num_processes, self.process_id = jax.process_count(), jax.process_index()
        self.interval_s, self.grace_s = interval_s, grace_s
        self.on_lost: Callable[[str], None] | None = None
        self.lost: str | None = None
        self._lost_event = threading.Event()
        self._armed = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        with self._lock:
            self._armed += 1
            if self._thread is None and self.num_processes > 1 and _live_nodes_supported():
                self._thread = threading.Thread(target=self._run, name="jaxllm-watchdog", daemon=True)
                self._thread.start()
        if self.lost:
            raise RuntimeError(self.lost)

    def disarm(self) -> None:
        with self._lock:
            self._armed = max(self._armed - 1, 0)

    def wait_lost(self, timeout: float) -> str | None:
        """The lost-process message, waiting up to timeout for the verdict (a collective whose peer died fails
        before the coordination service notices); None if every process is still there."""
        if self._thread is None:
            return None
        self._lost_event.wait(timeout)
        return self.lost

    def _run(self) -> None:
        from jax._src import distributed

        everyone = list(range(self.num_processes))
        while self.lost is None:
            time.sleep(self.interval_s)
            if not self._armed:
                continue
            client = distributed.global_state.client
            if client is None:  # jax.distributed was shut down
                return
            try:
                live = set(client.get_live_nodes(everyone))
            except Exception as e:  # noqa: BLE001 - the coordination service itself is gone (process 0 died)
                live, why = {self.process_id}, f" ({type(e).__name__})"
            else:
                why = ""
            missing = [p for p in everyone if p not in live]
            if missing and self._armed:
                self._lose(missing, why)

    def _lose(self, missing: list[int], why: str) -> None:
        who = ", ".join(map(str, missing))
        self.lost = (
            f"Process{'es' if len(missing) > 1 else ''} {who} of {self.num_processes} left the "
            f"jax.distributed cluster{why} (died, was killed or lost its network): this engine runs over "
            "all of them and cannot continue."
        )
        logger.error("%s", self.lost)
        self._lost_event.set()
        try:
            if self.on_lost is not None:
                self.on_lost(self.lost)
        except Exception:  # noqa: BLE001 - exiting below is what matters
            logger.exception("Failing the engine's requests after losing a process failed")
        time.sleep(self.grace_s)
        logger.error("Exiting (status 1): %s", self.lost)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(1)


def _live_nodes_supported() -> bool:
    from jax._src import distributed

    client = distributed.global_state.client
    return client is not None and hasattr(client, "get_live_nodes")


_watchdog: Watchdog | None = None


def watchdog() -> Watchdog:
    """This process's Watchdog (made on first use, after jax.distributed joined)."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog()
    return _watchdog
