"""ServerThread: `jaxllm serve`'s real server (server.serve.run_server) in a background thread, for synchronous tests.

Separate from server.testing (FakeEngine and the tiny tokenizer) because it serves any EngineClient: the
FakeEngine in server tests, and real engines (LLMEngine, data parallel, LoRA, structured output) in engine tests.
"""

from __future__ import annotations

import asyncio


class ServerThread:
    """Runs `jaxllm serve`'s server (server.serve.run_server) for `engine` on 127.0.0.1 and a free port, in a
    background thread with its own event loop, so synchronous tests can use blocking clients.

        with ServerThread(FakeEngine(tok), "--api-key", "k") as srv: ... srv.base_url ...
    """

    def __init__(self, engine, *argv: str, model: str = "fake-model", args=None):
        import threading

        from server.args import parse_args

        self.engine = engine
        if args is None:
            args = parse_args([model, "--disable-access-log", *argv])
        args.host, args.port = "127.0.0.1", 0
        self.args = args
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self.app = None  # the aiohttp app, once built (app[server.serving_common.STATE] is its ServerState)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="jaxllm-test-server", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("test server did not start in 30 s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def call(self, fn, *args):
        """Runs fn(*args) on the server's loop (to read engine state safely) and returns its result."""
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(run)
        return fut.result(10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _main(self) -> None:
        from server.serve import run_server

        asyncio.set_event_loop(self.loop)

        async def serve():
            self._stop = asyncio.Event()

            def ready(port):
                self.port = port
                self._ready.set()

            await run_server(
                self.args, self.engine, stop=self._stop, on_ready=ready, on_app=lambda app: setattr(self, "app", app)
            )

        try:
            self.loop.run_until_complete(serve())
        except BaseException as e:
            self._error = e
            self._ready.set()
        finally:
            self.loop.close()
