"""LoRA through the whole engine: greedy tokens equal HF + PEFT (unmerged and merge_and_unload'ed) for several PEFT
adapters and the base model in one generate() call, with more adapters than slots (swaps, host-cache re-reads),
prefix caching per adapter, a bad adapter refused without harm; at tp 2 a mixed batch and the server's LoRA routes
(--lora-modules, /v1/models, model naming an adapter, unknown adapter -> 404, runtime load / unload)."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request

import pytest
import torch

from jaxllm.lora.request import LoRARequest
from tests.test_lora import ALL_MODULES, make_adapter
from tests.tiny_models import make_tiny_model_dir

pytest.importorskip("peft")

ENGINE = dict(
    dtype="float32",
    num_gpu_blocks_override=96,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    block_size=8,
    enforce_eager=True,
    max_model_len=128,
    enable_lora=True,
    max_lora_rank=8,
)
PROMPTS = [[5, 17, 42, 9, 100], [3, 8, 60, 2, 11, 90, 33]]
N_OUT = 8


def hf_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=N_OUT, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    base, hf_base = make_tiny_model_dir("llama", str(root / "base"))
    hf_base.generation_config.eos_token_id = None
    made = {
        "a1": make_adapter(str(root / "a1"), 1, r=4, lora_alpha=8, target_modules=ALL_MODULES),
        "a2": make_adapter(
            str(root / "a2"),
            2,
            r=8,
            lora_alpha=16,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"down_proj": 2},
        ),
        "a3": make_adapter(str(root / "a3"), 3, r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj", "o_proj"]),
    }
    refs = {None: [hf_greedy(hf_base, p) for p in PROMPTS]}
    for name, model in made.items():
        model.get_base_model().generation_config.eos_token_id = None
        refs[name] = [hf_greedy(model, p) for p in PROMPTS]
        assert refs[name] != refs[None]  # the adapter changes the greedy tokens: the test can fail
    merged = copy.deepcopy(made["a1"]).merge_and_unload()
    refs["a1 merged"] = [hf_greedy(merged, p) for p in PROMPTS]
    with torch.no_grad():  # a1's logprob of each greedy token (teacher-forced; a1 adapts lm_head too)
        lp = torch.log_softmax(made["a1"](torch.tensor([PROMPTS[0] + refs["a1"][0]])).logits[0], -1)
    refs["a1 logprobs"] = [lp[len(PROMPTS[0]) - 1 + i, t].item() for i, t in enumerate(refs["a1"][0])]
    paths = {name: str(root / name) for name in made}
    bad = make_adapter(str(root / "r16"), 4, r=16, lora_alpha=16, target_modules=["q_proj"])
    del bad
    paths["r16"] = str(root / "r16")
    return base, paths, refs


def test_llm_generate_mixes_adapters_and_base_and_matches_hf_peft(setup):
    from jaxllm import LLM, SamplingParams

    base, paths, refs = setup
    # 3 adapters, 2 slots, 2 in host memory: the scheduler holds one back, slots swap, an adapter is read again
    llm = LLM(base, **ENGINE, max_loras=2, max_cpu_loras=2)
    loras = {n: LoRARequest(n, i, paths[n]) for i, n in enumerate(("a1", "a2", "a3"), 1)}
    names = [None, "a1", "a2", "a3"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in names]
    reqs = [loras.get(n) for _ in PROMPTS for n in names]
    sp = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)
    outs = llm.generate(prompts, sp, lora_request=reqs, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    want = [refs[n][i] for i in range(len(PROMPTS)) for n in names]
    assert got == want
    assert refs["a1 merged"] == refs["a1"]  # merged and unmerged agree, so ours matches both
    assert llm.llm_engine.lora.num_swaps >= 3
    # one device: the slots were fused into the base projections' weights (LoRASlots.absorb), which left the params
    assert llm.llm_engine.lora.absorbed and "w_qkv" not in llm.llm_engine.runner.params["layers"][0]

    # prefix caching is per adapter: a repeated prompt hits its own adapter's blocks, never another's
    long = {"prompt_token_ids": list(range(1, 40))}
    first = llm.generate(long, sp, lora_request=loras["a1"], use_tqdm=False)[0]
    again = llm.generate(long, sp, lora_request=loras["a1"], use_tqdm=False)[0]
    other = llm.generate(long, sp, lora_request=loras["a2"], use_tqdm=False)[0]
    plain = llm.generate(long, sp, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids != other.outputs[0].token_ids

    # a bad adapter is refused naming the field, before anything runs, and the engine goes on
    with pytest.raises(ValueError, match=r"^r: LoRA rank 16 is greater than max_lora_rank 8"):
        llm.generate(PROMPTS[0], sp, lora_request=LoRARequest("r16", 9, paths["r16"]), use_tqdm=False)
    with pytest.raises(ValueError, match="lengths of prompts"):
        llm.generate(PROMPTS, sp, lora_request=[loras["a1"]], use_tqdm=False)
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, sp, lora_request=loras["a3"], use_tqdm=False)
    assert out[0].outputs[0].token_ids == refs["a3"][1]
    assert not llm.llm_engine.scheduler.running and llm.llm_engine.scheduler.block_manager.usage == 0


def test_compiled_steps_with_adapters(setup):
    """Not eager: the start-up programs take the slot arrays as an argument (no compile when adapters come and
    go), and a step with other sampler flags runs split, its sampler-only program applying a1's lm_head adapter."""
    from jaxllm import LLM, SamplingParams

    base, paths, refs = setup
    llm = LLM(base, **dict(ENGINE, enforce_eager=False, max_num_seqs=4, max_num_batched_tokens=16), max_loras=1)
    programs = llm.llm_engine.runner.programs
    a1, a3 = LoRARequest("a1", 1, paths["a1"]), LoRARequest("a3", 3, paths["a3"])
    sp = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 3, sp, lora_request=[None, a1, a3], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[None][0], refs["a1"][0], refs["a3"][0]]
    assert programs.num_compiles_after_warmup == 0 and llm.llm_engine.lora.num_swaps >= 2
    assert llm.llm_engine.lora.absorbed  # fused when the loaded weights were bound (set_params)
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, logprobs=1),
        lora_request=a1,
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == refs["a1"][0] and programs.samplers  # ran split (a sampler-only program)
    got = [d[t].logprob for d, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert got == pytest.approx(refs["a1 logprobs"], abs=2e-4)


def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_tp2_mixed_batch_and_server_routes(setup, monkeypatch):
    from jaxllm.engine.args import EngineArgs
    from jaxllm.engine.async_engine import AsyncLLM
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.sampling_params import SamplingParams
    from server.server_thread import ServerThread

    base, paths, refs = setup
    engine = LLMEngine(EngineArgs(model=base, **ENGINE, max_loras=2, tensor_parallel_size=2, server_mode=True))
    sp = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)
    names = [None, "a1", "a2"]
    for i, name in enumerate(names):  # one batch: base + two adapters, over two simulated devices
        lora = None if name is None else LoRARequest(name, i, paths[name])
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[0]}, sp, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[f"r{i}"] for i in range(3)] == [refs[n][0] for n in names]
    for i in (1, 2):
        engine.remove_lora(i)
    assert engine.list_loras() == set()

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with ServerThread(
        AsyncLLM(engine),
        "--enable-lora",
        "--lora-modules",
        f"a1={paths['a1']}",
        "--return-tokens-as-token-ids",
        model="base",
    ) as srv:
        url = srv.base_url

        def complete(model, prompt):
            status, text = _post(
                url + "/v1/completions",
                {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": N_OUT,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 0,
                },
            )
            if status != 200:
                return status, json.loads(text)
            toks = json.loads(text)["choices"][0]["logprobs"]["tokens"]
            return status, [int(t.split(":")[1]) for t in toks]

        cards = {c["id"]: c for c in _get(url + "/v1/models")["data"]}
        assert cards["a1"]["parent"] == "base" and cards["a1"]["root"] == paths["a1"]
        assert cards["base"]["parent"] is None
        assert complete("a1", PROMPTS[1]) == (200, refs["a1"][1])
        assert complete("base", PROMPTS[1]) == (200, refs[None][1])
        status, body = complete("a2", PROMPTS[1])
        assert status == 404 and body["error"] == {
            "message": "The model `a2` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
        assert _post(url + "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": paths["a2"]}) == (
            200,
            "Success: LoRA adapter 'a2' added successfully.",
        )
        assert complete("a2", PROMPTS[1]) == (200, refs["a2"][1])
        assert "a2" in {c["id"] for c in _get(url + "/v1/models")["data"]}
        status, text = _post(url + "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": paths["r16"]})
        assert status == 400 and json.loads(text)["error"]["message"].startswith("r: LoRA rank 16")
        status, text = _post(url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": paths["a1"] + "-nope"})
        assert status == 404 and "No adapter found" in json.loads(text)["error"]["message"]
        status, text = _post(url + "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": paths["a2"]})
        assert status == 400 and "has already been loaded" in text
        assert _post(url + "/v1/unload_lora_adapter", {"lora_name": "a2"})[0] == 200
        assert complete("a2", PROMPTS[1])[0] == 404
        assert _post(url + "/v1/unload_lora_adapter", {"lora_name": "a2"})[0] == 404
    assert engine.list_loras() == {1}


