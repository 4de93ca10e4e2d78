"""Worker threads for request work that would stall the event loop."""

from __future__ import annotations

import asyncio
import functools
import gc
from concurrent.futures import ThreadPoolExecutor


class Workers:
    """Threads for request work that would stall the event loop, as vLLM's async tokenizer. Bodies over
    BIG_BODY_BYTES get a lane of their own, so a huge request delays only other huge ones.

    A thread still holds the GIL for each C call (a 10 MB json.loads: ~0.2 s), and Python's cyclic collector,
    which runs in whichever thread allocates, walks every live object: the million objects of a 300k-message
    request made each full collection stall the event loop for up to 0.4 s. So the big lane (one thread)
    pauses the collector while it works; what it builds is freed by reference counting, and jobs must not
    return large object graphs (the next collection would walk them)."""

    BIG_BODY_BYTES = 1 << 20

    def __init__(self, threads: int = 4):
        self._small = ThreadPoolExecutor(threads, thread_name_prefix="jaxllm-request")
        self._big = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-big-request")

    async def run(self, fn, *args, size: int = 0):
        """fn(*args) in a worker thread; `size`: the body's (or the response's) size in bytes, to pick a lane."""
        loop = asyncio.get_running_loop()
        if size > self.BIG_BODY_BYTES:
            return await loop.run_in_executor(self._big, functools.partial(_without_gc, fn, *args))
        return await loop.run_in_executor(self._small, functools.partial(fn, *args))

    def shutdown(self) -> None:
        for pool in (self._small, self._big):
            pool.shutdown(wait=False, cancel_futures=True)


def _without_gc(fn, *args):
    enabled = gc.isenabled()
    gc.disable()
    try:
        return fn(*args)
    finally:
        if enabled:
            gc.enable()
