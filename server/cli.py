"""`jaxllm`: one command with subcommands, as vLLM's `vllm`.

    jaxllm serve [MODEL] [vLLM serve flags]     the OpenAI-compatible server (server/serve.py)
    jaxllm convert --model HF_DIR --out DIR     HF checkpoint -> jaxllm Orbax checkpoint (convert/cli.py)
    jaxllm bench {throughput,latency,serve} ... the benchmarks of a source checkout's bench/ (as `vllm bench`)
    jaxllm --version

Each subcommand takes exactly the flags of its own command line (`jaxllm serve MODEL ...` is
`python -m jaxllm.serve MODEL ...`). This module lives in server/, above jaxllm/ and beside convert/, so the
library never imports its entry points.
"""

from __future__ import annotations

import importlib
import os
import sys

BENCHMARKS = {
    "throughput": "offline throughput of LLM.generate on N prompts (bench/throughput.py)",
    "latency": "one batch's end-to-end latency, repeated (bench/latency.py)",
    "serve": "an OpenAI-compatible server under load: TTFT, ITL, throughput (bench/serve.py)",
}
USAGE = """usage: jaxllm {serve,convert,bench} ... | jaxllm --version

  serve [MODEL] [flags]          start the OpenAI-compatible server (jaxllm serve --help)
  convert --model HF --out DIR   convert an HF checkpoint to a jaxllm checkpoint (jaxllm convert --help)
  bench {throughput,latency,serve} [flags]
                                 run a benchmark from the source checkout's bench/ (jaxllm bench throughput --help)
"""


def _version() -> str:
    import jaxllm

    return jaxllm.__version__


def _serve(argv: list[str]) -> int:
    from server.serve import main

    main(argv)  # exits with the server's status
    return 0


def _convert(argv: list[str]) -> int:
    from convert.cli import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        lines = "\n".join(f"  {name:<12}{what}" for name, what in BENCHMARKS.items())
        print(
            f"usage: jaxllm bench {{{','.join(BENCHMARKS)}}} [flags]\n\n{lines}",
            file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr,
        )
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    # bench/ is not installed with the package: the scripts run from the checkout this server/ belongs to.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "bench", argv[0] + ".py")):
        print(
            f"jaxllm bench: {os.path.join(root, 'bench')} not found. The benchmarks run from a source checkout "
            "(git clone the repository, then pip install -e .).",
            file=sys.stderr,
        )
        return 2
    if root not in sys.path:
        sys.path.insert(0, root)
    sys.argv[0] = f"jaxllm bench {argv[0]}"  # the scripts' usage lines
    importlib.import_module(f"bench.{argv[0]}").main(argv[1:])
    return 0


COMMANDS = {"serve": _serve, "convert": _convert, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"jaxllm {_version()}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"jaxllm: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
