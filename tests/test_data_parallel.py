"""Data parallelism (--data-parallel-size): the router's balancing, then 2 replicas, each a process with its own 2
simulated CPU devices (tp 2), giving the greedy tokens of one engine, offline and behind the server (there with
n-gram speculation in each replica), both replicas used and labelled in /metrics as vLLM's `engine`; a LoRA adapter
served by each replica; a replica's bad input failing only its request; a replica process that dies failing its
requests (offline) and stopping the server, in bounded time; a replica's start-up error raised in this process."""

import concurrent.futures
import os
import re
import signal
import threading
import time
import urllib.request

import openai
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.dp import Router
from jaxllm.engine.protocol import EngineDeadError
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


@pytest.fixture(scope="module")
def dp_llm(tiny):
    llm = LLM(tiny, data_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def _wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_offline_two_replicas_equal_one_engine(dp_llm, ref):
    engine = dp_llm.llm_engine
    procs = [p.process for p in engine.replicas]
    assert len({p.pid for p in procs}) == 2 and os.getpid() not in {p.pid for p in procs}
    assert all(len(p.info["devices"]) == 2 for p in engine.replicas)  # each process: its own tp-2 group
    assert [p.env["XLA_FLAGS"].split()[-1] for p in engine.replicas] == ["--xla_force_host_platform_device_count=2"] * 2
    outs = dp_llm.generate([{"prompt_token_ids": p} for p in ALL], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(n > 0 for n in engine.router.counts) and engine.router.load == [0, 0]
    # both replicas ran steps, and returned every KV block once idle
    stats = [p.stats() for p in engine.replicas]
    assert all(s.generation_tokens > 0 for s in stats), stats
    _wait_for(lambda: all(p.stats().kv_cache_usage == 0 and p.stats().num_running == 0 for p in engine.replicas))


def test_bad_input_fails_only_its_request(dp_llm, ref):
    """A replica's ValueError (the token id is outside the vocabulary) reaches the caller; the engine goes on."""
    with pytest.raises(ValueError, match="out of vocabulary|vocab"):
        dp_llm.generate([{"prompt_token_ids": ALL[0]}, {"prompt_token_ids": [10**6]}], GREEDY, use_tqdm=False)
    assert not dp_llm.llm_engine.has_unfinished_requests()
    # a prompt that cannot be pickled to its replica process: that request fails, nothing hangs
    with pytest.raises(ValueError, match="Cannot send this add to a data-parallel replica"):
        dp_llm.generate([{"prompt_token_ids": ALL[1], "extra": threading.Lock()}], GREEDY, use_tqdm=False)
    assert not dp_llm.llm_engine.has_unfinished_requests()
    outs = dp_llm.generate([{"prompt_token_ids": p} for p in ALL[:2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref[:2]


def test_replica_death_fails_its_requests(dp_llm):
    """Last in this module (it ends the module's engine): SIGKILL replica 1 mid-run; generate() raises an error
    naming it within bounded time (no hang), later calls fail at once, and shutting down stops replica 0."""
    engine = dp_llm.llm_engine
    victim = engine.replicas[1]
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    result: dict = {}
    before = victim.stats().generation_tokens

    def run():  # 80 requests of 40 tokens: waves of 8 a replica, hundreds of steps
        try:
            dp_llm.generate([{"prompt_token_ids": p} for p in ALL[:4] * 20], long, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    _wait_for(lambda: victim.stats().generation_tokens > before)  # it is mid-run
    os.kill(victim.process.pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive(), "generate() hung after a replica died"
    assert isinstance(result.get("error"), EngineDeadError), result
    assert "Data-parallel replica 1" in str(result["error"]) and "SIGKILL" in str(result["error"])
    with pytest.raises(EngineDeadError, match="replica 1"):
        dp_llm.generate([{"prompt_token_ids": ALL[0]}], GREEDY, use_tqdm=False)
    engine.shutdown()
    assert not any(p.process.is_alive() for p in engine.replicas)


def test_replica_startup_error_is_raised_here(tiny, tmp_path):
    """A replica that fails while it builds its engine (here: weights that do not match config.json) raises its
    exception in this process, and no replica process is left."""
    import shutil

    from jaxllm.engine import dp_process

    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    before = set(threading.enumerate())
    started = []
    real = dp_process.ReplicaProcess.__init__

    def record(self, *a, **k):
        real(self, *a, **k)
        started.append(self.process)

    dp_process.ReplicaProcess.__init__ = record
    try:
        with pytest.raises(Exception) as info:
            LLM(str(bad), data_parallel_size=2, **ENGINE)
    finally:
        dp_process.ReplicaProcess.__init__ = real
    assert len(started) == 2 and not any(p.is_alive() for p in started)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "In data-parallel replica" in notes, (info.value, notes)
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("jaxllm-dp")]


def test_server_two_replicas(tiny, ref, tmp_path):
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
            "--profile-dir",
            str(tmp_path / "prof"),
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

        post = lambda path: urllib.request.urlopen(urllib.request.Request(srv.base_url + path, method="POST"))  # noqa: E731
        assert post("/start_profile").status == 200  # each replica process traces itself
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, ALL)) == ref
        assert post("/stop_profile").status == 200
        assert all(any((tmp_path / "prof" / f"dp{r}").rglob("*.xplane.pb")) for r in (0, 1))
        with urllib.request.urlopen(srv.base_url + "/metrics") as resp:
            text = resp.read().decode()
        assert sum(engine.router.counts) == len(ALL) and min(engine.router.counts) > 0
        # a replica process that dies: the server stops serving (serve.main then exits non-zero)
        os.kill(engine.replicas[1].process.process.pid, signal.SIGKILL)
        _wait_for(lambda: engine.fatal_error is not None)
        assert "Data-parallel replica 1" in engine.fatal_error and not engine.is_running
        srv._thread.join(30)
        assert not srv._thread.is_alive()
    assert not any(r.process.process.is_alive() for r in engine.replicas)  # the server's shutdown stopped replica 0
    for metric in ("vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count"):
        per_engine = {
            m[0]: float(m[1]) for m in re.findall(metric + r'\{engine="(\d)",model_name="tiny"\} (\S+)', text)
        }
        assert set(per_engine) == {"0", "1"} and all(v > 0 for v in per_engine.values()), (metric, per_engine)
    drafts = re.findall(r'vllm:spec_decode_num_drafts_total\{engine="(\d)",model_name="tiny"\} (\S+)', text)
    assert sorted(e for e, _ in drafts) == ["0", "1"] and sum(float(n) for _, n in drafts) > 0, drafts


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
    assert llm.llm_engine.list_loras() == {1}
    assert all(p.call_sync("list_loras") == {1} for p in llm.llm_engine.replicas)
    llm.llm_engine.shutdown()
