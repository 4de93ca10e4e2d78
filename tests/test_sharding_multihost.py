"""Multi-host: 2 local CPU processes (2 devices each) joined by jax.distributed (gloo collectives) run a
tp=4 forward whose logits equal one process at tp=1; the workers also check pp 2 dummy weights over the two
processes (tests/_multihost_worker.py: check_remote_stage)."""

import os
import socket
import subprocess
import sys

import numpy as np

WORKER = os.path.join(os.path.dirname(__file__), "_multihost_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices):
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
    )
    return env


def test_two_processes_tp4_equal_single(tmp_path):
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(port), str(i), "2", str(tmp_path / f"p{i}.npy")],
            env=_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    single = subprocess.run(
        [sys.executable, WORKER, "0", "0", "1", str(tmp_path / "single.npy")],
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert single.returncode == 0, single.stdout + single.stderr
    ref = np.load(tmp_path / "single.npy")
    for i in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"p{i}.npy"), ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
