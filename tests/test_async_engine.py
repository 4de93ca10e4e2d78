"""AsyncLLM: streaming, abort on early close, per-request failures, bad input, and no leaked blocks."""

import asyncio

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
    args = EngineArgs(model=model_dir, dtype="float32", num_gpu_blocks_override=64, max_num_seqs=8,
                      max_num_batched_tokens=32, block_size=8, enforce_eager=True, max_model_len=128)
    eng = AsyncLLM(LLMEngine(args))
    yield eng
    asyncio.run(eng.shutdown())


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
        gen = engine.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=100,
                                                                               ignore_eos=True), "early")
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
