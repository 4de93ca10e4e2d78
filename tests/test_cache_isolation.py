"""The suite never reads or writes the user's caches, and its key engine tests pass against a pre-filled cache.

`python -m jaxllm.serve` (the README's first command) fills ~/.cache/jaxllm: XLA's compilation cache, the
executable cache beside it and the converted demo model. Tests that found programs there once asserted which
programs they compiled and failed (the README's second command, after its first). Here the key engine tests run
in child pytest processes: twice against one cache folder (JAXLLM_TEST_CACHE_ROOT), so the second run meets
everything the first stored, the second beside a user's ~/.cache/jaxllm holding that folder's compiled programs,
which must come out untouched; then one of them with conftest's default (a fresh root per process) beside an empty
~/.cache, where anything a test stored in the user's cache would show.
"""

import os
import shutil
import subprocess
import sys

KEY_TESTS = (
    "tests/test_engine.py::test_greedy_batch_matches_hf",
    "tests/test_engine.py::test_chunked_prefill_tiny_budget",
    "tests/test_engine.py::test_preemption_keeps_greedy",
    "tests/test_engine.py::test_penalties_and_logit_bias",
    "tests/test_structured.py::test_missing_mask_count_program_is_served_by_a_wider_one",
    "tests/test_demo_engine.py::test_demo_model_answers_paris",
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_VARS = ("JAXLLM_TEST_CACHE_ROOT", "JAXLLM_CACHE_ROOT", "XDG_CACHE_HOME", "HF_HOME", "JAX_COMPILATION_CACHE_DIR")


def run_key_tests(tests=KEY_TESTS, **env):
    base = {k: v for k, v in os.environ.items() if k not in CACHE_VARS and not k.startswith("PYTEST_")}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *tests],
        cwd=ROOT,
        env=base | env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert f"{len(tests)} passed" in r.stdout, r.stdout[-2000:]


def snapshot(folder):
    return sorted(
        (os.path.relpath(os.path.join(d, f), folder), os.stat(os.path.join(d, f)).st_mtime_ns)
        for d, _, files in os.walk(folder)
        for f in files
    )


def test_key_engine_tests_pass_twice_on_one_cache_and_never_touch_the_users(tmp_path):
    shared = tmp_path / "shared"
    run_key_tests(JAXLLM_TEST_CACHE_ROOT=str(shared))
    stored = snapshot(shared)
    assert any(p.startswith(os.path.join("xla", "jaxllm_executables")) for p, _ in stored), stored[:20]
    assert any(p.startswith("SmolLM2-135M-Instruct") for p, _ in stored), stored[:20]

    home = tmp_path / "home"  # a user's cache with compiled programs but no demo model yet: a test run that used
    shutil.copytree(shared / "xla", home / ".cache" / "jaxllm" / "xla")  # it would store the converted model there
    before = snapshot(home)
    run_key_tests(JAXLLM_TEST_CACHE_ROOT=str(shared), HOME=str(home))  # everything the first run stored is found
    assert snapshot(home) == before  # the user's cache: nothing written (the demo model would be, were it used)


def test_an_engine_test_on_the_default_root_leaves_an_empty_home_empty(tmp_path):
    """conftest's default root (what CI and a developer's plain `pytest` get): one engine test, which stores
    compiled programs in whatever cache it is given, leaves an empty home empty. (The six tests cold once more
    here cost ~60 s and checked nothing more: the root is the only difference between the two branches.) A test of
    its own, independent of the two runs above: xdist can give it to the other worker."""
    empty = tmp_path / "empty_home"
    empty.mkdir()
    run_key_tests(KEY_TESTS[:1], HOME=str(empty))
    assert not any(empty.iterdir())
