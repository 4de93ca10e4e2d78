"""The HTTP layer (issue 31): slow and idle clients are timed out, malformed HTTP gets a quiet OpenAI-shaped
400, no version banner, and shutdown drains: running requests finish, or end with an error past the timeout."""

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from server.server_thread import ServerThread
from server.testing import FakeEngine, build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    engine = FakeEngine(tok, max_model_len=256)
    with ServerThread(engine, "--timeout-keep-alive", "1", "--timeout-request-body", "1") as srv:
        yield srv


def _connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.settimeout(10)
    return s


def _read_until_closed(s: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    t0, data = time.monotonic(), b""
    while True:
        try:
            chunk = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - t0


def test_slow_and_idle_clients_are_disconnected(server):
    """A partial request head, a body that stops short, and an idle keep-alive connection each used to stay open
    past 180 s (1000 of them held 1000 sockets)."""
    partial = _connect(server)
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    short = _connect(server)
    short.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt": '
    )
    idle = _connect(server)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")

    data, took = _read_until_closed(partial)
    assert data == b"" and took < 5  # --timeout-keep-alive 1 also bounds an incomplete head
    data, took = _read_until_closed(short)
    assert took < 5
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head, data
    assert json.loads(body)["error"]["type"] == "RequestTimeoutError"
    data, took = _read_until_closed(idle)
    assert data.startswith(b"HTTP/1.1 200") and took < 5  # answered, then closed once idle
    for s in (partial, short, idle):
        s.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE-SECRET-123 / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header SECRET-123\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: SECRET-123\r\n\r\n",
    ],
)
def test_malformed_http_is_a_quiet_openai_400(server, raw, caplog):
    caplog.set_level(logging.DEBUG)
    s = _connect(server)
    s.sendall(raw)
    data, _ = _read_until_closed(s)
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), data
    assert b"SECRET" not in data  # the input is not echoed
    err = json.loads(body)["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"].startswith("Malformed HTTP")
    assert b"Server: jaxllm\r\n" in head
    records = [r for r in caplog.records if r.name.startswith(("jaxllm", "aiohttp")) and r.levelno >= logging.WARNING]
    assert [r.levelname for r in records] == ["WARNING"], [r.getMessage() for r in records]
    assert records[0].exc_info is None and "SECRET" not in records[0].getMessage()


def test_no_version_banner(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            heads = []
            for method, path in [("GET", "/health"), ("GET", "/nope"), ("POST", "/v1/completions")]:
                async with s.request(method, server.base_url + path, json={"prompt": "a", "max_tokens": 1}) as r:
                    await r.read()
                    heads.append(r.headers.get("Server"))
            return heads

    assert asyncio.run(main()) == ["jaxllm"] * 3


def _stop_in_background(srv) -> threading.Thread:
    t = threading.Thread(target=srv.stop)
    t.start()
    return t


def _events(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_shutdown_drains_running_requests(tok, caplog):
    caplog.set_level(logging.INFO, logger="jaxllm.server")
    engine = FakeEngine(tok, max_model_len=512, step_s=0.01)
    srv = ServerThread(engine, "--shutdown-timeout", "20").start()
    body = {"prompt": "a", "max_tokens": 150, "ignore_eos": True}

    async def main():
        async with aiohttp.ClientSession() as s:
            streaming = await s.post(srv.base_url + "/v1/completions", json={**body, "stream": True})
            plain = asyncio.create_task(s.post(srv.base_url + "/v1/completions", json=body))
            await streaming.content.readline()
            await asyncio.sleep(0.1)
            stopper = _stop_in_background(srv)  # SIGTERM's path: run_server's stop event
            refused = None
            for _ in range(200):  # the listener closes at once (as uvicorn's): new clients go elsewhere
                try:  # (a connection accepted just as the listener closes may never be answered: time out)
                    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as fresh:
                        async with fresh.get(srv.base_url + "/health") as r:
                            await r.read()
                except aiohttp.ClientConnectorError as e:
                    refused = e
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.01)
            text = (await streaming.read()).decode()
            plain_resp = await plain
            plain_body = await plain_resp.json()
            stopper.join(30)
            return refused, text, plain_resp.status, plain_body

    refused, text, plain_status, plain_body = asyncio.run(main())
    # refused, or reset when the connect raced the listener's close (seen once in CI): not served either way
    assert isinstance(refused.os_error, (ConnectionRefusedError, ConnectionResetError)), refused
    events = _events(text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert plain_status == 200 and plain_body["usage"]["completion_tokens"] == 150
    assert engine.aborted == []
    assert "Draining 2 running requests for up to 20 s (--shutdown-timeout)" in caplog.text


def test_shutdown_timeout_ends_requests_with_an_error(tok, caplog):
    engine = FakeEngine(tok, max_model_len=4096, step_s=0.01)
    srv = ServerThread(engine, "--shutdown-timeout", "0.5").start()
    body = {"prompt": "a", "max_tokens": 3000, "ignore_eos": True}

    async def main():
        async with aiohttp.ClientSession() as s:
            chat = await s.post(
                srv.base_url + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3000,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            plain = asyncio.create_task(s.post(srv.base_url + "/v1/completions", json=body))
            await chat.content.readline()
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            stopper = _stop_in_background(srv)
            text = (await chat.read()).decode()
            plain_resp = await plain
            plain_body = await plain_resp.json()
            stopper.join(30)
            return text, plain_resp.status, plain_body, time.monotonic() - t0

    text, plain_status, plain_body, took = asyncio.run(main())
    events = _events(text)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 503 and "shutting down" in err["message"] and "--shutdown-timeout" in err["message"]
    assert plain_status == 503 and "shutting down" in plain_body["error"]["message"]
    assert took < 10
    assert len(engine.aborted) == 2 and engine.live_requests() == []
    assert "Shutdown: aborting 2 requests still running after 0.5 s (--shutdown-timeout)" in caplog.text


_SERVE = """
import asyncio, logging
logging.basicConfig(level=logging.INFO)
from server.serve import run_server
from server.args import parse_args
from server.testing import FakeEngine, build_tokenizer
args = parse_args(["fake-model", "--port", "0", "--host", "127.0.0.1", "--disable-log-stats"])
engine = FakeEngine(build_tokenizer(), max_model_len=2048, step_s=0.01)
asyncio.run(run_server(args, engine, on_ready=lambda port: print(port, flush=True)))
print("exited cleanly", flush=True)
"""


def test_sigterm_drains_a_real_process():
    """SIGTERM with the default --shutdown-timeout: a 12 s stream finishes (it used to be cut after ~10 s without an
    error event or [DONE]), and the process exits cleanly."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        port = int(proc.stdout.readline())

        async def main():
            async with aiohttp.ClientSession() as s:
                r = await s.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"prompt": "a", "max_tokens": 1200, "ignore_eos": True, "stream": True},
                )
                await r.content.readline()
                proc.send_signal(signal.SIGTERM)
                return (await r.read()).decode()

        events = _events(asyncio.run(main()))
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert proc.returncode == 0 and "exited cleanly" in out, err
    assert "Shutting down: new requests are refused" in err and "Traceback" not in err


def test_the_port_is_bound_early_and_refuses_clients_until_the_server_listens():
    """serve binds its port before the model loads (a port in use fails at once) but listens only when the server
    starts, as vLLM does: a /health probe during the load is refused at once instead of hanging unanswered."""
    from server.serve import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        sock.listen()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with pytest.raises(SystemExit, match=f"Cannot listen on 127.0.0.1:{port}"):
            bind_socket("127.0.0.1", port)
    finally:
        sock.close()
