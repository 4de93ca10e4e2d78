import atexit
import collections
import os
import shutil
import tempfile

# 8 simulated CPU devices for the sharding tests; must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The CPU backend's LLVM at -O0 (XLA's HLO passes, fusion and layouts, run as always): the tests' programs are small
# and most are compiled once, so compiling dominates their time. tests/test_engine.py on the 2-core VM, one after the
# other: 155.8 s (user 240 s) at the default level, 113.6 s (user 160 s) at 0. Subprocesses started with os.environ
# inherit it (tests/test_multihost_engine.process_env sets XLA_FLAGS of its own).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
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


# --- xdist scheduling (the README's `-n 2`) --------------------------------------------------------------------------
# xdist's default "load" scheduling hands each worker runs of consecutive tests and splits files between workers, so
# a file's module / session fixtures were built on both: test_quant.py's `ckpts` (the quantizers' subprocess, 33 s in
# CI) twice in every run. Here a test file is one unit of work (its fixtures built once), the units handed out
# longest first so the two workers finish close together. The seconds are a full run's per-file totals on the
# 2-core VM (other work running, so ~1.7x CI's): only their order matters, and a file not listed counts as short.
# Files in _SPLIT_FILES have no shared fixtures and go test by test. An explicit --dist keeps xdist's own schedulers.
_FILE_SECONDS = {
    "test_bench.py": 749,
    "test_kernels.py": 707,
    "test_quant.py": 277,
    "test_engine.py": 274,
    "test_quant_nk.py": 258,
    "test_cache_isolation.py": 211,
    "test_pipeline_engine.py": 182,
    "test_quant_model.py": 180,
    "test_quant_kernels.py": 168,
    "test_spec_drafters.py": 164,
    "test_model_parity.py": 148,
    "test_data_parallel.py": 130,
    "test_lora_engine.py": 118,
    "test_exec_cache.py": 116,
    "test_multihost_engine.py": 104,
    "test_rope_scaling.py": 100,
    "test_structured.py": 98,
    "test_quant_moe.py": 96,
    "test_sampler.py": 95,
    "test_moe_kernels.py": 92,
    "test_models_engine.py": 87,
    "test_moe.py": 61,
    "test_demo_engine.py": 59,
    "test_bench_peers.py": 50,
    "test_spec_engine.py": 48,
    "test_lora.py": 44,
    "test_sharding_multihost.py": 41,
    "test_server_final_text.py": 39,
    "test_quant_memory.py": 36,
    "test_sharding.py": 32,
}
_SPLIT_FILES = {"test_cache_isolation.py"}  # two child pytest runs of their own: one a worker


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load" or any(a.startswith("--dist") for a in config.invocation_params.args):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        """LoadScopeScheduling with a file (or a test of a _SPLIT_FILES file) as the unit, longest units first."""

        _ordered = False

        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return nodeid if os.path.basename(path) in _SPLIT_FILES else path

        def _assign_work_unit(self, node):
            if not self._ordered:  # the first call: the whole collection is in the queue
                self._ordered = True
                units = list(self.workqueue.items())
                per_file = collections.Counter(_file_of(scope) for scope, _ in units)
                self.workqueue.clear()
                for scope, work in sorted(
                    units, key=lambda u: -_FILE_SECONDS.get(_file_of(u[0]), 5.0) / per_file[_file_of(u[0])]
                ):
                    self.workqueue[scope] = work
            super()._assign_work_unit(node)

    return FileScheduling(config, log)


def _file_of(scope: str) -> str:
    return os.path.basename(scope.split("::", 1)[0])
