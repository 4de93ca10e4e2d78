"""A data-parallel replica in its own process (jaxllm/engine/dp.py says why): the child's loop, and the parent's
handle on it (ReplicaProcess).

The child (multiprocessing's 'spawn' start method: a fresh interpreter, never a fork of a process where jax may
already run) sees only its device group: CUDA_VISIBLE_DEVICES on GPUs, W simulated devices on CPU, set in its
environment before it imports jax. It builds one LLMEngine, reports "ready" (what the parent's front end needs
from the engine) or its start-up exception, then loops: the parent's commands between steps, one step while it
has work, each step's RequestOutputs (and failures) back in one message, with a stats snapshot at most every
STATS_EVERY_S and whenever it falls idle.

The channel is a multiprocessing Pipe: a socket pair carrying pickled tuples, in the standard library. The
parent's side has a sender thread (a send never blocks a front end while the child is mid-step and its pipe
buffer is full) and a reader thread (which blocks in recv, no polling, and hands each message to the front end's
sink). The child's end reaching EOF means the child is gone: its requests fail with an error naming it. The child
ignores SIGINT (Ctrl-C reaches the whole process group; the parent decides how to stop) and exits when the
parent is gone (EOF on its pipe between steps; a thread watching its parent process id, mid-compile).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import replace

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.profiling import Trace
from jaxllm.engine.protocol import EngineDeadError, EngineStats

logger = logging.getLogger(__name__)

STATS_EVERY_S = 0.2  # a busy child's stats snapshots (the metrics' gauges) are at most this old
IDLE_POLL_S = 1.0  # an idle child's wait for a command (EOF wakes it at once)
# what the parent may call in a child: the engine's LoRA methods, and jax's profiler
CALLS = frozenset(("add_lora", "remove_lora", "list_loras", "start_profile", "stop_profile"))
_ENV_LOCK = threading.Lock()  # os.environ is patched while a child is spawned (it inherits it then)


# ---- device groups --------------------------------------------------------------------------------------------------
def replica_env(args: EngineArgs, replica: int) -> dict[str, str]:
    """The environment that gives replica r its device group: devices [r * W, (r + 1) * W) of this host's (W = tp *
    pp). On CPU (JAX_PLATFORMS=cpu, or no CUDA driver) each child simulates its own W devices."""
    width = args.tensor_parallel_size * args.pipeline_parallel_size
    gpus = None if _cpu_platform() else _visible_gpus()
    if gpus is None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).split()
        return dict(
            JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={width}"])
        )
    if args.data_parallel_size * width > len(gpus):
        raise ValueError(
            f"data_parallel_size * tensor_parallel_size * pipeline_parallel_size = {args.data_parallel_size} * "
            f"{args.tensor_parallel_size} * {args.pipeline_parallel_size} exceeds the {len(gpus)} GPUs of this host."
        )
    return dict(CUDA_VISIBLE_DEVICES=",".join(gpus[replica * width : (replica + 1) * width]))


def _cpu_platform() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    jax = sys.modules.get("jax")
    if not platforms and jax is not None:  # jax.config.update("jax_platforms", ...) before the engine
        platforms = jax.config.jax_platforms or ""
    names = {p.strip().lower() for p in platforms.split(",") if p.strip()}
    return bool(names) and names <= {"cpu"}


def _visible_gpus() -> list[str] | None:
    """This process's GPUs, as CUDA_VISIBLE_DEVICES names them for a child (indices or UUIDs), from the driver
    without starting jax here (it would take the GPUs' memory from the replicas); None without a GPU."""
    import ctypes

    from jaxllm.engine.device_memory import _libcuda

    cuda, count = _libcuda(), ctypes.c_int()
    if cuda is None or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(count.value)]
    return names[: count.value]


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def check_single_process() -> None:
    """Replicas are processes of this host; a multi-process (jax.distributed) engine is another layout."""
    jax = sys.modules.get("jax")
    joined = jax is not None and jax.distributed.is_initialized()
    if joined or int(os.environ.get("JAX_NUM_PROCESSES") or 1) > 1:
        raise ValueError(
            "data_parallel_size > 1 runs replicas on the devices of one host; it cannot be combined "
            "with several processes (--num-processes)."
        )


