"""A bounded soak (issue 31): 15 s of mixed valid, invalid and abandoned requests on loopback against
FakeEngine, with a queue bound and short timeouts. Afterwards nothing may be left: no running or waiting
request, KV usage 0, no admission counted, no ERROR log line; and every response must have been well-formed
(a 200 of the right shape, an OpenAI error body, or a stream of JSON events ending in [DONE])."""

import asyncio
import json
import logging
import random
import socket
import time

import aiohttp
import pytest

from server.server_thread import ServerThread
from server.serving_common import STATE
from server.testing import FakeEngine, build_tokenizer

DURATION_S = 15  # ~2,000 requests, every kind > 80 times (30 s doubled the suite's time for it)
CLIENTS = 12
USER = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class Checker:
    def __init__(self):
        self.counts: dict[str, int] = {}
        self.problems: list[str] = []

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def bad(self, what: str, detail) -> None:
        self.problems.append(f"{what}: {str(detail)[:300]}")

    def error_body(self, what: str, status: int, body, headers=None) -> None:
        try:
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
            assert isinstance(err["message"], str) and err["message"]
            if status == 503 and "busy" in err["message"]:
                assert headers is not None and headers.get("Retry-After") == "1"
        except Exception as e:  # noqa: BLE001 - recorded, asserted at the end
            self.bad(what, f"{status} {body[:200]!r} {e!r}")

    def completion(self, what: str, body) -> None:
        try:
            r = json.loads(body)
            assert r["id"] and r["choices"] and r["usage"]["total_tokens"] > 0, r
            for c in r["choices"]:
                assert c["finish_reason"] in ("stop", "length"), c
        except Exception as e:  # noqa: BLE001
            self.bad(what, f"{body[:200]!r} {e!r}")

    def stream(self, what: str, text: str, complete: bool) -> None:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        try:
            if complete:
                assert events and events[-1] == "[DONE]", events[-3:]
            for e in events:
                if e != "[DONE]":
                    json.loads(e)
        except Exception as e:  # noqa: BLE001
            self.bad(what, f"{events[-3:]} {e!r}")


async def _request(s, url, check: Checker, rng: random.Random):
    """One random request, its response checked."""
    kind = rng.choice(
        [
            "completion",
            "chat",
            "stream_completion",
            "stream_chat",
            "invalid",
            "invalid",
            "abandon",
            "abandon_queued",
            "tokenize",
            "huge",
            "surrogate",
        ]
    )
    check.count(kind)
    body = {
        "max_tokens": rng.randint(1, 40),
        "ignore_eos": rng.random() < 0.5,
        "temperature": 0.7,
        "n": rng.choice([1, 1, 2, 3]),
    }
    if kind in ("completion", "stream_completion", "abandon", "abandon_queued"):
        path, body = "/v1/completions", {**body, "prompt": f"Line {rng.randint(0, 999)}: the river"}
    else:
        path, body = "/v1/chat/completions", {**body, "messages": USER}
    stream = kind.startswith("stream") or kind == "abandon"
    if kind == "invalid":
        body = rng.choice(
            [
                {**body, "temperature": -1},
                {**body, "n": 1000},
                {**body, "model": "nope"},
                {**body, "top_p": 0},
                {"messages": "x"},
                {**body, "logit_bias": {"x": 1}},
            ]
        )
    elif kind == "huge":
        body = {"prompt": "The quick brown fox. " * 20_000}
    elif kind == "surrogate":
        body = {"prompt": "a\ud800"}
    elif kind == "tokenize":
        path, body = "/tokenize", {"prompt": "The quick brown fox"}
    data = json.dumps({**body, **({"stream": True} if stream else {})}).encode()
    headers = {"Content-Type": "application/json"}
    if kind == "abandon_queued":  # gives up after a moment, often while still waiting for a slot
        try:
            async with s.post(
                url + path, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=rng.uniform(0.01, 0.3))
            ) as r:
                text = await r.text()
                if r.status == 200:
                    check.completion(kind, text)
                else:
                    check.error_body(kind, r.status, text, r.headers)
        except asyncio.TimeoutError:
            pass
        return
    async with s.post(url + path, data=data, headers=headers) as r:
        if r.status != 200:
            check.error_body(kind, r.status, await r.text(), r.headers)
            if kind in ("invalid", "huge", "surrogate") and r.status not in (400, 404):
                check.bad(kind, f"status {r.status}")
            return
        if kind in ("invalid", "huge", "surrogate"):
            check.bad(kind, "accepted")
            return
        if kind == "abandon":
            for _ in range(rng.randint(1, 4)):
                await r.content.readline()
            return  # leaving the block closes the connection mid-stream
        text = await r.text()
        if stream:
            check.stream(kind, text, complete=True)
        elif kind == "tokenize":
            assert json.loads(text)["count"] > 0
        else:
            check.completion(kind, text)


def _raw(port: int, payload: bytes, check: Checker) -> None:
    """Malformed HTTP, or a request head that never completes (closed by --timeout-keep-alive)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(payload)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    if payload.endswith(b"\r\n\r\n"):
        head, _, body = data.partition(b"\r\n\r\n")
        if not head.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")):
            check.bad("malformed", data[:200])
        check.error_body("malformed", 400, body.decode())
    elif data:
        check.bad("partial head", data[:200])


def test_soak(tok, caplog):
    caplog.set_level(logging.WARNING)
    engine = FakeEngine(tok, max_model_len=512, max_num_seqs=8, step_s=0.005)
    check = Checker()
    with ServerThread(
        engine,
        "--max-num-queued-reqs",
        "24",
        "--timeout-keep-alive",
        "2",
        "--timeout-request-body",
        "2",
        "--max-request-body-bytes",
        "4M",
    ) as srv:

        async def client(i: int):
            rng = random.Random(i)
            end = time.monotonic() + DURATION_S
            # the client drops idle connections before the server's --timeout-keep-alive does (else a request
            # can race the server's close: the usual advice for any HTTP server with a keep-alive timeout)
            connector = aiohttp.TCPConnector(keepalive_timeout=0.5)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), connector=connector) as s:
                while time.monotonic() < end:
                    try:
                        if rng.random() < 0.04:
                            payload = rng.choice(
                                [
                                    b"GARBAGE / HTTP/1.1\r\n\r\n",
                                    b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n",
                                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-",
                                ]
                            )
                            check.count("raw")
                            await asyncio.to_thread(_raw, srv.port, payload, check)
                        else:
                            await _request(s, srv.base_url, check, rng)
                    except Exception as e:  # noqa: BLE001 - a client-side failure is a finding too
                        check.bad("client", repr(e))

        async def main():
            await asyncio.gather(*(client(i) for i in range(CLIENTS)))

        t0 = time.monotonic()
        asyncio.run(main())
        took = time.monotonic() - t0

        def leftovers():
            a = srv.app[STATE].admission
            return engine.live_requests(), engine.used_blocks, engine.stats(), (a.in_flight, a.seqs, a.queued_tokens)

        for _ in range(300):
            live, used, stats, admission = srv.call(leftovers)
            if not live and used == 0 and admission == (0, 0, 0):
                break
            time.sleep(0.02)

    print(f"soak: {took:.1f} s, {sum(check.counts.values())} requests {check.counts}")
    assert not check.problems, check.problems[:10]
    assert took < DURATION_S + 15, (took, check.counts)
    assert sum(check.counts.values()) > 300 and all(check.counts.get(k) for k in ("completion", "abandon", "raw"))
    assert live == [] and used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0
    assert admission == (0, 0, 0)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[:5]
