"""The engine over two processes (jax.distributed on loopback, gloo collectives, 4 simulated CPU devices each):
greedy tokens at tp 8, pp 2 (one stage per process) and tp 2 x pp 2, with preemption and prefix caching, equal
one process's; the server on process 0 answers the openai client while process 1 runs headless; killing
process 1 mid-request fails the request with an error naming it and process 0 exits non-zero, in bounded time.
One pair of processes runs all of it (tests/_multihost_engine.py). Joining and shutdown: test_multihost_faults.py.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai

from tests._multihost_engine import AGAIN, ENGINE, LAYOUTS, MAX_TOKENS, PROMPTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_multihost_engine.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int = 4) -> dict:
    return dict(
        os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
    )


def tiny_model_8_heads(out_dir: str) -> str:
    """A tiny Llama with 8 query heads (tp 8) and 2 kv heads (repeated at tp 8), 2 layers (one per stage)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.tiny_models import save_checkpoint, save_tiny_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    save_checkpoint(AutoModelForCausalLM.from_config(cfg).eval(), "llama", out_dir)
    save_tiny_tokenizer(out_dir, 128)
    return out_dir


def wait_for(cond, timeout: float, what: str, procs=()):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process exited with {p.returncode}")
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_two_processes(tmp_path):
    from jaxllm import LLM, SamplingParams

    model = tiny_model_8_heads(str(tmp_path / "model"))
    port, http_port, out = free_port(), free_port(), tmp_path / "results.json"
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT, model, str(port), str(i), str(out), str(http_port)],
            env=process_env(),
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        # meanwhile, one process, tp 1, and KV room for everything (no preemption)
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        llm = LLM(model, **(ENGINE | dict(num_gpu_blocks_override=64)))
        ref = [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS + AGAIN], greedy, use_tqdm=False)
        ]
        del llm
        wait_for(out.exists, 600, "offline layouts", procs)
        results = json.loads(out.read_text())
        for tp, pp in LAYOUTS:
            r = results[f"{tp}x{pp}"]
            assert r["tokens"] == ref, (tp, pp)
            assert r["preemptions"] > 0 and r["prefix_hits"] > 0, (tp, pp, r)
        for name, key in (("speculative_config", "speculation"), ("enable_lora", "lora")):
            assert results[key].startswith(f"{name} is not supported on an engine over several processes"), results

        base = f"http://127.0.0.1:{http_port}"
        wait_for(lambda: _health(base) == 200, 300, "server ready", procs)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(
            model="tiny",
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert r.choices[0].model_extra["token_ids"] == ref[0]

        # process 1 dies while a request streams: the request fails naming it; process 0 exits with 1
        body = {"model": "tiny", "prompt": [3], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(
            base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            lines = (line.decode() for line in resp)
            first = next(line for line in lines if line.startswith("data: "))
            assert '"text"' in first
            procs[1].send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            rest = "".join(lines)
        assert "Process 1 of 2 left the jax.distributed cluster" in rest, rest[-2000:]
        assert procs[0].wait(timeout=60) == 1
        assert time.monotonic() - t0 < 30
    except BaseException:
        for i, f in enumerate(logs):
            f.flush()
            print(f"---- process {i} ----\n" + (tmp_path / f"p{i}.log").read_text()[-8000:])
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()


def _health(base: str) -> int:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0
