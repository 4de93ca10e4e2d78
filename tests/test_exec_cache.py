"""The executable cache (jaxllm/engine/exec_cache.py): a second start with the same cache loads every step
variant without tracing and gives the same tokens; corrupt or mismatched entries fall back to compiling."""

import hashlib
import logging
import os
import pickle
import subprocess
import sys

import jax
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine import exec_cache, setup, step_fns
from jaxllm.engine import programs as programs_mod
from tests.tiny_models import make_tiny_model_dir

PROMPTS = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 3, 83, 27], [101, 7], [8] * 19, [3]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)  # variants after warm-up


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny")))[0]


@pytest.fixture
def traces(monkeypatch):
    """Counts traces of the step function (forward runs once per trace)."""
    count = {"n": 0}
    forward = step_fns.forward

    def counting(*a, **k):
        count["n"] += 1
        return forward(*a, **k)

    monkeypatch.setattr(step_fns, "forward", counting)
    return count


@pytest.fixture(autouse=True)
def no_jax_cache(tmp_path_factory):
    """JAX's persistent cache is process-wide and may already hold these programs (an earlier run on this
    machine wrote the suite's default directory): each test here reads an empty one of its own and writes
    nothing, so JAX's cache never answers and every compile is XLA's (the executable cache stores only those)."""
    from jax._src import compilation_cache

    old_dir = jax.config.jax_compilation_cache_dir
    old_min = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", old_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old_min)
    compilation_cache.reset_cache()


def start(model_dir, cache_dir, monkeypatch):
    # JAX's in-memory caches outlive a test: an earlier test's compile of the same program would be handed
    # out again and counted as JAX's cache's (not stored), so every start begins from empty caches.
    jax.clear_caches()
    monkeypatch.setattr(setup, "_executable_cache_dir", lambda args: str(cache_dir))
    return LLM(
        model_dir,
        dtype="float32",
        num_gpu_blocks_override=72,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=8,
        max_model_len=64,
        enforce_eager=False,
        compilation_cache_dir=None,
    )


