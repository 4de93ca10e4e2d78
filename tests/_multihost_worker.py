"""One of the processes of tests/test_sharding_multihost.py: tp over the devices of 2 CPU processes; then pp 2 with
one stage per process, whose other-stage weights (dummy, and a GPTQ checkpoint converted to Orbax) and KV caches
must be made without a jit on the other process's devices (the GPU client refuses one)."""

import os
import sys

import numpy as np


def main(port: str, process_id: int, num_processes: int, out: str, quant_root: str = ""):
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
        check_remote_stage(cfg, quant_root)
        from jaxllm.distributed import shutdown

        shutdown()


def check_remote_stage(cfg, quant_root: str) -> None:
    """pp 2 with one stage per process: dummy weights, the converted GPTQ checkpoint of quant_root/orbax (its packed
    leaves laid out for the kernels at restore) and KV caches of the other process's stage are made without a jit
    placed only on its devices. A GPU client refuses such a jit ("Argument 0 has 1 buffers, but executable expects 0
    computations"); the CPU client runs it, so jax.jit refuses it here as the GPU would. This process's stage of the
    restored checkpoint equals the same stage loaded from the HF GPTQ folder (quant_root/gptq)."""
    import jax

    from jaxllm.config import ModelConfig
    from jaxllm.models.loader import abstract_weights, load_params
    from jaxllm.sharding import ParallelConfig, make_kv_caches

    real_jit = jax.jit

    def gpu_like_jit(fun, *args, out_shardings=None, **kwargs):
        leaves = jax.tree.leaves(out_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        leaves = [s for s in leaves if isinstance(s, jax.sharding.Sharding)]  # not PartitionSpecs (jax's own jits)
        if leaves and not any(s.addressable_devices for s in leaves):
            raise AssertionError("a jit placed only on another process's devices (refused on GPUs)")
        return real_jit(fun, *args, out_shardings=out_shardings, **kwargs)

    mesh = ParallelConfig(2, 2).make_mesh()
    qcfg = ModelConfig.from_hf(os.path.join(quant_root, "gptq"), dtype="float32")
    jax.jit = gpu_like_jit
    try:
        params = load_params("", cfg, mesh, load_format="dummy", seed=1)
        kv = make_kv_caches(cfg, mesh, 8, 4)
        restored = load_params(os.path.join(quant_root, "orbax"), qcfg, mesh)
        from_hf = load_params(os.path.join(quant_root, "gptq"), qcfg, mesh)
    finally:
        jax.jit = real_jit
    _check_stage_leaves(params, abstract_weights(cfg, mesh))
    _check_stage_leaves(restored, abstract_weights(qcfg, mesh), from_hf)
    mine = jax.process_index()
    local = [bool(k.addressable_shards) for k, _ in kv]
    assert local == [i == mine for i in range(2)], local  # layer i on stage i (one layer per stage)


def _check_stage_leaves(params, want, ref=None) -> None:
    """Every leaf has abstract_weights' shape, dtype and sharding; this process holds data of its own stage's leaves
    only (equal to ref's there), the other stage's leaves have no data here."""
    import jax

    leaves, want_leaves = jax.tree.leaves(params), jax.tree.leaves(want)
    refs = jax.tree.leaves(ref) if ref is not None else [None] * len(leaves)
    assert len(leaves) == len(want_leaves) == len(refs)
    for x, w, r in zip(leaves, want_leaves, refs, strict=True):
        assert (x.shape, x.dtype, x.sharding) == (w.shape, w.dtype, w.sharding)
        assert bool(x.addressable_shards) == bool(x.sharding.addressable_devices)
        if r is not None:
            assert (r.shape, r.dtype, r.sharding) == (w.shape, w.dtype, w.sharding)
            for a, b in zip(x.addressable_shards, r.addressable_shards, strict=True):
                assert a.device == b.device
                np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    assert {bool(x.addressable_shards) for x in leaves} == {True, False}  # both a local and a remote stage


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