# ---- the parent's side --------------------------------------------------------------------------------------------
class ReplicaProcess:
    """Replica `index` in its child process. sink(kind, payload) gets, on the reader thread: ("step", (outputs,
    failures)) per step message and ("dead", message) once if the child goes away; calls' results come back as
    futures (call)."""

    def __init__(self, args: EngineArgs, index: int):
        self.index = index
        self.env = replica_env(args, index)
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        child_args = replace(args, data_parallel_size=1)
        self.process = ctx.Process(
            target=replica_main,
            args=(child, child_args, index, logging.getLogger().getEffectiveLevel()),
            name=f"jaxllm-dp{index}",
            daemon=True,  # multiprocessing terminates it when this process exits
        )
        with _environ(self.env):
            self.process.start()
        child.close()  # only the child holds its end: its exit is EOF here
        self.info: dict = {}
        self.dead: str | None = None
        self._stats, self._iteration_tokens = EngineStats(), []
        self._stats_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._outbox: queue.Queue = queue.Queue()
        self._sink = None
        self.closing = False
        # Held while waiting for the child (close() and the reader thread): two threads in waitpid on one pid race,
        # and the one that loses gets ECHILD, which multiprocessing takes for a child still running (is_alive()
        # True after close() had returned, seen once in test_data_parallel under load).
        self._reap_lock = threading.Lock()

    # ---- start-up
    def wait_ready(self) -> dict:
        """Blocks until the child's engine is built; raises its start-up exception (with the child's traceback as
        a note), or an error naming the child if it exited without one (killed: out of memory?)."""
        while True:
            if self.conn.poll(1.0):
                try:
                    kind, payload = self.conn.recv()
                except (EOFError, OSError):
                    break
                if kind == "ready":
                    self.info = payload
                    return payload
                error, tb = payload
                error.add_note(f"In data-parallel replica {self.index} (pid {self.process.pid}):\n{tb}")
                raise error
            if not self.process.is_alive():
                break
        raise RuntimeError(f"{self._gone_message()} during start-up (its log above says why).")

    def start_io(self, sink) -> None:
        self._sink = sink
        for target, name in ((self._read, "reader"), (self._send, "sender")):
            threading.Thread(target=target, name=f"jaxllm-dp{self.index}-{name}", daemon=True).start()

    # ---- to the child
    def send(self, *command) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._outbox.put(command)

    def call(self, method: str, *args) -> concurrent.futures.Future:
        """method(*args) on the child's engine, between its steps: a future of its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        try:
            self.send("call", call_id, method, args)
        except EngineDeadError as e:
            self._calls.pop(call_id, None)
            fut.set_exception(e)
        if self.dead is not None:  # it died while this was being queued: nobody will answer
            self._fail_calls()
        return fut

    def call_sync(self, method: str, *args, timeout: float | None = None):
        return self.call(method, *args).result(timeout)

    def stats(self) -> EngineStats:
        """The child's last snapshot, with every step's token count since the previous call (never blocks)."""
        with self._stats_lock:
            s, self._iteration_tokens = replace(self._stats, iteration_tokens=self._iteration_tokens), []
        return s

    def close(self, timeout: float = 10.0) -> None:
        """Stops the child: asks it to exit, then terminates (and kills) it if it does not. A second caller waits
        for the first: when close() returns, the child is gone."""
        with self._reap_lock:
            if self.closing:
                return
            self.closing = True
            if self.process.is_alive() and self.dead is None:
                self._outbox.put(("shutdown",))
                if self._sink is None:  # no sender thread yet
                    with contextlib.suppress(OSError):
                        self.conn.send(("shutdown",))
                self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
            if self.process.is_alive():  # SIGKILL cannot be refused: wait for it, so no replica outlives close()
                self.process.kill()
                self.process.join()
            self._outbox.put(None)
            with contextlib.suppress(OSError):
                self.conn.close()

    # ---- threads
    def _send(self) -> None:
        while True:
            command = self._outbox.get()
            if command is None:
                return
            try:
                data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001 - this command cannot cross; the others go on
                self._refuse(command, ValueError(f"Cannot send this {command[0]} to a data-parallel replica: {e}"))
                continue
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):  # the child is gone: the reader says so
                return

    def _refuse(self, command, error: Exception) -> None:
        if command[0] == "add":
            self._sink("step", ([], {command[1]: error}))
        elif command[0] == "call":
            fut = self._calls.pop(command[1], None)
            if fut is not None:
                fut.set_exception(error)

    def _read(self) -> None:
        while True:
            try:
                kind, payload = self.conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - an unreadable message: the channel cannot be trusted any more
                logger.exception("Data-parallel replica %d sent an unreadable message", self.index)
                break
            if kind == "step":
                outputs, failures, stats = payload
                if stats is not None:
                    with self._stats_lock:
                        self._stats = stats
                        self._iteration_tokens += stats.iteration_tokens
                        del self._iteration_tokens[:-4096]  # bounded: offline runs never read it
                self._sink("step", (outputs, failures))
            elif kind == "reply":
                call_id, ok, value = payload
                fut = self._calls.pop(call_id, None)
                if fut is not None:
                    fut.set_result(value) if ok else fut.set_exception(value)
        with self._reap_lock:
            self.process.join(5)
        self.dead = "The engine is shut down." if self.closing else f"{self._gone_message()}: its requests are lost."
        if not self.closing:
            logger.error("%s", self.dead)
        self._outbox.put(None)
        self._fail_calls()
        self._sink("dead", self.dead)

    def _fail_calls(self) -> None:
        for call_id in list(self._calls):
            fut = self._calls.pop(call_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(EngineDeadError(self.dead))

    def _gone_message(self) -> str:
        code = self.process.exitcode
        how = "is gone"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how = f"was killed by {signal.Signals(-code).name}"
        elif code is not None:
            how = f"exited with code {code}"
        return f"Data-parallel replica {self.index} (process {self.process.pid}) {how}"


# ---- the child ------------------------------------------------------------------------------------------------------
def replica_main(conn, args: EngineArgs, index: int, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="jaxllm-parent-watch", daemon=True).start()
    logging.basicConfig(
        level=log_level,
        format=f"%(levelname)s %(asctime)s [dp{index}] [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    try:
        engine = _build(args)
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        with contextlib.suppress(OSError):
            conn.send(("failed", (_portable(e), traceback.format_exc())))
        raise SystemExit(1) from None
    conn.send(("ready", _info(engine)))
    try:
        _serve(conn, engine)
    except (EOFError, OSError):  # the parent is gone
        pass


def _build(args: EngineArgs):
    from jaxllm.engine.device_memory import request_device_memory

    # before jax starts its backend below (the allocator and its memory fraction are read then)
    request_device_memory(args.gpu_memory_utilization, args.pipeline_parallel_size, args.tensor_parallel_size)
    import jax

    from jaxllm.engine.llm_engine import LLMEngine

    width = args.tensor_parallel_size * args.pipeline_parallel_size
    if len(jax.local_devices()) < width:
        raise ValueError(
            f"A data-parallel replica needs tensor_parallel_size * pipeline_parallel_size = {width} devices; its "
            f"group has {len(jax.local_devices())} ({jax.local_devices()})."
        )
    return LLMEngine(args)


def _info(engine) -> dict:
    import jax

    devices = list(engine.runner.mesh.devices.flat)
    return dict(
        pid=os.getpid(),
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        max_logprobs=engine.max_logprobs,
        cache_config_info=engine.cache_config_info(),
        devices=[str(d) for d in devices],
        device_kind=devices[0].device_kind,
        backend=jax.default_backend(),
        jax=jax.__version__,
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def _serve(conn, engine) -> None:
    """Commands between steps; a step while there is work; each step's outputs back."""
    failures: dict = {}
    last_stats, dirty = 0.0, False
    profiling = Trace()
    while True:
        if not engine.has_unfinished_requests() and not failures:
            conn.poll(IDLE_POLL_S)
        while conn.poll(0):
            command = conn.recv()
            if command[0] == "shutdown":
                return
            dirty = True
            _run_command(conn, engine, command, failures, profiling)
        outputs = []
        if engine.has_unfinished_requests():
            outputs = engine.step()
            dirty = True
        failures.update(engine.pop_failures())
        now = time.monotonic()
        idle = not engine.has_unfinished_requests()
        stats = None
        if dirty and (idle or now - last_stats >= STATS_EVERY_S):
            stats, last_stats, dirty = engine.stats(), now, False
        if outputs or failures or stats is not None:
            conn.send(("step", (outputs, {k: _portable(e) for k, e in failures.items()}, stats)))
            failures = {}


