"""AsyncLLM: the engine behind an asyncio front end (EngineClient in jaxllm/engine/protocol.py).

The LLMEngine runs in one background thread, so device steps and host bookkeeping never block the event
loop. Front ends talk to it through a command queue (add, abort); outputs come back to each request's
asyncio.Queue through loop.call_soon_threadsafe. If a step raises, the engine is dead: every open request
gets EngineDeadError and /health reports it. Once the loop has ended (died or shut down), adds still queued and
any later generate() fail at once instead of waiting for a loop that will never read them.

Over several processes (multihost.py) this is process 0's engine: its steps go to the other processes, an idle
loop sends them heartbeats, shutting down tells them to exit, and losing one of them (jaxllm.distributed's
Watchdog) fails every request with an error naming it and sets `fatal_error`, on which the server exits.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from jaxllm.beam_search import BeamSearch
from jaxllm.distributed import HEARTBEAT_TIMEOUT_S
from jaxllm.engine.args import EngineArgs
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.profiling import Trace
from jaxllm.engine.protocol import EngineDeadError, EngineStats, PromptType
from jaxllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class _Joined:
    """shutdown()'s result: awaiting it joins the engine thread in an executor (up to 10 s); not awaiting it is
    fine too (the loop ends on its own)."""

    def __init__(self, thread: threading.Thread):
        self.thread = thread

    def __await__(self):
        return asyncio.get_running_loop().run_in_executor(None, self.thread.join, 10).__await__()


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.model_name = engine.model_name or "demo"
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.max_logprobs = engine.max_logprobs
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: BaseException | None = None
        self._stopped = False
        self._closed: str | None = None  # set when the loop has ended: why new requests fail
        self._close_lock = threading.Lock()  # orders "check closed + queue an add" against closing
        self._trace = Trace()
        self.fatal_error: str | None = None  # the engine cannot go on (a process of a multi-process engine is lost)
        self._multihost = engine.runner.multihost
        if self._multihost is not None:
            self._multihost.watchdog.on_lost = self._lost
            self._multihost.watchdog.arm()
        self._thread = threading.Thread(target=self._loop, name="jaxllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs | None = None, **kwargs) -> AsyncLLM:
        """AsyncLLM over an LLMEngine of engine_args (vLLM's call), or of LLM()-style keywords (server defaults)."""
        if engine_args is not None:
            return cls(LLMEngine(engine_args))
        kwargs.setdefault("server_mode", True)
        return cls(LLMEngine(EngineArgs.from_kwargs(**kwargs)))

    # ---- EngineClient ----
    @property
    def pooler(self):
        """An embedding (pooling) model's PoolerConfig (it takes PoolingParams requests), else None."""
        return self.engine.pooler

    def get_tokenizer(self):
        return self.engine.tokenizer

    def default_sampling_params(self) -> dict:
        """generation_config.json's sampling defaults, as a dict of SamplingParams fields."""
        return dict(self.engine.generation_defaults)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(f"The engine died: {self._dead!r}")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        with self._close_lock:
            if self._closed is not None:
                raise EngineDeadError(self._closed)
            self._commands.put(
                ("add", request_id, prompt, sampling_params, priority, loop, stream, added, lora_request)
            )
        try:
            await added  # raises the engine's ValueError for bad input
        except asyncio.CancelledError:
            if added.done() and not added.cancelled() and added.exception() is None:
                self._commands.put(("abort", request_id))  # added, then cancelled before this resumed
            raise
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def beam_search(
        self, prompt: PromptType, request_id: str, params: BeamSearchParams, *, priority: int = 0, lora_request=None
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's EngineClient.beam_search (the server's use_beam_search): jaxllm/beam_search.py's search, each
        step's beams as concurrent one-token requests; yields one finished RequestOutput whose outputs are the best
        beams, best first, each its generated tokens and text (without a final EOS), as vLLM's."""
        metrics = RequestMetrics(arrival_time=time.time())  # the search's: its first step and its last token
        text, ids = self.engine.tokenize_prompt(prompt)
        self.engine.validate_prompt(ids)
        tok: Any = self.engine.tokenizer  # None with skip_tokenizer_init: token ids only, as LLM.beam_search
        eos = tok.eos_token_id if tok is not None else None
        search = BeamSearch([ids], params, eos_token_id=eos, max_model_len=self.max_model_len)
        sp = search.step_params()
        sp.output_kind = RequestOutputKind.FINAL_ONLY

        async def one(beam, rid: str) -> dict:
            step: Any = None
            async for out in self.generate(
                {"prompt_token_ids": beam.tokens}, sp, rid, priority=priority, lora_request=lora_request
            ):
                step = out.outputs[0].logprobs
            return step[0]

        while batch := search.pending():
            step = search.steps
            if step == 0:
                metrics.first_scheduled_time = time.time()
            search.advance(await asyncio.gather(*[one(b, f"{request_id}-beam{step}-{i}") for i, b in enumerate(batch)]))
            metrics.last_token_time = time.time()
            metrics.first_token_time = metrics.first_token_time or metrics.last_token_time
        outputs = []
        for i, beam in enumerate(search.results()[0].sequences):
            gen = beam.tokens[len(ids) :]
            shown = gen[:-1] if beam.finish_reason == "stop" else gen  # the EOS that ended a beam is not text
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=tok.decode(shown, skip_special_tokens=True) if tok is not None else "",
                    token_ids=gen,
                    cumulative_logprob=beam.cum_logprob,
                    logprobs=beam.logprobs,
                    finish_reason=beam.finish_reason,
                )
            )
        metrics.finished_time = time.time()
        yield RequestOutput(request_id, text, ids, None, outputs, finished=True, metrics=metrics)

    # LoRA adapters: run on the engine thread between steps (reading an adapter's files never blocks the loop)
    async def add_lora(self, lora_request) -> bool:
        return await self._call(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call(self.engine.remove_lora, lora_id)

    async def list_loras(self) -> set[int]:
        return await self._call(self.engine.list_loras)

    # sleep mode and the prefix cache's reset (the server's dev-mode routes): on the engine thread between steps
    async def sleep(self, level: int = 1) -> None:
        await self._call(self.engine.sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(self.engine.wake_up, tags)

    async def is_sleeping(self) -> bool:
        return await self._call(self.engine.is_sleeping)

    async def reset_prefix_cache(self) -> bool:
        await self._call(self.engine.scheduler.block_manager.reset_prefix_cache)
        return True

    async def _call(self, fn, *args):
        """fn(*args) on the engine thread; its result or its exception."""
        if self._dead is not None:
            raise EngineDeadError(f"The engine died: {self._dead!r}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._close_lock:
            if self._closed is not None:
                raise EngineDeadError(self._closed)
            self._commands.put(("call", fn, args, loop, done))
        return await done

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def cache_config_info(self) -> dict[str, str]:
        return self.engine.cache_config_info()

    def start_profile(self, log_dir: str) -> None:
        self._trace.start(log_dir)

    def stop_profile(self) -> None:
        self._trace.stop()

    def shutdown(self) -> _Joined:
        """Stops the engine loop. vLLM's AsyncLLM.shutdown() is a plain call (its examples call it so); the server
        awaits it, which also waits (off the event loop) for the engine thread to end."""
        self._stopped = True
        self._commands.put(("wake",))
        return _Joined(self._thread)

    # ---- engine thread ----
    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopped:
                block = not engine.has_unfinished_requests()
                self._drain(block)
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        self._deliver(out.request_id, out, out.finished)
                    for request_id, error in engine.pop_failures().items():
                        self._deliver(request_id, error, True)
                elif self._multihost is not None:
                    self._multihost.heartbeat()
        except BaseException as e:  # noqa: BLE001 - the engine is dead; tell everyone
            # a collective failed because a process is gone: say that, not the collective's error
            lost = self._multihost.watchdog.wait_lost(HEARTBEAT_TIMEOUT_S + 5) if self._multihost else None
            if lost:
                logger.error("Engine loop stopped: %s", lost)
                self._dead = EngineDeadError(lost)
            else:
                logger.exception("Engine loop died")
                self._dead = e
            if self._multihost is not None:  # the other processes cannot go on alone: neither can the server
                self.fatal_error = str(self._dead)
        finally:
            if self._multihost is not None:
                self._release_workers()
            self._close()

    def _release_workers(self) -> None:
        """Multi-process: tell the other processes to exit (unless one is lost: that ends them anyway)."""
        from jaxllm.engine.multihost import SHUTDOWN

        try:
            if self._dead is None:
                self._multihost.send(SHUTDOWN)
        except Exception:  # noqa: BLE001 - they exit when this process does (their Watchdog)
            logger.exception("Telling the other processes to shut down failed")
        finally:
            self._multihost.watchdog.disarm()

    def _lost(self, message: str) -> None:
        """The Watchdog's thread: a process of this multi-process engine is gone. Every request fails now (the
        loop may be stuck in a collective that never completes) and the server exits (fatal_error)."""
        self.fatal_error = message
        if self._dead is None:
            self._dead = EngineDeadError(message)
        self._stopped = True
        self._close()

    def _close(self) -> None:
        """The loop has ended (died or shut down): fail every open stream, and the adds it will never read
        (queued while it stepped, or since)."""
        reason = f"The engine died: {self._dead!r}" if self._dead is not None else "The engine is shut down."
        with self._close_lock:
            self._closed = reason
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(reason), True)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] in ("add", "call"):
                loop, fut = (cmd[5], cmd[7]) if cmd[0] == "add" else (cmd[3], cmd[4])
                _call_soon(loop, _set_exception, fut, EngineDeadError(reason))

    def _drain(self, block: bool) -> None:
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if cmd[0] == "add":
                _, request_id, prompt, params, priority, loop, stream, added, lora_request = cmd
                try:
                    self.engine.add_request(request_id, prompt, params, priority=priority, lora_request=lora_request)
                except Exception as e:  # noqa: BLE001 - bad input fails this request only
                    _call_soon(loop, _set_exception, added, e)
                    continue
                self._streams[request_id] = (loop, stream)
                if not _call_soon(loop, self._added, added, request_id):
                    self._streams.pop(request_id, None)
                    self.engine.abort_request(request_id)
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
                self._streams.pop(cmd[1], None)
            elif cmd[0] == "call":
                _, fn, args, loop, done = cmd
                try:
                    result = fn(*args)
                except Exception as e:  # noqa: BLE001 - the caller gets it; the engine goes on
                    _call_soon(loop, _set_exception, done, e)
                else:
                    _call_soon(loop, _set_result, done, result)

    def _added(self, added: asyncio.Future, request_id: str) -> None:
        """On the front end's loop: the request is in; if its generate() was cancelled while waiting for
        this, nobody will read it, so abort it."""
        if added.cancelled():
            self._commands.put(("abort", request_id))
        elif not added.done():
            added.set_result(None)

    def _deliver(self, request_id: str, item, last: bool) -> None:
        entry = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            if not _call_soon(loop, stream.put_nowait, item):  # its event loop is gone: nobody listens
                self._streams.pop(request_id, None)
                self.engine.abort_request(request_id)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Schedules fn on a front end's loop; False when that loop is already closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
