"""One of the processes of tests/test_sharding_multihost.py: tp over the devices of 2 CPU processes; then pp 2 with
one stage per process, whose other-stage weights and KV caches must be made without a jit on the other
process's devices (the GPU client refuses one)."""

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
        check_remote_stage(cfg)
        from jaxllm.distributed import shutdown

        shutdown()


def check_remote_stage(cfg) -> None:
    """pp 2 with one stage per process: dummy weights and KV caches of the other process's stage are made without
    a jit placed only on its devices. A GPU client refuses such a jit ("Argument 0 has 1 buffers, but executable
    expects 0 computations"); the CPU client runs it, so jax.jit refuses it here as the GPU would."""
    import jax

    from jaxllm.models.loader import abstract_weights, load_params
    from jaxllm.sharding import ParallelConfig, make_kv_caches

    real_jit = jax.jit

    def gpu_like_jit(fun, *args, out_shardings=None, **kwargs):
        leaves = jax.tree.leaves(out_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        if leaves and not any(s.addressable_devices for s in leaves):
            raise AssertionError("a jit placed only on another process's devices (refused on GPUs)")
        return real_jit(fun, *args, out_shardings=out_shardings, **kwargs)

    mesh = ParallelConfig(2, 2).make_mesh()
    jax.jit = gpu_like_jit
    try:
        params = load_params("", cfg, mesh, load_format="dummy", seed=1)
        kv = make_kv_caches(cfg, mesh, 8, 4)
    finally:
        jax.jit = real_jit
    mine = jax.process_index()
    for layer, want in zip(params["layers"], abstract_weights(cfg, mesh)["layers"], strict=True):
        for x, w in zip(jax.tree.leaves(layer), jax.tree.leaves(want), strict=True):
            assert (x.shape, x.dtype, x.sharding) == (w.shape, w.dtype, w.sharding)
    local = [bool(k.addressable_shards) for k, _ in kv]
    assert local == [i == mine for i in range(2)], local  # layer i on stage i (one layer per stage)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
