"""jaxllm convert --model HF_DIR --out DIR [--tp N --pp M --dtype ...] (also `python -m jaxllm.convert`)

Converts an HF checkpoint (PyTorch .bin or safetensors, or a .gguf file) into a jaxllm Orbax checkpoint that
`LLM(model=DIR)` and `jaxllm serve DIR` load directly, onto any mesh. The work is in hf_to_orbax.py; this is
the command line.
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser(prog: str = "jaxllm convert") -> argparse.ArgumentParser:
    from jaxllm.distributed import add_distributed_args

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[1])
    p.add_argument(
        "--model",
        required=True,
        help="HF model directory (config.json + weights + tokenizer), or a local .gguf file (converted to one first, "
        "as `jaxllm serve x.gguf` does).",
    )
    p.add_argument("--out", required=True, help="Output directory (must not exist or be empty).")
    p.add_argument(
        "--tp",
        "--tensor-parallel-size",
        "-tp",
        dest="tp",
        type=int,
        default=1,
        help="Tensor-parallel size the checkpoint is chunked for.",
    )
    p.add_argument(
        "--pp",
        "--pipeline-parallel-size",
        "-pp",
        dest="pp",
        type=int,
        default=1,
        help="Pipeline-parallel size it is written for (validated).",
    )
    p.add_argument(
        "--dtype", default="auto", help="auto | bfloat16 | float16 | float32 (auto: the checkpoint's own dtype)."
    )
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "pt"])
    p.add_argument("--overwrite", action="store_true", help="Replace a non-empty --out.")
    p.add_argument("--no-progress", action="store_true")
    add_distributed_args(p)
    return p


def main(argv: list[str] | None = None, prog: str = "jaxllm convert") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.tp > 1:  # conversion runs on CPU devices: give it one per tp shard (must precede jax's start)
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.tp}".strip()
    from jaxllm.distributed import maybe_initialize

    maybe_initialize(args)
    from convert import ConversionError, convert_checkpoint

    try:
        if os.path.isfile(args.model) and args.model.endswith(".gguf"):
            from jaxllm.demo import gguf_model_dir

            try:
                args.model = gguf_model_dir(args.model)  # the HF layout folder serving it uses (cached)
            except (ValueError, OSError) as e:
                raise ConversionError(f"--model {args.model}: {e}") from None
        out = convert_checkpoint(
            args.model,
            args.out,
            tp=args.tp,
            pp=args.pp,
            dtype=args.dtype,
            load_format=args.load_format,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"Wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
