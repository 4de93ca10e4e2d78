"""The command line: `jaxllm serve|convert|bench` are the existing commands (same flags, same behaviour), the
console scripts point at server/ and convert/, and the library never imports its entry points."""

import ast
import importlib
import os
import subprocess
import sys

import pytest

from server import cli
from server.args import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imports that must not happen: the library under its entry points, and in the engine runner -> programs ->
# packing (the compiled programs' owner never reaches back into the runner).
FORBIDDEN = {
    "jaxllm": ("server", "convert", "bench"),
    "kernels_pallas": ("jaxllm", "server", "convert", "bench"),
    "jaxllm/engine/programs.py": ("jaxllm.engine.runner",),
    "jaxllm/engine/step_fns.py": ("jaxllm.engine.runner", "jaxllm.engine.programs"),
    "jaxllm/engine/packing.py": ("jaxllm.engine.runner", "jaxllm.engine.programs", "jaxllm.engine.step_fns"),
}
# python -m aliases: they forward to the command above the library, only when run as __main__
ALIASES = ("jaxllm/serve.py", "jaxllm/convert.py")


def _imports(path: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_imports_run_one_way():
    bad = []
    for where, forbidden in FORBIDDEN.items():
        top = os.path.join(ROOT, where)
        paths = (
            [top]
            if top.endswith(".py")
            else [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs if f.endswith(".py")]
        )
        for path in paths:
            if os.path.relpath(path, ROOT) in ALIASES:
                continue
            bad += [
                (os.path.relpath(path, ROOT), name)
                for name in _imports(path)
                if any(name == f or name.startswith(f + ".") for f in forbidden)
            ]
    assert not bad


def test_console_scripts_point_above_the_library():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert set(scripts) == {"jaxllm", "jaxllm-serve", "jaxllm-convert"}
    for target in scripts.values():
        module, attr = target.split(":")
        assert module.split(".")[0] in ("server", "convert")
        assert callable(getattr(importlib.import_module(module), attr))


def test_jaxllm_serve_runs_the_server_with_python_m_jaxllm_serve_flags(monkeypatch):
    import jaxllm.engine.device_memory
    import server.serve

    seen = []

    async def run_server(args):
        seen.append(vars(args))

    monkeypatch.setattr(server.serve, "run_server", run_server)
    monkeypatch.setattr(jaxllm.engine.device_memory, "request_device_memory", lambda *a: None)
    argv = ["some/model", "--port", "0", "--max-model-len", "1k", "--api-key", "k", "--served-model-name", "m"]
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *argv])
    assert e.value.code == 0 and seen == [vars(parse_args(argv))]
    assert seen[0]["max_model_len"] == 1000 and seen[0]["api_key"] == ["k"]


def test_python_m_aliases_print_the_same_help_and_import_nothing_above_the_library(capsys, monkeypatch):
    env = dict(os.environ, COLUMNS="120", PYTHONPATH=ROOT)
    monkeypatch.setenv("COLUMNS", "120")
    out = subprocess.run(
        [sys.executable, "-m", "jaxllm.serve", "--help"], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0 and capsys.readouterr().out == out.stdout and "--max-model-len" in out.stdout
    # Importing the aliases (or the library) loads none of server/, convert/, bench/.
    script = (
        "import sys, jaxllm, jaxllm.serve, jaxllm.convert, jaxllm.engine.llm_engine\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('server', 'convert', 'bench')))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_jaxllm_convert_and_bench_forward_to_their_commands(tmp_path, capsys, monkeypatch):
    # convert: the command's own error handling (message, exit code 2)
    assert cli.main(["convert", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    assert "error:" in capsys.readouterr().err
    # bench: the checkout's scripts, with their own flags
    monkeypatch.setattr(sys, "argv", ["jaxllm"])
    for name in cli.BENCHMARKS:
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", name, "--help"])
        assert e.value.code == 0 and f"usage: jaxllm bench {name}" in capsys.readouterr().out
    assert cli.main(["bench", "nonesuch"]) == 2 and "throughput" in capsys.readouterr().err
    assert cli.main(["nonesuch"]) == 2 and "usage: jaxllm" in capsys.readouterr().err
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.startswith("jaxllm ")


def test_serve_refuses_bad_settings_in_one_line(tmp_path):
    """A setting the engine refuses before serving (here an explicit token budget below max_num_seqs, and a quoted
    number in --hf-overrides, which failed as a raw TypeError deep in start-up) ends `jaxllm serve` with exit
    status 1 and one line naming it, not a 40-line traceback; --log-level debug keeps the traceback."""
    from tests.tiny_models import make_tiny_model_dir

    model = make_tiny_model_dir("llama", str(tmp_path / "tiny"))[0]
    env = dict(os.environ, PYTHONPATH=ROOT)
    cases = [
        (["--max-num-seqs", "64", "--max-num-batched-tokens", "8"], "max_num_batched_tokens (8) must be greater"),
        (["--hf-overrides", '{"num_hidden_layers": "x"}'], "hf_overrides['num_hidden_layers'] must be of type int"),
    ]
    for flags, message in cases:
        cmd = [sys.executable, "-m", "jaxllm.serve", model, "--port", "0", *flags]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1].startswith(f"jaxllm serve: error: {message}"), out.stderr[-2000:]
    out = subprocess.run([*cmd, "--log-level", "debug"], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 1 and "Traceback" in out.stderr


def test_help_topics_as_vllm(capsys):
    """vLLM's --help=<topic>: listgroup, a group, one flag (with or without its dashes), a keyword; an unknown one
    says so (exit 2)."""
    for topic, want, not_want in [
        ("listgroup", "    engine\n", "--max-model-len"),
        ("engine", "--max-model-len", "--api-key"),
        ("max-model-len", "--max-model-len", "--max-num-seqs"),
        ("--api-key", "--api-key", "--max-model-len"),
        ("cors", "--allowed-origins", "--max-model-len"),
        ("ModelConfig", "--max-model-len", "--api-key"),  # vLLM's group names: the jaxllm group holding them
        ("Frontend", "--api-key", "--max-model-len"),
    ]:
        with pytest.raises(SystemExit) as e:
            parse_args([f"--help={topic}"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and want in out and not_want not in out, (topic, out)
    with pytest.raises(SystemExit) as e:
        parse_args(["--help=nonesuch"])
    assert e.value.code == 2 and "--help=listgroup" in capsys.readouterr().err
