"""One of the two processes (4 simulated CPU devices each) of tests/test_multihost_engine.py: the offline LLM API
at tp 8, pp 2 (one stage per process) and tp 2 x pp 2 with preemption and prefix caching, speculative decoding
and LoRA refused, then `jaxllm serve` at tp 2 x pp 2 (process 0 serves, process 1 headless) until the test stops it.

    python tests/_multihost_engine.py MODEL_DIR COORDINATOR_PORT PROCESS_ID OUT_JSON HTTP_PORT
"""

import gc
import json
import os
import sys

LAYOUTS = [(8, 1), (1, 2), (2, 2)]
SHARED = [7, 21, 3, 99, 14, 5, 61, 33, 48, 2, 17, 85, 40, 12, 6, 90, 71, 25, 58, 9]  # > 2 blocks of 8
PROMPTS = [
    [5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 3, 83, 27],
    [101, 7],
    [8] * 19,
    [3],
    [44, 55, 66, 77, 88, 99, 11, 22, 33],
    SHARED + [1, 2],
]
AGAIN = [SHARED + [3]]  # a second call: its first two blocks are in the prefix cache
# 9 KV blocks of 8 tokens: the prompts do not fit at once, so sequences are preempted and recomputed.
ENGINE = dict(
    dtype="float32",
    num_gpu_blocks_override=9,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    block_size=8,
    max_model_len=64,
    enforce_eager=True,
    enable_prefix_caching=True,
    compilation_cache_dir=None,
)
MAX_TOKENS = 10
SERVE_FLAGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--num-gpu-blocks-override",
    "40",
    "--block-size",
    "8",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "32",
    "--enforce-eager",
    "-tp",
    "2",
    "-pp",
    "2",
    "--served-model-name",
    "tiny",
    "--disable-access-log",
    "--shutdown-timeout",
    "1",
    "--distributed-timeout",
    "60",
]


def main(model: str, port: str, process_id: int, out: str, http_port: str) -> None:
    from jaxllm.distributed import initialize

    initialize(f"localhost:{port}", 2, process_id, timeout=60)
    from jaxllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {}
    for tp, pp in LAYOUTS:
        llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in AGAIN], greedy, use_tqdm=False)
        if process_id == 0:
            st = llm.llm_engine.scheduler.stats
            results[f"{tp}x{pp}"] = {
                "tokens": [o.outputs[0].token_ids for o in outs + again],
                "preemptions": st.num_preemptions,
                "prefix_hits": st.prefix_cache_hits,
            }
        else:
            assert outs == [] and again == [], (outs, again)
        del llm, outs, again
        gc.collect()
    try:  # refused before any weight loads, on every process (the steps' broadcast carries no speculation)
        LLM(
            model,
            tensor_parallel_size=8,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
            **ENGINE,
        )
        results["speculation"] = "accepted"
    except ValueError as e:
        results["speculation"] = str(e)
    try:
        LLM(model, tensor_parallel_size=8, enable_lora=True, **ENGINE)
        results["lora"] = "accepted"
    except ValueError as e:
        results["lora"] = str(e)
    if process_id == 0:
        with open(out + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(out + ".tmp", out)
    from server.serve import main as serve

    serve(
        [
            model,
            "--host",
            "127.0.0.1",
            "--port",
            http_port,
            *SERVE_FLAGS,
            "--coordinator-address",
            f"localhost:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(process_id),
        ]
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
