"""vLLM's vllm.utils names that scripts import: FlexibleArgumentParser (jaxllm/engine/cli_args.py)."""

from jaxllm.engine.cli_args import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
