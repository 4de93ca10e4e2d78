"""Start-up and shutdown of a multi-process engine: a process that never joins fails every process's start-up in
bounded time with its id in the message (jaxllm.distributed.join, in threads here); `jaxllm serve` on two
processes (process 1 --headless) stops both when process 0 gets SIGTERM."""

import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxllm.distributed import join
from server.args import parse_args
from tests.test_multihost_engine import _health, free_port, process_env, tiny_model_8_heads, wait_for


def _join_all(n: int, ids, timeout: float, num_processes=None) -> dict:
    port, errors = free_port(), {}

    def run(i):
        try:
            join(f"localhost:{port}", (num_processes or {}).get(i, n), i, timeout)
            errors[i] = None
        except RuntimeError as e:
            errors[i] = str(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in ids]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    errors["seconds"] = time.monotonic() - t0
    return errors


def test_join():
    assert _join_all(3, [0, 1, 2], 5) | {"seconds": 0} == {0: None, 1: None, 2: None, "seconds": 0}
    got = _join_all(3, [0, 1], 1.0)
    assert got[0] == got[1] and got[0].startswith("Process 2 of 3 did not join within 1 s"), got
    assert got["seconds"] < 8
    got = _join_all(2, [0, 1], 5, num_processes={1: 3})
    assert got[0] == got[1] == "Process 1 was started with --num-processes 3, process 0 with 2.", got
    got = _join_all(2, [1], 0.5)
    assert got[1].startswith("Process 1: process 0 did not answer at localhost:"), got


def test_several_processes_without_an_address_meet_on_this_hosts_loopback(monkeypatch):
    """--num-processes / --nnodes 2 without --coordinator-address / --master-addr (vLLM's 127.0.0.1 default) joins at
    DEFAULT_COORDINATOR; it was ignored (one process served alone) and a headless process failed after loading."""
    import jax

    from jaxllm import distributed

    for var in distributed.ENV.values():
        monkeypatch.delenv(var, raising=False)
    calls = []
    monkeypatch.setattr(distributed, "join", lambda *a: calls.append(("join", *a)))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append(("initialize", *a)))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    assert not distributed.initialize(None, 1, 0) and not distributed.initialize() and calls == []
    assert distributed.initialize(None, 2, 1, timeout=5)
    assert calls == [
        ("join", distributed.DEFAULT_COORDINATOR, 2, 1, 5),
        ("initialize", distributed.DEFAULT_COORDINATOR, 2, 1),
    ]
    args = parse_args(["m", "--nnodes", "2"])  # vLLM's --node-rank defaults to 0
    assert (args.num_processes, args.process_id, args.coordinator_address) == (2, 0, None)
    args = parse_args(["m", "--nnodes", "2", "--node-rank", "1", "--headless"])
    assert (args.num_processes, args.process_id, args.headless) == (2, 1, True)


def test_headless_flags():
    argv = ["m", "--coordinator-address", "h:1", "--num-processes", "2"]
    assert parse_args(argv + ["--process-id", "1", "--headless"]).headless
    for bad in (["m", "--headless"], argv + ["--process-id", "0", "--headless"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_sigterm_on_process_0_stops_the_workers(tmp_path):
    model = tiny_model_8_heads(str(tmp_path / "model"))
    port, http_port = free_port(), free_port()
    flags = [
        "--dtype",
        "float32",
        "--max-model-len",
        "64",
        "--num-gpu-blocks-override",
        "16",
        "--block-size",
        "8",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "16",
        "--enforce-eager",
        "-tp",
        "8",
        "--disable-access-log",
        "--distributed-timeout",
        "60",
        "--coordinator-address",
        f"localhost:{port}",
        "--num-processes",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
    ]
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxllm.serve", model, *flags, "--process-id", str(i)]
            + (["--headless"] if i else []),
            env=process_env(),
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        wait_for(lambda: _health(f"http://127.0.0.1:{http_port}") == 200, 300, "server ready", procs)
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
        assert "Process 0 shut down the engine" in (tmp_path / "p1.log").read_text()
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