def _run_command(conn, engine, command, failures: dict, profiling: Trace) -> None:
    kind = command[0]
    if kind == "add":
        _, request_id, prompt, params, arrival_time, priority, lora_request = command
        try:
            engine.add_request(request_id, prompt, params, arrival_time, priority, lora_request=lora_request)
        except Exception as e:  # noqa: BLE001 - bad input fails this request only
            failures[request_id] = e
    elif kind == "abort":
        engine.abort_request(command[1])
    elif kind == "call":
        _, call_id, method, args = command
        try:
            if method not in CALLS:
                raise ValueError(f"Not a replica call: {method!r}")
            result = _profile(method, args, profiling) if "profile" in method else getattr(engine, method)(*args)
        except Exception as e:  # noqa: BLE001 - the caller gets it; the engine goes on
            conn.send(("reply", (call_id, False, _portable(e))))
        else:
            conn.send(("reply", (call_id, True, result)))


def _profile(method: str, args, trace: Trace) -> None:
    """jax's profiler traces this whole process: the replica's host work and its devices."""
    if method == "start_profile":
        trace.start(*args)
    else:
        trace.stop()


def _portable(e: BaseException) -> BaseException:
    """e itself if it crosses the pipe intact, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(e).__name__}: {e}")


def _exit_with_parent(parent: int) -> None:
    """An orphaned replica would hold its devices: exit once the parent process is gone (PR_SET_PDEATHSIG would
    fire when the parent's thread that spawned this one ends, which is not the parent's end)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