def run(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    lp = llm.generate({"prompt_token_ids": PROMPTS[0]}, LOGPROBS, use_tqdm=False)[0].outputs[0]
    return [o.outputs[0].token_ids for o in outs], (lp.token_ids, [sorted(d) for d in lp.logprobs])


def counters(llm):
    c = llm.llm_engine.runner.programs.exec_cache
    return dict(hits=c.hits, misses=c.misses, errors=c.errors, stores=c.stores, from_jax_cache=c.from_jax_cache)


def test_second_start_loads_without_tracing(tiny, tmp_path, monkeypatch, traces):
    first = start(tiny, tmp_path, monkeypatch)
    n = len(first.llm_engine.runner.programs.variants())
    assert counters(first) == dict(hits=0, misses=n, errors=0, stores=n, from_jax_cache=0)
    assert traces["n"] == n
    ref = run(first)  # the logprobs request compiles (and stores) a sampler and, in the background, its steps
    runner = first.llm_engine.runner
    runner.programs.wait_for_background_compiles()
    extra, extra_steps = runner.programs.num_compiles_after_warmup, len(runner.programs.compiled) - n
    assert extra_steps and extra > extra_steps and counters(first)["stores"] == n + extra
    del first

    jax.clear_caches()  # so a start that needed the step would trace it again
    traces["n"] = 0
    second = start(tiny, tmp_path, monkeypatch)
    assert counters(second) == dict(hits=n, misses=0, errors=0, stores=0, from_jax_cache=0)
    assert traces["n"] == 0 and len(second.llm_engine.runner.programs.compiled) == n
    kv = second.llm_engine.runner.kv_caches[0][0]
    assert run(second) == ref  # sampling and the post-warm-up variants work when loaded
    assert kv.is_deleted()  # the KV cache is still donated
    # the logprobs request's steps load from the cache before they run: no sampler-only steps this time
    assert counters(second)["hits"] == n + extra_steps and traces["n"] == 0


def test_warm_up_compiles_while_the_weights_load_and_the_kv_cache_is_unallocated(tiny, tmp_path, monkeypatch):
    """The steps are compiled against abstract weights while the weights load on a thread, and against the KV
    cache's shapes with its memory free (parallel compiles autotune on device memory); then the loaded weights
    are bound and the cache allocated, with the shapes and shardings the steps were compiled for."""
    from jaxllm.engine.programs import StepPrograms
    from jaxllm.engine.runner import ModelRunner

    seen, events = [], []
    compile_variants, allocate_kv = StepPrograms.compile_variants, ModelRunner._allocate_kv

    def spy(self, params, prev_tokens, workers=None, weights=None):
        assert weights is not None  # a Future of the params
        seen.extend(type(a) for a in jax.tree.leaves((params, self.kv_specs)))
        events.append("compile")
        return compile_variants(self, params, prev_tokens, workers, weights)

    def allocate_spy(self):
        events.append("allocate")
        return allocate_kv(self)

    monkeypatch.setattr(StepPrograms, "compile_variants", spy)
    monkeypatch.setattr(ModelRunner, "_allocate_kv", allocate_spy)
    llm = start(tiny, tmp_path, monkeypatch)
    runner = llm.llm_engine.runner
    assert seen and set(seen) == {jax.ShapeDtypeStruct}
    assert events == ["compile", "allocate"]  # the KV cache's memory is allocated after the compiles
    assert all(isinstance(a, jax.Array) and not a.is_deleted() for a in jax.tree.leaves(runner.params))
    assert all(
        isinstance(a, jax.Array) and not a.is_deleted() and a.shape[1] == 72 for a in jax.tree.leaves(runner.kv_caches)
    )
    assert run(llm)[0]  # the compiled steps run on the loaded weights and the new cache


def test_a_failing_weight_load_stops_warm_up_early(tiny, tmp_path, monkeypatch, traces):
    """A checkpoint that fails to load (on the weights' thread) is reported as itself, and the variants not
    yet traced are not traced for nothing."""
    from jaxllm.models import loader

    def broken(*a, **k):
        raise ValueError("a broken checkpoint")

    monkeypatch.setattr(loader, "load_params", broken)
    with pytest.raises(ValueError, match="a broken checkpoint"):
        start(tiny, tmp_path, monkeypatch)
    assert traces["n"] <= 1  # 6 traces without stopping (the 9 variants share some)


def test_set_params_rejects_weights_the_steps_were_not_compiled_for(tiny):
    from jaxllm.config import ModelConfig, read_hf_config
    from jaxllm.engine.runner import ModelRunner
    from jaxllm.models.loader import abstract_weights, load_params
    from jaxllm.sharding import ParallelConfig

    cfg = ModelConfig.from_hf(read_hf_config(tiny), dtype="float32")
    mesh = ParallelConfig(1, 1).make_mesh()
    runner = ModelRunner(cfg, abstract_weights(cfg, mesh), mesh, num_blocks=8, block_size=8, max_model_len=64)
    assert not runner.has_weights and isinstance(runner.kv_caches[0][0], jax.ShapeDtypeStruct)
    params = load_params(tiny, cfg, mesh)
    wrong = jax.tree.map(lambda a: a.astype("bfloat16"), params)
    with pytest.raises(ValueError, match="differ from those the step programs were compiled for"):
        runner.set_params(wrong)
    runner.set_params(params)
    assert runner.has_weights and runner._head["lm_head"] is params["lm_head"]


def test_corrupt_and_mismatched_entries_fall_back(tiny, tmp_path, monkeypatch, traces, caplog):
    first = start(tiny, tmp_path, monkeypatch)
    ref = run(first)
    r = first.llm_engine.runner
    r.programs.wait_for_background_compiles()  # (no trace of the first engine may land in the second's count)
    programs = r.programs
    keys = {v: programs._cache_key(v, programs.dummy_args(v, r.params, r.prev_tokens)) for v in programs.variants()}
    del first
    ka, kb, kc = (keys[v] for v in r.programs.variants()[:3])
    a, b, c = map(r.programs.exec_cache.path, (ka, kb, kc))
    # c: b's valid entry relabelled with c's key (digest recomputed): the argument checks, not the key,
    # must catch it.
    with open(b, "rb") as f:
        body = pickle.loads(f.read()[len(exec_cache._MAGIC) + 32 :])
    body["key"] = kc
    relabelled = pickle.dumps(body)
    os.replace(c, b)  # b: c's entry under b's key
    with open(c, "wb") as f:
        f.write(exec_cache._MAGIC + hashlib.sha256(relabelled).digest() + relabelled)
    with open(a, "r+b") as f:  # a: one byte of the body flipped
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte ^ 0xFF]))

    jax.clear_caches()
    traces["n"] = 0
    with caplog.at_level(logging.WARNING, logger="jaxllm.engine.exec_cache"):
        second = start(tiny, tmp_path, monkeypatch)
    n = len(second.llm_engine.runner.programs.variants())
    assert counters(second) == dict(hits=n - 3, misses=0, errors=3, stores=3, from_jax_cache=0)
    assert traces["n"] == 3
    assert sum("compiling instead" in rec.getMessage() for rec in caplog.records) == 3
    assert run(second) == ref


