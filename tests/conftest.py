import atexit
import os
import shutil
import tempfile

# 8 simulated CPU devices for the sharding tests; must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Under pytest-xdist the workers share the cores. torch's intra-op pool (OpenMP, whose idle threads spin) sized to
# the whole machine in every worker made a torch-bound test take 21.6 s in a CI run against 1.5 s alone; each
# worker gets its share of the cores instead (set before torch is imported).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))


def _isolate_caches() -> str:
    """Tests never read or write the user's caches (~/.cache/jaxllm: the compilation and executable caches that
    `python -m jaxllm.serve` fills, the converted demo model, bench's model folders; Hugging Face's and anything
    else kept under XDG_CACHE_HOME). Each test process gets its own empty cache root, removed at exit, unless
    JAXLLM_TEST_CACHE_ROOT names one to reuse (tests/test_cache_isolation.py runs key tests twice against one
    pre-filled folder that way). Tests that exercise a shared cache on purpose set up their own folders."""
    root = os.environ.get("JAXLLM_TEST_CACHE_ROOT")
    if not root:
        root = tempfile.mkdtemp(prefix="jaxllm-tests-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.environ["JAXLLM_CACHE_ROOT"] = root
    os.environ["XDG_CACHE_HOME"] = os.path.join(root, "xdg")
    os.environ["HF_HOME"] = os.path.join(root, "huggingface")
    os.environ["HF_HUB_OFFLINE"] = "1"  # tests make their models; nothing is fetched from a hub
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # XLA's cache is set per engine from compilation_cache_dir
    return root


CACHE_ROOT = _isolate_caches()

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