def _serve(*argv):
    """`python -m jaxllm.serve ...` on a free port; (process, base url or None if it exited, its log)."""
    import subprocess
    import sys
    import threading

    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxllm.serve", *argv, "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log, ready = [], threading.Event()
    url = []

    def read():
        for line in proc.stdout:
            log.append(line)
            if "API server ready on" in line:
                url.append("http://127.0.0.1:" + line.split("API server ready on ")[1].split()[0].rsplit(":", 1)[1])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(300)
    return proc, (url[0] if url else None), log


def test_python_m_jaxllm_serve_with_lora_modules_and_the_openai_client(setup):
    """The README's command, as a user runs it: adapters from --lora-modules answer the openai client by name."""
    import openai

    base, paths, refs = setup
    flags = [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--dtype",
        "float32",
        "--num-gpu-blocks-override",
        "96",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "64",
        "--block-size",
        "8",
        "--max-model-len",
        "128",
        "--enforce-eager",
        "--served-model-name",
        "base",
        "--return-tokens-as-token-ids",
    ]
    # a bad adapter folder stops the command before the model loads, naming the module
    proc, url, log = _serve(base, *flags, "--lora-modules", f"nope={paths['a1']}-missing")
    assert proc.wait(60) != 0 and url is None
    assert f"--lora-modules nope={paths['a1']}-missing: No adapter found" in "".join(log)
    assert "KV cache size" not in "".join(log)  # (logged while the engine is built)

    proc, url, log = _serve(
        base,
        *flags,
        "--lora-modules",
        f"a1={paths['a1']}",
        json.dumps({"name": "a3", "path": paths["a3"], "base_model_name": "base"}),
    )
    try:
        assert url is not None, "".join(log)
        assert "KV cache size" in "".join(log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "a1", "a3"}
        assert cards["a1"].parent == "base" and cards["a1"].root == paths["a1"] and cards["base"].parent is None

        def tokens(model, prompt):
            c = client.completions.create(
                model=model, prompt=prompt, max_tokens=N_OUT, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
            )
            assert c.model == model
            return [int(t.split(":")[1]) for t in c.choices[0].logprobs.tokens]

        for name in ("a1", "a3", "base"):
            assert tokens(name, PROMPTS[0]) == refs[None if name == "base" else name][0], name
        chat = client.chat.completions.create(model="a3", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.model == "a3" and chat.choices[0].message.content is not None
        with pytest.raises(openai.NotFoundError, match="The model `a2` does not exist"):
            tokens("a2", PROMPTS[0])
    finally:
        proc.terminate()
        proc.wait(60)