def test_executables_from_jax_cache_are_not_stored(tmp_path):
    """JAX's persistent cache hands back deserialized executables, which on CPU do not survive a second
    serialization; compile_and_store notices (jax.monitoring's cache-hit event, then the executable's
    identity when JAX's in-memory cache returns it again) and skips them. In its own process, as JAX's cache
    directory is process-wide."""
    script = f"""
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", {str(tmp_path / "xla")!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jaxllm.engine.exec_cache import ExecutableCache

def f(x):
    return x + jnp.arange(x.shape[0]) * 2

cache = ExecutableCache({str(tmp_path / "exe")!r}, jax.devices()[:1])
x = np.ones(8, np.int32)
key = cache.key("f", (x,), ())
cache.compile_and_store(key, jax.jit(f).lower(x).compile)  # compiled by XLA: stored
jax.clear_caches()
cache.compile_and_store("other", jax.jit(f).lower(x).compile)  # from JAX's cache: not stored
cache.compile_and_store("again", jax.jit(f).lower(x).compile)  # the same, from JAX's in-memory cache
print(cache.stores, cache.from_jax_cache, cache.load(key, (x,))(x).tolist())
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "1 2 [1, 3, 5, 7, 9, 11, 13, 15]"


def test_jax_cache_copies_from_untracked_compiles_are_not_stored(tmp_path):
    """An executable JAX's persistent cache supplied to a compile nobody tracked (a runner without an
    executable cache, in the same process) comes back from JAX's in-memory cache, with no event, when a step
    with an executable cache compiles the same program: it is not stored (a stored copy fails to run with
    "Function ... not found": test engines' steps broke for every later start)."""
    script = f"""
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", {str(tmp_path / "xla")!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jaxllm.engine.exec_cache import ExecutableCache

def f(x):
    return x + jnp.arange(x.shape[0]) * 2

x = np.ones(8, np.int32)
jax.jit(f).lower(x).compile()  # compiled by XLA, written to JAX's cache
jax.clear_caches()
jax.jit(f).lower(x).compile()  # from JAX's cache, untracked
cache = ExecutableCache({str(tmp_path / "exe")!r}, jax.devices()[:1])
key = cache.key("f", (x,), ())
print(cache.compile_and_store(key, jax.jit(f).lower(x).compile)(x).tolist())  # JAX's in-memory copy
print(cache.stores, cache.from_jax_cache, cache.load(key, (x,)))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-3:-1] == ["[1, 3, 5, 7, 9, 11, 13, 15]", "0 1 None"]


def test_gpu_step_compile_options(tmp_path, monkeypatch):
    """On a GPU, steps with prompt tokens are compiled with command buffers off and decode-only steps of
    CUBLAS_MIN_DECODE_SEQS+ sequences with Triton GEMMs off (programs.compile_options); smaller decode-only steps
    and every step off GPU get no options. The options are ones this jaxlib knows, and they are part of the
    cache key, so an executable compiled with other options is never loaded for the step."""
    import types

    import jax.numpy as jnp

    from jaxllm.engine.sampler import SamplerFlags

    big = programs_mod.CUBLAS_MIN_DECODE_SEQS
    mixed = programs_mod.StepVariant(64, 8, False, SamplerFlags(), 0)
    small_decode = programs_mod.StepVariant(big // 2, big // 2, True, SamplerFlags(), 0)
    big_decode = programs_mod.StepVariant(big, big, True, SamplerFlags(), 0)
    variants = (mixed, small_decode, big_decode)
    fake = types.SimpleNamespace(
        exec_cache=exec_cache.ExecutableCache(str(tmp_path), jax.devices()), cfg="cfg", attn="attn", drafter=None
    )
    args = (jnp.ones(4),)
    cpu_keys = [programs_mod.StepPrograms._cache_key(fake, v, args) for v in variants]
    assert [programs_mod.compile_options(v) for v in variants] == [{}, {}, {}]

    monkeypatch.setattr(programs_mod.jax, "default_backend", lambda: "gpu")
    options = [programs_mod.compile_options(v) for v in variants]
    assert options == [
        {"xla_gpu_enable_command_buffer": "", "xla_gpu_enable_triton_gemm": False},
        {},
        {"xla_gpu_enable_triton_gemm": False},
    ]
    gpu_keys = [programs_mod.StepPrograms._cache_key(fake, v, args) for v in variants]
    assert gpu_keys[0] != cpu_keys[0] and gpu_keys[1] == cpu_keys[1] and gpu_keys[2] != cpu_keys[2]
    # JAXLLM_DECODE_COMMAND_BUFFER (A/B runs): the decode-only steps' command types, in their keys too
    from jaxllm.engine import xla_options

    monkeypatch.setattr(xla_options, "DECODE_COMMAND_BUFFER", "FUSION,CUBLAS,CUBLASLT,CUDNN")
    no_custom = [programs_mod.compile_options(v) for v in variants]
    assert no_custom[0] == options[0] and no_custom[1] == {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN"
    }
    assert no_custom[2] == {**no_custom[1], "xla_gpu_enable_triton_gemm": False}
    assert programs_mod.StepPrograms._cache_key(fake, small_decode, args) != gpu_keys[1]
    options += no_custom[1:]
    monkeypatch.undo()
    # real XLA options (an unknown name is an INVALID_ARGUMENT at compile time)
    for opts in options:
        exe = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile(compiler_options=opts)
        assert float(exe(jnp.ones(4))[0]) == 2.0


def test_cublas_cutoff_override_from_the_environment():
    """JAXLLM_CUBLAS_MIN_DECODE_SEQS (bench A/B runs) replaces the cutoff when the module loads; a value that is
    not an integer stops the import with an error naming the variable."""
    code = "from jaxllm.engine import xla_options; print(xla_options.CUBLAS_MIN_DECODE_SEQS)"

    def run(value):
        env = dict(os.environ, JAXLLM_CUBLAS_MIN_DECODE_SEQS=value)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)

    assert run("100000").stdout.split() == ["100000"]
    assert run("").stdout.split() == [str(programs_mod.CUBLAS_MIN_DECODE_SEQS)] == ["32"]  # unset or empty: default
    bad = run("many")
    assert bad.returncode != 0 and "JAXLLM_CUBLAS_MIN_DECODE_SEQS='many' is not an integer." in bad.stderr


def test_key_changes_with_the_program_env_overrides(monkeypatch):
    """The JAXLLM_* variables that change a step's program (PROGRAM_ENV: the cuBLAS cutoff, the decode backend, the
    fp8 GEMV, the fp8 dot's output, the fp8 MLP pass, the int4 nk layout) are part of every key's environment, so
    flipping one for an A/B run never loads the other side's executable; other variables are not."""
    devices = jax.devices()[:1]
    for name in exec_cache.PROGRAM_ENV:
        monkeypatch.delenv(name, raising=False)
    base = exec_cache._environment(devices)
    monkeypatch.setenv("JAXLLM_SOMETHING_ELSE", "1")
    assert exec_cache._environment(devices) == base
    assert {
        "JAXLLM_FP8_DOT_BF16",
        "JAXLLM_FP8_NORM",
        "JAXLLM_FP8_SILU_MLP",
        "JAXLLM_INT4_NK",
        "JAXLLM_INT4_NK_WIDE",
    } <= set(exec_cache.PROGRAM_ENV)
    for name in exec_cache.PROGRAM_ENV:
        monkeypatch.setenv(name, "0")
        assert exec_cache._environment(devices) != base, name
        monkeypatch.delenv(name)


def test_every_jaxllm_switch_in_the_code_is_a_program_env_or_known_not_to_change_a_step():
    """Every JAXLLM_* variable the engine's code reads is in PROGRAM_ENV or in the short list of those that change no
    step program (paths, the hub to download from, which program a step picks): a new switch left out of PROGRAM_ENV made A/B runs sharing a cache
    run one side's program twice (stop 51's JAXLLM_FP8_SILU_MLP, stop 60's JAXLLM_ADD_NORM)."""
    import pathlib
    import re

    root = pathlib.Path(exec_cache.__file__).parents[2]
    names = {
        m
        for d in ("jaxllm", "kernels_pallas")
        for f in (root / d).rglob("*.py")
        for m in re.findall(r'"(JAXLLM_[A-Z0-9_]+)"', f.read_text())
    }
    # paths, the hub, and the context length from which decode steps pick their bucket's long-context program (a
    # program of its own, keyed apart by its static metadata: runner.long_decode_from)
    not_programs = {"JAXLLM_CACHE_ROOT", "JAXLLM_USE_MODELSCOPE", "JAXLLM_LONG_DECODE_CONTEXT"}
    assert "JAXLLM_ADD_NORM" in names and len(names) >= 10, names
    assert names - not_programs <= set(exec_cache.PROGRAM_ENV), names - not_programs - set(exec_cache.PROGRAM_ENV)
