"""Data parallelism (--data-parallel-size): the router's balancing, then 2 replicas on the 8 simulated CPU devices
(tp 2 each, disjoint) giving the greedy tokens of one engine, offline and behind the server (there with n-gram
speculation in each replica), both replicas used and labelled in /metrics as vLLM's `engine`; a LoRA adapter
served by each replica."""

import concurrent.futures
import re
import urllib.request

import openai
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.dp import Router
from server.args import parse_args
from server.server_thread import ServerThread
from tests.test_engine import PROMPTS, SHARED
from tests.tiny_models import make_tiny_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ALL = PROMPTS + [SHARED + [1, 2], SHARED + [3]]
ENGINE = dict(
    dtype="float32",
    num_gpu_blocks_override=64,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    block_size=8,
    max_model_len=64,
    enforce_eager=True,
    compilation_cache_dir=None,
)


def test_router_balances_load_and_follows_prefixes():
    r = Router(2, block_size=4)
    long = {"prompt_token_ids": list(range(12))}
    assert [r.route(f"a{i}", [9, i], 1) for i in range(4)] == [0, 1, 0, 1]  # least loaded, ties rotate
    r.done(0, 1)
    r.done(0, 1)
    assert r.route("b", [5], 1) == 0 and r.route("c", [6], 2) == 0  # replica 0 had less load
    assert r.load == [3, 2]
    assert r.route("p1", long, 1) == 1  # replica 1 is less loaded
    # the same first blocks again: replica 1 has them, and is within the slack (load 3 vs 3)
    assert r.route("p2", {"prompt_token_ids": list(range(12)) + [99]}, 1) == 1
    assert r.load == [3, 4]
    # another salt shares no blocks: plain balancing
    assert r.route("p3", {"prompt_token_ids": list(range(12)), "cache_salt": "s"}, 1) == 0
    # too busy for the prefix: balancing wins
    r.load = [1, 6]
    assert r.route("p4", long, 1) == 0
    assert r.replica_of("p1") == 1 and r.replica_of("p3") == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny")))[0]


@pytest.fixture(scope="module")
def ref(tiny):
    llm = LLM(tiny, **ENGINE)
    return [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ALL], GREEDY, use_tqdm=False)
    ]


def test_offline_two_replicas_equal_one_engine(tiny, ref):
    llm = LLM(tiny, data_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    groups = [{d.id for d in e.runner.mesh.devices.flat} for e in engine.replicas]
    assert len(groups) == 2 and all(len(g) == 2 for g in groups) and not groups[0] & groups[1]
    outs = llm.generate([{"prompt_token_ids": p} for p in ALL], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(n > 0 for n in engine.router.counts) and engine.router.load == [0, 0]
    assert all(
        e.scheduler.block_manager.num_free_blocks == e.scheduler.block_manager.num_usable_blocks
        for e in engine.replicas
    )


def test_server_two_replicas(tiny, ref):
    from server.serve import build_engine

    args = parse_args(
        [
            tiny,
            "--dtype",
            "float32",
            "--max-model-len",
            "64",
            "--enforce-eager",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "32",
            "--block-size",
            "8",
            "--served-model-name",
            "tiny",
            "--disable-access-log",
            "--data-parallel-size",
            "2",
            # each replica speculates (greedy outputs stay the engine's)
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}',
        ]
    )
    engine = build_engine(args)
    with ServerThread(engine, args=args) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)

        def complete(prompt):
            r = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=GREEDY.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return r.choices[0].model_extra["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, ALL)) == ref
        with urllib.request.urlopen(srv.base_url + "/metrics") as resp:
            text = resp.read().decode()
    for metric in ("vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count"):
        per_engine = {
            m[0]: float(m[1]) for m in re.findall(metric + r'\{engine="(\d)",model_name="tiny"\} (\S+)', text)
        }
        assert set(per_engine) == {"0", "1"} and all(v > 0 for v in per_engine.values()), (metric, per_engine)
    drafts = re.findall(r'vllm:spec_decode_num_drafts_total\{engine="(\d)",model_name="tiny"\} (\S+)', text)
    assert sorted(e for e, _ in drafts) == ["0", "1"] and sum(float(n) for _, n in drafts) > 0, drafts
    assert sum(engine.router.counts) == len(ALL) and min(engine.router.counts) > 0


def test_lora_in_every_replica(tmp_path):
    """--enable-lora with 2 replicas: the adapter is served by both (the same LoRA request lands on each in turn)
    with HF + PEFT's greedy tokens, beside base-model requests."""
    pytest.importorskip("peft")
    from jaxllm.lora.request import LoRARequest
    from tests.test_lora import make_adapter
    from tests.test_lora_engine import hf_greedy

    base, hf_base = make_tiny_model_dir("llama", str(tmp_path / "base"))
    hf_base.generation_config.eos_token_id = None
    peft_model = make_adapter(str(tmp_path / "a1"), 1, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    peft_model.get_base_model().generation_config.eos_token_id = None
    prompt = [5, 17, 42, 9, 100]
    want, want_base = hf_greedy(peft_model, prompt), hf_greedy(hf_base, prompt)
    assert want != want_base  # the adapter changes the tokens: the test can fail
    llm = LLM(base, data_parallel_size=2, enable_lora=True, max_lora_rank=8, **ENGINE)
    a1 = LoRARequest("a1", 1, str(tmp_path / "a1"))
    greedy = SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, greedy, lora_request=[a1, a1, None], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want, want, want_base]
    assert {llm.llm_engine.router.replica_of(i) for i in ("0", "1")} == {0, 1}  # a1 ran in each replica
    assert llm.llm_engine.list_loras() == {1} and all(e.list_loras() == {1} for e in llm.llm_engine.replicas)
