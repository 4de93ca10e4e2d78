import os

# 8 simulated CPU devices for the sharding tests; must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _unfreeze_gc():
    """LLMEngine collects garbage and freezes the process's objects out of the collector once it is built (as
    vLLM does, once per server process). Many engines are built in one test process: after each test module,
    unfreeze, so the garbage of its engines is collected. (Per test, each engine's collection walked the whole
    process again: +9 s over test_engine.py and test_async_engine.py.)"""
    yield
    gc.unfreeze()
