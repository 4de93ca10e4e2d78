"""Where jaxllm keeps files between runs: one cache root, as vLLM's VLLM_CACHE_ROOT.

    $JAXLLM_CACHE_ROOT, else $XDG_CACHE_HOME/jaxllm, else ~/.cache/jaxllm
        xla/                      compilation_cache_dir's default: XLA's cache + jaxllm_executables/
        SmolLM2-135M-Instruct/    the demo model, converted once (jaxllm/demo.py)
        bench_models/             bench/'s generated model folders

Read at each call, not at import, so a process (the test suite's conftest) can move it before it builds engines.
"""

from __future__ import annotations

import os


def cache_root() -> str:
    root = os.environ.get("JAXLLM_CACHE_ROOT")
    if root:
        return os.path.expanduser(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxllm")


def default_compilation_cache_dir() -> str:
    return os.path.join(cache_root(), "xla")
