"""The server's engine over D data-parallel replica processes (jaxllm/engine/dp.py): DPAsyncLLM routes each request
to a replica; AsyncReplica streams that replica's outputs to the request's iterator.

A replica's reader thread (dp_process.ReplicaProcess) hands each step's outputs to the event loop of the request
they belong to (call_soon_threadsafe), so the loop never waits on a pipe. A replica process that dies fails its
open requests with EngineDeadError naming it and sets fatal_error: the server stops and exits non-zero, as for a
lost process of a multi-process engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.dp import FrontEnd, Router, merge_stats, start_replicas
from jaxllm.engine.dp_process import ReplicaProcess
from jaxllm.engine.protocol import EngineDeadError, EngineStats, PromptType
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams


class AsyncReplica:
    """One replica process as an EngineClient (AsyncLLM's surface, less what DPAsyncLLM answers itself)."""

    def __init__(self, process: ReplicaProcess):
        self.process = process
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # the streams: the event loop adds them, the reader thread delivers
        self.fatal_error: str | None = None
        process.start_io(self._on_message)

    @property
    def errored(self) -> bool:
        return self.fatal_error is not None

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        """Bad input raises the replica's ValueError at the first iteration, before anything is yielded."""
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"Request id {request_id!r} is already in use.")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            self.process.send("add", request_id, prompt, sampling_params, None, priority, lora_request)
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # failed: nothing to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                with contextlib.suppress(EngineDeadError):  # a dead replica has nothing to abort
                    self.process.send("abort", request_id)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        with contextlib.suppress(EngineDeadError):
            self.process.send("abort", request_id)

    async def call(self, method: str, *args):
        return await asyncio.wrap_future(self.process.call(method, *args))

    def stats(self) -> EngineStats:
        return self.process.stats()

    def cache_config_info(self) -> dict[str, str]:
        return self.process.info["cache_config_info"]

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.process.close)

    # ---- the reader thread
    def _on_message(self, kind: str, payload) -> None:
        if kind == "dead":
            if not self.process.closing:
                self.fatal_error = payload
            with self._lock:
                streams, self._streams = self._streams, {}
            for loop, stream in streams.values():
                _put(loop, stream, EngineDeadError(payload))
            return
        outputs, failures = payload
        with self._lock:
            for out in outputs:
                entry = self._streams.get(out.request_id)
                if entry is not None:
                    _put(*entry, out)
            for request_id, error in failures.items():
                entry = self._streams.get(request_id)
                if entry is not None:
                    _put(*entry, error)


def _put(loop: asyncio.AbstractEventLoop, stream: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(stream.put_nowait, item)
    except RuntimeError:  # that request's event loop is closed: nobody listens
        pass


class DPAsyncLLM:
    """The server's EngineClient over D replica processes."""

    def __init__(self, replicas: list[AsyncReplica], front: FrontEnd, block_size: int):
        self.replicas, self.front = replicas, front
        self.model_name, self.max_model_len = front.model_name, front.max_model_len
        self.vocab_size, self.max_logprobs = front.vocab_size, front.max_logprobs
        self.router = Router(len(replicas), block_size)
        self._profiling = False

    @classmethod
    def from_engine_args(cls, **kwargs) -> DPAsyncLLM:
        kwargs.setdefault("server_mode", True)
        args = EngineArgs.from_kwargs(**kwargs)
        processes, front = start_replicas(args)
        return cls([AsyncReplica(p) for p in processes], front, args.block_size)

    @property
    def num_engines(self) -> int:
        return len(self.replicas)

    def get_tokenizer(self):
        return self.front.tokenizer

    def default_sampling_params(self) -> dict:
        return dict(self.front.generation_defaults)

    @property
    def is_running(self) -> bool:
        return not self.errored and all(r.process.dead is None for r in self.replicas)

    @property
    def errored(self) -> bool:
        return any(r.errored for r in self.replicas)

    @property
    def fatal_error(self) -> str | None:
        """A replica process is gone: the server stops serving and exits non-zero (server/serve.py)."""
        return next((r.fatal_error for r in self.replicas if r.fatal_error), None)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        if self.fatal_error:
            raise EngineDeadError(self.fatal_error)
        n = sampling_params.n
        r = self.router.route(request_id, prompt, n, lora_request)
        try:
            async for out in self.replicas[r].generate(
                prompt, sampling_params, request_id, priority=priority, lora_request=lora_request
            ):
                yield out
        finally:
            self.router.done(r, n)

    async def abort(self, request_id: str) -> None:
        await self.replicas[self.router.replica_of(request_id)].abort(request_id)

    async def add_lora(self, lora_request) -> bool:
        return all(await asyncio.gather(*(r.call("add_lora", lora_request) for r in self.replicas)))

    async def remove_lora(self, lora_id: int) -> bool:
        return all(await asyncio.gather(*(r.call("remove_lora", lora_id) for r in self.replicas)))

    async def list_loras(self) -> set[int]:
        return await self.replicas[0].call("list_loras")

    def engine_index(self, request_id: str) -> int:
        """The replica that serves (or served) request_id: the metrics' engine label."""
        return self.router.replica_of(request_id)

    def stats(self) -> EngineStats:
        return merge_stats(self.stats_per_engine())

    def stats_per_engine(self) -> list[EngineStats]:
        return [r.stats() for r in self.replicas]

    def cache_config_info(self) -> dict[str, str]:
        return self.replicas[0].cache_config_info()

    def cache_config_info_per_engine(self) -> list[dict[str, str]]:
        """vllm:cache_config_info's labels per replica (each sized its own KV cache)."""
        return [r.cache_config_info() for r in self.replicas]

    async def start_profile(self, log_dir: str) -> None:
        """Each replica process traces itself (jax's profiler), into log_dir/dp<r>."""
        if self._profiling:
            raise RuntimeError("A profile is already running.")
        self._profiling = True
        try:
            await asyncio.gather(
                *(r.call("start_profile", os.path.join(log_dir, f"dp{i}")) for i, r in enumerate(self.replicas))
            )
        except BaseException:
            self._profiling = False
            raise

    async def stop_profile(self) -> None:
        if not self._profiling:
            raise RuntimeError("No profile is running.")
        self._profiling = False
        await asyncio.gather(*(r.call("stop_profile") for r in self.replicas))

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas))
