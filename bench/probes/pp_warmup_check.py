"""Finding: with pp = 2 start-up compiles the stages and the sampling head (ready in 9.7 s, tiny model, two
H200s), a one-micro-batch request compiles nothing after it, and greedy tokens equal pp = 1 (HISTORY).

pp = 2 with warm-up (enforce_eager off) on two GPUs: start-up compiles the stages and the sampling head, a
one-micro-batch request compiles nothing after it, and greedy tokens equal pp = 1 (tiny random Llama, float32,
Pallas attention). `python bench/probes/pp_warmup_check.py` writes $OUT/pp_gpu_check.json (or ./)."""

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

from bench.common import environment, write_result  # noqa: E402
from jaxllm import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import make_tiny_model_dir  # noqa: E402

d = make_tiny_model_dir("llama", tempfile.mkdtemp())[0]
prompts = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35], [101, 7], [8] * 19, [3], [44, 55, 66, 77]]
sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: compiles.append(secs) if name == "/jax/core/compile/backend_compile_duration" else None
)
res = {}
for pp in (1, 2):
    t0 = time.perf_counter()
    llm = LLM(
        d,
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=16,
        max_model_len=128,
        compilation_cache_dir=None,
        pipeline_parallel_size=pp,
        gpu_memory_utilization=0.3,
    )
    ready, at_start = time.perf_counter() - t0, len(compiles)
    one = llm.generate({"prompt_token_ids": prompts[3]}, sp, use_tqdm=False)
    after_one = len(compiles) - at_start
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    res[pp] = dict(
        ready_s=ready,
        compiles_at_start=at_start,
        compiles_in_one_request=after_one,
        compiles_in_batch=len(compiles) - at_start - after_one,
        tokens=[o.outputs[0].token_ids for o in outs],
        one=one[0].outputs[0].token_ids,
        attention=llm.llm_engine.runner.attn.backend,
    )
    compiles.clear()
    del llm
res["equal"] = res[1]["tokens"] == res[2]["tokens"]
res["env"] = environment() | {"devices": [str(x) for x in jax.devices()]}
print(json.dumps(res))
write_result("pp_warmup_check", res, os.path.join(os.environ.get("OUT", "."), "pp_gpu_check.json"))
