"""One of the processes of tests/test_sharding_multihost.py: tp over the devices of 2 CPU processes."""

import sys

import numpy as np


def main(port: str, process_id: int, num_processes: int, out: str):
    from jaxllm.distributed import initialize

    if num_processes > 1:
        assert initialize(f"localhost:{port}", num_processes, process_id)
    import jax
    import jax.numpy as jnp

    from jaxllm.config import ModelConfig
    from jaxllm.models.attention import AttentionConfig, AttentionMetadata
    from jaxllm.models.decoder import compute_logits, forward
    from jaxllm.models.loader import load_params
    from jaxllm.sharding import ParallelConfig, make_kv_caches

    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        dtype="float32",
    )
    assert jax.process_count() == num_processes and jax.device_count() == 2 * num_processes - (num_processes == 1)
    tp = jax.device_count() if num_processes > 1 else 1
    mesh = ParallelConfig(tp, 1).make_mesh()
    params = load_params("", cfg, mesh, load_format="dummy", seed=1)
    kv = make_kv_caches(cfg, mesh, 8, 4)
    T = 6
    meta = AttentionMetadata(
        np.arange(T, dtype=np.int32),
        np.arange(T, dtype=np.int32) + 4,
        np.array([T], np.int32),
        np.array([0, T], np.int32),
        np.array([[1, 2, 3]], np.int32),
        False,
    )
    attn = AttentionConfig(mesh=mesh)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    @jax.jit
    def step(params, kv, tok, meta):
        kv, h = forward(params, kv, tok, meta, cfg, attn)
        return jax.lax.with_sharding_constraint(compute_logits(params, h, cfg), rep)

    logits = step(params, kv, jnp.array([5, 9, 2, 77, 3, 14], jnp.int32), meta)
    np.save(out, np.asarray(logits.addressable_data(0)))
    if num_processes > 1:
        from jaxllm.distributed import shutdown

        shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
