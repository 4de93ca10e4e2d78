"""Multi-host: 2 local CPU processes (2 devices each) joined by jax.distributed (gloo collectives) run a
tp=4 forward whose logits equal one process at tp=1; the workers also check pp 2 over the two processes, dummy weights
and a GPTQ checkpoint converted to Orbax (tests/_multihost_worker.py: check_remote_stage)."""

import json
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


def _gptq_checkpoint(root) -> None:
    """root/gptq: a 2-layer Llama as GPTQ v1 int4 act-order asym, groups of 32 (random integers, scales and zero
    points; one kv head, so tp 2 repeats it at restore), and root/orbax, that folder converted."""
    from safetensors.numpy import save_file

    from convert import convert_checkpoint
    from jaxllm.models.quant import pack_int

    D, F, V, N, K, L, G = 64, 96, 128, 4, 1, 2, 32
    H = D // N
    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": rng.normal(0, 0.02, (V, D)),
        "model.norm.weight": rng.uniform(0.5, 1.5, D),
        "lm_head.weight": rng.normal(0, 0.02, (V, D)),
    }
    projs = {"self_attn.q_proj": (D, N * H), "self_attn.k_proj": (D, K * H), "self_attn.v_proj": (D, K * H)}
    projs |= {"self_attn.o_proj": (N * H, D), "mlp.gate_proj": (D, F), "mlp.up_proj": (D, F), "mlp.down_proj": (F, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = rng.uniform(0.5, 1.5, D)
        tensors[p + "post_attention_layernorm.weight"] = rng.uniform(0.5, 1.5, D)
        orders = {}  # q / k / v share one act-order, gate / up another (jaxllm fuses them), as GPTQ's do
        for name, (n_in, n_out) in projs.items():
            shared = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj"}.get(name, name)
            shared = {"mlp.up_proj": "mlp.gate_proj"}.get(shared, shared)
            tensors[p + name + ".qweight"] = pack_int(rng.integers(0, 16, (n_in, n_out)), 4)
            tensors[p + name + ".qzeros"] = pack_int(rng.integers(0, 16, (n_out, n_in // G)), 4).T.copy()
            tensors[p + name + ".scales"] = rng.uniform(0.001, 0.01, (n_in // G, n_out)).astype(np.float16)
            order = orders.setdefault(shared, rng.permutation(np.arange(n_in) // G))
            tensors[p + name + ".g_idx"] = order.astype(np.int32)
    tensors = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in tensors.items()}
    hf = root / "gptq"
    hf.mkdir()
    save_file(tensors, str(hf / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": F,
        "num_hidden_layers": L,
        "num_attention_heads": N,
        "num_key_value_heads": K,
        "torch_dtype": "float32",
        "quantization_config": dict(
            quant_method="gptq", bits=4, group_size=G, desc_act=True, sym=False, checkpoint_format="gptq"
        ),
    }
    (hf / "config.json").write_text(json.dumps(config))
    convert_checkpoint(str(hf), str(root / "orbax"), progress=False)


def test_two_processes_tp4_equal_single(tmp_path):
    _gptq_checkpoint(tmp_path)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(port), str(i), "2", str(tmp_path / f"p{i}.npy"), str(tmp_path)],
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
