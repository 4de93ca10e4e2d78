"""`jaxllm serve [MODEL] [vLLM serve flags]` (also `python -m jaxllm.serve`, `jaxllm-serve`): the OpenAI-compatible
server's command.

Without MODEL it serves the built-in demo model. The engine (jaxllm.engine.async_engine.AsyncLLM) is imported
only here, lazily, so the rest of the server package and its tests never need it.

Several hosts: the same command on each, with --coordinator-address --num-processes --process-id. Process 0
serves HTTP; the others run headless (vLLM's --headless): they build the same engine and run the steps process
0 sends until it shuts down (jaxllm/engine/multihost.py). --data-parallel-size D serves D engine replicas
(jaxllm/engine/dp.py), each in its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import ssl
import sys

logger = logging.getLogger("jaxllm.server")


def build_engine(args: argparse.Namespace):
    from server.args import engine_kwargs

    if getattr(args, "data_parallel_size", 1) > 1:
        from jaxllm.engine.dp_async import DPAsyncLLM

        return DPAsyncLLM.from_engine_args(**engine_kwargs(args))
    from jaxllm.engine.async_engine import AsyncLLM

    return AsyncLLM.from_engine_args(**engine_kwargs(args))


async def run_server(
    args: argparse.Namespace, engine=None, *, stop: asyncio.Event | None = None, on_ready=None, on_app=None
) -> str | None:
    """Serves until SIGINT/SIGTERM (or `stop` is set), drains (--shutdown-timeout; a second signal cuts the
    drain short), then shuts the engine down. Returns the engine's fatal_error: why it stopped serving on its
    own (a lost process of a multi-process engine), else None.

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
        if args.ssl_certfile:  # (keyfile None: the key is in the certfile)
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        runner, port = await start_server(
            app,
            args.host,
            args.port,
            ssl_context=ssl_context,
            sock=sock,
            access_log=not getattr(args, "disable_access_log", False),
        )
        stop = stop or asyncio.Event()
        force = asyncio.Event()
        loop = asyncio.get_running_loop()
        fatal_watch = asyncio.create_task(_stop_on_fatal(engine, stop, force))

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
        logger.info(
            "jaxllm %s API server ready on %s://%s:%d (model %s served as %s, max_model_len %d)",
            _version(),
            scheme,
            host,
            port,
            app[STATE].model_root,
            ", ".join(app[STATE].served_model_names),
            engine.max_model_len,
        )
        # What exists now (modules, weights, compiled programs) lives as long as the server: keep the collector
        # from walking it, else each full collection stalls every stream for ~0.5 s (vLLM does the same).
        gc.collect()
        gc.freeze()
        if on_ready is not None:
            on_ready(port)
        await stop.wait()
        logger.info(
            "Shutting down: new requests are refused; running ones may finish for up to %g s "
            "(--shutdown-timeout; a second Ctrl-C ends them now)",
            app[STATE].limits.shutdown_timeout,
        )
        await stop_server(runner, force=force)
        runner = None
        fatal_watch.cancel()
        logger.info("Server stopped")
    finally:
        if runner is not None:  # start-up failed, or the drain itself was cancelled
            await runner.cleanup()
        await engine.shutdown()
    return getattr(engine, "fatal_error", None)


async def _stop_on_fatal(engine, stop: asyncio.Event, force: asyncio.Event) -> None:
    """Stops serving at once when the engine cannot go on (fatal_error: a process of a multi-process engine is
    lost; its requests have already failed); main() then exits non-zero."""
    while not getattr(engine, "fatal_error", None):
        await asyncio.sleep(0.25)
    logger.error("Stopping the server: %s", engine.fatal_error)
    force.set()
    stop.set()


def run_headless(args: argparse.Namespace) -> int:
    """A process other than 0 of a multi-process engine: builds the same engine, then runs the steps process 0
    sends until process 0 shuts down (0) or is lost (the Watchdog exits with 1)."""
    from jaxllm.engine.args import EngineArgs
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.engine.multihost import follow
    from server.args import engine_kwargs

    engine = LLMEngine(EngineArgs.from_kwargs(**engine_kwargs(args), server_mode=True))
    logger.info("Process %d ready (headless): running the steps of process 0", args.process_id)
    follow(engine, until_shutdown=True)
    logger.info("Process 0 shut down the engine; exiting")
    return 0


