"""`jaxllm serve [MODEL] [vLLM serve flags]` (also `python -m jaxllm.serve`, `jaxllm-serve`): the OpenAI-compatible
server's command.

Without MODEL it serves the built-in demo model. The engine (jaxllm.engine.async_engine.AsyncLLM) is imported
only here, lazily, so the rest of the server package and its tests never need it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import socket
import ssl
import sys

logger = logging.getLogger("jaxllm.server")


def build_engine(args: argparse.Namespace):
    from jaxllm.engine.async_engine import AsyncLLM
    from server.args import engine_kwargs

    return AsyncLLM.from_engine_args(**engine_kwargs(args))


async def run_server(args: argparse.Namespace, engine=None, *, stop: asyncio.Event | None = None,
                     on_ready=None, on_app=None) -> None:
    """Serves until SIGINT/SIGTERM (or `stop` is set), drains (--shutdown-timeout; a second signal cuts the
    drain short), then shuts the engine down.

    `engine`: any EngineClient (tests pass a fake); default: AsyncLLM built from the engine flags.
    `on_ready(port)`: called once the socket listens; `on_app(app)`: once the app is built (tests read its state).
    """
    from server.app import build_app, start_server, stop_server
    from server.serving_common import STATE

    sock = None
    if engine is None:
        sock = bind_socket(args.host, args.port)  # before the model loads (minutes), as vLLM does
        try:
            engine = build_engine(args)
        except BaseException:
            sock.close()
            raise
    runner = None
    try:
        app = build_app(engine, args)
        if on_app is not None:
            on_app(app)
        ssl_context = None
        if args.ssl_certfile:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        runner, port = await start_server(app, args.host, args.port, ssl_context=ssl_context, sock=sock,
                                          access_log=not getattr(args, "disable_access_log", False))
        stop = stop or asyncio.Event()
        force = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():
                logger.info("Second signal: ending the drain now")
                force.set()
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests), or Windows
                pass
        scheme = "https" if ssl_context else "http"
        host = args.host or "0.0.0.0"
        logger.info("jaxllm %s API server ready on %s://%s:%d (model %s served as %s, max_model_len %d)",
                    _version(), scheme, host, port, app[STATE].model_root,
                    ", ".join(app[STATE].served_model_names), engine.max_model_len)
        # What exists now (modules, weights, compiled programs) lives as long as the server: keep the collector
        # from walking it, else each full collection stalls every stream for ~0.5 s (vLLM does the same).
        gc.collect()
        gc.freeze()
        if on_ready is not None:
            on_ready(port)
        await stop.wait()
        logger.info("Shutting down: new requests are refused; running ones may finish for up to %g s "
                    "(--shutdown-timeout; a second Ctrl-C ends them now)", app[STATE].limits.shutdown_timeout)
        await stop_server(runner, force=force)
        runner = None
        logger.info("Server stopped")
    finally:
        if runner is not None:  # start-up failed, or the drain itself was cancelled
            await runner.cleanup()
        await engine.shutdown()


def bind_socket(host: str | None, port: int) -> socket.socket:
    """The listening socket (all interfaces when host is None), bound before the engine is built so that a
    port in use fails at once, not after the model has loaded."""
    try:
        if host:
            return socket.create_server((host, port))
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", port))
    except OSError as e:
        raise SystemExit(f"Cannot listen on {host or '0.0.0.0'}:{port}: {e.strerror or e}. Is another server "
                         "running there? Pick another --port.") from None


def _version() -> str:
    import jaxllm

    return jaxllm.__version__


def main(argv: list[str] | None = None) -> None:
    from server.args import parse_args

    args = parse_args(argv)
    level = logging.DEBUG if args.log_level in ("debug", "trace") else getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    if args.lora_modules:  # before the model loads: a bad adapter folder fails at once
        from server.lora import check_lora_modules

        check_lora_modules(args.lora_modules, args.max_lora_rank)
    from jaxllm.distributed import maybe_initialize
    from jaxllm.engine.setup import request_device_memory

    # before jax.distributed starts the backend
    # (several processes: which GPUs are whose is known only later, so no free-memory check)
    request_device_memory(args.gpu_memory_utilization, args.pipeline_parallel_size,
                          args.tensor_parallel_size if (args.num_processes or 1) == 1 else 0)
    maybe_initialize(args)  # multi-host: join jax.distributed before any device is touched
    if args.model is None:
        from jaxllm.demo import DEMO_MODEL_NAME, demo_model_path

        args.model = str(demo_model_path())
        args.served_model_name = args.served_model_name or [DEMO_MODEL_NAME]
        logger.info("No MODEL given: serving the demo model at %s as %s", args.model, args.served_model_name[0])
    try:
        asyncio.run(run_server(args))
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
