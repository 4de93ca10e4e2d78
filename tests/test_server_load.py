"""Concurrency, client disconnects, failing requests and a dead engine, against FakeEngine."""

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from server.server_thread import ServerThread
from server.testing import FakeEngine, build_tokenizer

MODEL = "fake-model"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def drained(srv) -> bool:
    return srv.call(lambda: not srv.engine.live_requests() and srv.engine.used_blocks == 0)


def test_64_concurrent_streaming_clients(tok):
    # max_num_seqs below the client count, so requests also queue (num_waiting > 0) and get admitted later
    engine = FakeEngine(tok, max_num_seqs=24, step_s=0.002)
    with ServerThread(engine) as srv:

        async def one(client, i):
            if i % 2:
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Story number {i}"}],
                    max_tokens=24,
                    temperature=0.5,
                    n=1 + i % 3,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                text, finished, usage = {}, set(), None
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for c in chunk.choices:
                        text[c.index] = text.get(c.index, "") + (c.delta.content or "")
                        if c.finish_reason:
                            finished.add(c.index)
                assert finished == set(range(1 + i % 3)) and usage.completion_tokens == 24 * (1 + i % 3)
                return text
            stream = await client.completions.create(
                model=MODEL, prompt=f"Line {i}: the river", max_tokens=24, stream=True, extra_body={"ignore_eos": True}
            )
            pieces, reason = [], None
            async for chunk in stream:
                pieces.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
            assert reason == "length"
            return "".join(pieces)

        async def main():
            client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
            results = await asyncio.gather(*(one(client, i) for i in range(64)), return_exceptions=True)
            await client.close()
            return results

        t0 = time.monotonic()
        results = asyncio.run(main())
        elapsed = time.monotonic() - t0
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert all(results)
        assert wait_until(lambda: drained(srv)), "requests or KV blocks leaked"
        assert engine.aborted == []
        assert elapsed < 60
        assert engine.peak_running == 24 and engine.peak_waiting > 0


def _slow_engine(tok):
    return FakeEngine(tok, step_s=0.01, max_model_len=512)


async def _read_events(resp, n):
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            events.append(line[6:].strip())
            if len(events) >= n:
                break
    return events


def test_disconnect_aborts_streaming_and_non_streaming(tok):
    engine = _slow_engine(tok)
    with ServerThread(engine) as srv:

        async def stream_then_hang_up(path, body):
            async with aiohttp.ClientSession() as s:
                async with s.post(srv.base_url + path, json=body) as r:
                    assert r.status == 200
                    events = await _read_events(r, 3)
                    assert len(events) == 3
                # leaving the block closes the connection mid-stream

        body = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "stream": True}
        asyncio.run(
            stream_then_hang_up("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "x"}]})
        )
        asyncio.run(stream_then_hang_up("/v1/completions", {**body, "prompt": ["a", "b"], "n": 2}))

        async def post_and_give_up():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
                with pytest.raises(asyncio.TimeoutError):
                    async with s.post(
                        srv.base_url + "/v1/completions", json={"prompt": "c", "max_tokens": 400, "ignore_eos": True}
                    ) as r:
                        await r.read()

        asyncio.run(post_and_give_up())
        assert wait_until(lambda: drained(srv)), "requests or KV blocks leaked"
        aborted = srv.call(lambda: list(engine.aborted))
        assert len(aborted) == 4, aborted  # chat, two completion prompts, and the non-streaming one
        assert all(rid in engine.abort_calls for rid in aborted)
        # the server carries on
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        assert c.completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens == 2
        assert wait_until(lambda: drained(srv))


def test_failing_request_leaves_others_running(tok):
    engine = FakeEngine(tok, step_s=0.003)
    with ServerThread(engine) as srv:

        async def main():
            client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)

            async def good(i):
                r = await client.completions.create(
                    model=MODEL, prompt=f"ok {i}", max_tokens=20, extra_body={"ignore_eos": True}
                )
                return r.usage.completion_tokens

            async def bad_non_streaming():
                with pytest.raises(openai.InternalServerError, match="FAIL_MID_STREAM"):
                    await client.completions.create(model=MODEL, prompt="FAIL_MID_STREAM", max_tokens=20)

            async def bad_streaming():
                async with aiohttp.ClientSession() as s:
                    async with s.post(
                        srv.base_url + "/v1/chat/completions",
                        json={
                            "messages": [{"role": "user", "content": "FAIL_MID_STREAM"}],
                            "max_tokens": 20,
                            "stream": True,
                        },
                    ) as r:
                        assert r.status == 200
                        events = [line[6:].strip() async for line in r.content if line.startswith(b"data: ")]
                assert events[-1] == b"[DONE]"
                err = json.loads(events[-2])["error"]
                assert err["code"] == 500 and "fake engine failure" in err["message"]

            results = await asyncio.gather(*(good(i) for i in range(8)), bad_non_streaming(), bad_streaming())
            await client.close()
            return results

        results = asyncio.run(main())
        assert results[:8] == [20] * 8
        assert wait_until(lambda: drained(srv))


def test_dead_engine(tok):
    engine = FakeEngine(tok, step_s=0.01)
    with ServerThread(engine) as srv:

        async def main():
            async with aiohttp.ClientSession() as s:
                async with s.get(srv.base_url + "/health") as r:
                    assert r.status == 200
                async with s.post(
                    srv.base_url + "/v1/completions",
                    json={"prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True},
                ) as r:
                    assert r.status == 200
                    assert len(await _read_events(r, 2)) == 2
                    srv.call(engine.kill)
                    events = [line[6:].strip() async for line in r.content if line.startswith(b"data: ")]
                assert b"The engine is dead" in events[-2] and events[-1] == b"[DONE]"
                async with s.get(srv.base_url + "/health") as r:
                    assert r.status == 503
                async with s.post(srv.base_url + "/v1/completions", json={"prompt": "a"}) as r:
                    body = await r.json()
                    assert r.status == 500 and "The engine is dead" in body["error"]["message"]
                async with s.get(srv.base_url + "/metrics") as r:
                    assert r.status == 200

        asyncio.run(main())
