"""`python -m jaxllm.convert --model HF_DIR --out DIR [...]`: an alias of `jaxllm convert`.

The conversion is the top-level convert package (convert/cli.py holds this command), which imports jaxllm,
never the other way round; this module only forwards the command line when run with -m and imports nothing
when imported.
"""

if __name__ == "__main__":
    import sys

    from convert.cli import main

    sys.exit(main(prog="python -m jaxllm.convert"))
