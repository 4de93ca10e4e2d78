"""AsyncLLM: streaming, abort on early close, per-request failures, bad input, and no leaked blocks."""

import asyncio
import time
import types
import warnings

import pytest

from jaxllm import SamplingParams
from jaxllm.engine.args import EngineArgs
from jaxllm.engine.async_engine import AsyncLLM
from jaxllm.engine.llm_engine import LLMEngine
from tests.tiny_models import make_tiny_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir, _ = make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny")))
    args = EngineArgs(
        model=model_dir,
        dtype="float32",
        num_gpu_blocks_override=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=8,
        enforce_eager=True,
        max_model_len=128,
    )
    eng = AsyncLLM(LLMEngine(args))
    yield eng
    # vLLM's AsyncLLM.shutdown() is a plain call (its examples do not await it): it stops the engine thread, with no
    # "never awaited" warning; awaiting it (the server does) also waits for the thread
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng.shutdown()
    eng._thread.join(10)
    assert not eng._thread.is_alive()


def free_blocks_ok(engine):
    bm = engine.engine.scheduler.block_manager
    return bm.num_free_blocks == bm.num_usable_blocks


async def collect(engine, prompt, params, request_id):
    outs = []
    async for out in engine.generate(prompt, params, request_id):
        outs.append(out)
    return outs


def test_concurrent_streams(engine):
    async def main():
        prompts = [{"prompt_token_ids": [5, 9, 2, 77 + i]} for i in range(6)]
        return await asyncio.gather(*(collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    for outs in results:
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths)  # cumulative
    assert free_blocks_ok(engine)


def test_early_close_aborts(engine):
    async def main():
        gen = engine.generate(
            {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), "early"
        )
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not engine.engine.has_unfinished_requests():
                break

    asyncio.run(main())
    assert not engine.engine.has_unfinished_requests()
    assert free_blocks_ok(engine)


def test_bad_input_raises_before_first_output(engine):
    async def main():
        with pytest.raises(ValueError, match="longer than the maximum model length"):
            await collect(engine, {"prompt_token_ids": [1] * 500}, GREEDY, "long")
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(collect(engine, [1, 2], GREEDY, "dup"), collect(engine, [1, 2], GREEDY, "dup"))

    asyncio.run(main())
    assert engine.is_running and not engine.errored


def test_failing_request_leaves_others_running(engine, monkeypatch):
    real = engine.engine._append_token

    def flaky(req, state, token):
        if req.request_id == "bad" and state.seq.num_output_tokens == 3:
            raise RuntimeError("boom")
        return real(req, state, token)

    monkeypatch.setattr(engine.engine, "_append_token", flaky)

    async def main():
        good = asyncio.create_task(collect(engine, [4, 5, 6], GREEDY, "good"))
        with pytest.raises(RuntimeError, match="boom"):
            await collect(engine, [7, 8, 9], GREEDY, "bad")
        return await good

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
    assert engine.is_running and free_blocks_ok(engine)


class _StubEngine:
    """Just enough of LLMEngine for AsyncLLM: step() blocks until released, then raises (die) or returns no
    outputs."""

    model_name, max_model_len, vocab_size, max_logprobs, tokenizer, generation_defaults = "x", 64, 10, 20, None, {}
    runner = types.SimpleNamespace(multihost=None)  # one process

    def __init__(self, die: bool):
        import threading

        self.die = die
        self.requests: set[str] = set()
        self.in_step, self.release = threading.Event(), threading.Event()

    def add_request(self, request_id, prompt, params, priority=0, lora_request=None):
        self.requests.add(request_id)

    def abort_request(self, request_id):
        self.requests.discard(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def pop_failures(self):
        return {}

    def step(self):
        self.in_step.set()
        self.release.wait()
        if self.die:
            raise RuntimeError("device fell over")
        time.sleep(0.01)
        return []


async def _running_in_step(die: bool):
    """An AsyncLLM over a _StubEngine, with request "running" added and the engine held inside its step."""
    fake = _StubEngine(die=die)
    eng = AsyncLLM(fake)
    running = asyncio.create_task(collect(eng, [1], GREEDY, "running"))
    await asyncio.get_running_loop().run_in_executor(None, fake.in_step.wait)
    return fake, eng, running


def test_requests_added_while_the_engine_dies_fail_instead_of_hanging():
    from jaxllm.engine.protocol import EngineDeadError

    async def main():
        fake, eng, running = await _running_in_step(die=True)
        queued = asyncio.create_task(collect(eng, [1], GREEDY, "queued"))  # its add waits behind the step
        await asyncio.sleep(0.05)
        fake.release.set()
        for task in (running, queued):
            with pytest.raises(EngineDeadError, match="device fell over"):
                await asyncio.wait_for(task, 5)
        with pytest.raises(EngineDeadError, match="device fell over"):
            await asyncio.wait_for(collect(eng, [1], GREEDY, "later"), 5)
        assert eng.errored

    asyncio.run(main())


def test_streams_open_at_shutdown_end_with_an_error():
    from jaxllm.engine.protocol import EngineDeadError

    async def main():
        fake, eng, stream = await _running_in_step(die=False)  # steps forever without output
        fake.release.set()
        await eng.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(stream, 5)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(collect(eng, [1], GREEDY, "after"), 5)

    asyncio.run(main())


def test_generate_cancelled_while_its_add_waits_aborts_the_request():
    async def main():
        fake, eng, running = await _running_in_step(die=False)
        cancelled = asyncio.create_task(collect(eng, [1], GREEDY, "cancelled"))
        await asyncio.sleep(0.05)  # its add waits behind the step
        cancelled.cancel()
        fake.release.set()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if fake.requests == {"running"}:
                break
        assert fake.requests == {"running"}  # the engine dropped it: nobody would ever read its outputs
        running.cancel()
        await eng.shutdown()

    asyncio.run(main())