def bind_socket(host: str | None, port: int) -> socket.socket:
    """The server's socket (all interfaces when host is None), bound before the engine is built so that a port in
    use fails at once, not after the model has loaded. It listens only once the server starts (aiohttp's site
    calls listen), as vLLM's: until then a client (a /health probe) is refused at once instead of waiting
    unanswered for the minutes the model takes to load."""
    try:
        if host:
            return _bound((host, port), socket.AF_INET)
        if socket.has_dualstack_ipv6():
            return _bound(("", port), socket.AF_INET6, dualstack=True)
        return _bound(("", port), socket.AF_INET)
    except OSError as e:
        raise SystemExit(
            f"Cannot listen on {host or '0.0.0.0'}:{port}: {e.strerror or e}. Is another server "
            "running there? Pick another --port."
        ) from None


def _bound(address, family, dualstack: bool = False) -> socket.socket:
    """socket.create_server's socket without its listen()."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dualstack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _level(name: str) -> int:
    return logging.DEBUG if name in ("debug", "trace") else getattr(logging, name.upper())


def _version() -> str:
    import jaxllm

    return jaxllm.__version__


def main(argv: list[str] | None = None) -> None:
    from server.args import parse_args

    args = parse_args(argv)
    logging.basicConfig(
        level=_level(args.log_level),
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    logging.getLogger("aiohttp").setLevel(_level(args.uvicorn_log_level))  # the HTTP server's loggers only
    if args.lora_modules:  # before the model loads: a bad adapter folder fails at once
        from server.lora import check_lora_modules

        check_lora_modules(args.lora_modules, args.max_lora_rank)
    from jaxllm.distributed import maybe_initialize
    from jaxllm.engine.device_memory import request_device_memory

    # before jax.distributed starts the backend
    # (several processes: which GPUs are whose is known only later, so no free-memory check)
    request_device_memory(
        args.gpu_memory_utilization,
        args.pipeline_parallel_size,
        args.tensor_parallel_size if (args.num_processes or 1) == 1 else 0,
    )
    try:
        maybe_initialize(args)  # multi-host: join jax.distributed before any device is touched
    except (RuntimeError, ValueError) as e:
        raise SystemExit(f"jaxllm serve: {e}") from None
    if args.model is None:
        from jaxllm.demo import DEMO_MODEL_NAME, demo_model_path

        args.model = str(demo_model_path())
        args.served_model_name = args.served_model_name or [DEMO_MODEL_NAME]
        logger.info("No MODEL given: serving the demo model at %s as %s", args.model, args.served_model_name[0])
    if (args.num_processes or 1) > 1 and args.process_id:
        code = run_headless(args)
        # Leave the cluster with process 0 (distributed.shutdown, what atexit would run), then exit without the
        # interpreter's teardown: its C++ destructors (the CPU collectives' gloo context) may throw once process 0 is
        # gone, and the worker aborted (-6, "terminate called ... exception not rethrown") in one CI run of
        # tests/test_multihost_faults.py::test_sigterm_on_process_0_stops_the_workers after a clean shutdown.
        from jaxllm.distributed import shutdown

        shutdown()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    fatal = None
    try:
        fatal = asyncio.run(run_server(args))
    except KeyboardInterrupt:
        pass
    except ValueError as e:  # a setting the engine refuses (before serving): its message, not a traceback
        if args.log_level == "debug":
            raise
        logging.shutdown()
        raise SystemExit(f"jaxllm serve: error: {e} (--log-level debug shows where)") from None
    if fatal:
        # a step may still wait in a collective whose peer is gone: do not wait for it at exit
        logger.error("Exiting with status 1: %s", fatal)
        logging.shutdown()
        os._exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
