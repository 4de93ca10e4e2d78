import os

# 8 simulated CPU devices for the sharding tests; must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """LLMEngine freezes the process's objects out of the collector (as vLLM does, once per server process).
    Many engines are built in one test process: unfreeze after each test so cyclic garbage of finished tests
    is collected."""
    yield
    gc.unfreeze()
