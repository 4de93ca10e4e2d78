"""Serving the app over HTTP: connection limits, malformed requests, and the shutdown sequence.

aiohttp does the HTTP; three things are changed from its defaults, as uvicorn (vLLM's server) behaves:
- an idle keep-alive connection, or one that has not sent a complete request head, is closed after
  --timeout-keep-alive seconds (aiohttp's default is an hour, so 1000 stalled clients held 1000 sockets);
- malformed HTTP is answered with an OpenAI-shaped 400 that does not echo the input, and logged as one
  WARNING line without a traceback (aiohttp logs an ERROR with one per request);
- responses say `Server: jaxllm`, not the Python and aiohttp versions.

stop_server: stop listening, refuse new generation requests, drain the running ones (server.admission),
close the remaining connections, then stop the app.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from server.errors import error_body
from server.serving_common import STATE

logger = logging.getLogger("jaxllm.server")

SERVER_NAME = "jaxllm"

# What each parser error means, said without the offending bytes.
_MALFORMED = {
    "BadHttpMethod": "invalid request method",
    "BadStatusLine": "invalid request line",
    "InvalidURLError": "invalid request target",
    "LineTooLong": "request line or header too long",
    "InvalidHeader": "invalid header",
    "BadHttpMessage": "invalid HTTP message",
    "ContentLengthError": "invalid Content-Length",
    "TransferEncodingError": "invalid Transfer-Encoding",
}


class _RequestHandler(RequestHandler):
    def handle_error(
        self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """aiohttp's low-level error answer (a request it could not parse, or a handler that raised past the
        error middleware), OpenAI-shaped."""
        if isinstance(exc, HttpProcessingError):
            kind = type(exc).__name__
            text = f"Malformed HTTP request: {_MALFORMED.get(kind, kind)}."
            logger.warning("Invalid HTTP request received from %s: %s (%d)", request.remote, kind, status)
        else:
            if status >= 500:
                self.log_exception("Error handling request", exc_info=exc)
            text = f"{HTTPStatus(status).phrase}."
        if request.writer.output_size > 0:  # a response was already started: nothing more can be sent
            raise ConnectionError("response already started; cannot send the error")
        resp = web.json_response(error_body(text, status), status=status)
        resp.headers["Server"] = SERVER_NAME
        resp.force_close()
        return resp


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


class _AppRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # aiohttp builds a plain Server; ours only makes our RequestHandler
        return server


async def set_server_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: no version banner; during shutdown, ask keep-alive clients to reconnect elsewhere."""
    response.headers["Server"] = SERVER_NAME
    if request.app[STATE].admission.draining:
        response.force_close()


async def start_server(
    app: web.Application, host: str | None, port: int, *, ssl_context=None, access_log: bool = True, sock=None
) -> tuple[web.AppRunner, int]:
    """Starts serving; returns the runner (stop it with stop_server) and the bound port (port 0 picks one).
    `sock`: an already bound listening socket to serve on instead of host and port."""
    limits = app[STATE].limits
    kwargs = {} if access_log else {"access_log": None}
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its engine requests.
    # shutdown_timeout: what stop_server's last step waits for handlers the drain has already ended.
    runner = _AppRunner(
        app, handler_cancellation=True, shutdown_timeout=5.0, keepalive_timeout=limits.timeout_keep_alive, **kwargs
    )
    await runner.setup()
    if sock is not None:
        site = web.SockSite(runner, sock, ssl_context=ssl_context)
    else:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, bound


async def stop_server(runner: web.AppRunner, *, force: asyncio.Event | None = None) -> None:
    """Graceful shutdown: no new connections or generation requests, the running ones drain for up to
    --shutdown-timeout seconds (or until `force` is set, e.g. a second Ctrl-C), then everything closes."""
    state = runner.app[STATE]
    for site in list(runner.sites):
        await site.stop()  # stop listening; open connections stay
    server = runner.server
    if server is not None:
        server.pre_shutdown()  # idle keep-alive connections close; busy ones close after their response
    await state.admission.drain(state.limits.shutdown_timeout, force)
    await runner.cleanup()
