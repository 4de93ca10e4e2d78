"""Per-token decode time on CPU with an fp8 KV cache against the model's own dtype (issue 30).

    python bench/probes/cpu_fp8_kv.py [--kv-bytes 1G] [--output-len 16]

Finding: XLA's CPU backend widens an fp8 scatter's whole operand to float32 and back (as it does for a 16-bit
one), so every KV write rewrote every layer's cache: the step time grew with the cache size, not the batch.
On CPU the fp8 pages are stored as their uint8 bit patterns (jaxllm.engine.runner.kv_storage_dtype), whose
scatter is in place; the attention reads widen only the pages they gather. The figures before/after are in
the docstring of kv_storage_dtype and in the commit that made the change.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import common  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-bytes", default="1G", help="KV cache size (kv_cache_memory_bytes; accepts 1G, 256M)")
    p.add_argument("--output-len", type=int, default=16)
    args = p.parse_args(argv)
    from jaxllm import LLM, SamplingParams
    from server.arg_types import human_readable_int

    model = common.make_model_dir("tiny", tempfile.mkdtemp(prefix="fp8-probe-"))
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for kv in ("auto", "fp8"):
        llm = LLM(
            model,
            load_format="dummy",
            kv_cache_dtype=kv,
            max_model_len=512,
            enforce_eager=True,
            kv_cache_memory_bytes=human_readable_int(args.kv_bytes),
            compilation_cache_dir=None,
        )
        llm.generate({"prompt_token_ids": [5] * 8}, sp, use_tqdm=False)  # compiles the steps it uses
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": [7] * 8}, sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        pages = llm.llm_engine.runner.kv_caches[0][0]
        print(
            f"kv_cache_dtype={kv}: pages {pages.dtype}{list(pages.shape)}, {len(out.outputs[0].token_ids)} tokens "
            f"in {dt:.3f} s, {1000 * dt / len(out.outputs[0].token_ids):.1f} ms per token",
            flush=True,
        )
        del llm


if __name__ == "__main__":
    main()
