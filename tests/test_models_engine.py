"""Issue 36's architectures through the whole engine (LLM): greedy tokens equal HF transformers' under batching,
chunked prefill and prefix caching; the mixture-of-experts models also at tp=2, with and without expert
parallelism, on simulated CPU devices."""

import pytest
import torch

from jaxllm import LLM, SamplingParams
from tests.tiny_models import MOE_ARCHS, make_tiny_model_dir

PROMPTS = [
    [5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 3, 83, 27],  # > Gemma's window (5)
    [101, 7],
    [8] * 19,
    [3],
    [44, 55, 66, 77, 88, 99, 11, 22, 33],
]
SHARED = [7, 21, 3, 99, 14, 5, 61, 33, 48, 2, 17, 85, 40, 12, 6, 90, 71, 25, 58, 9]  # > 2 blocks of 8
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def hf_greedy(model, prompt, n):
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """arch -> (model dir, HF's greedy tokens per prompt), each built on first use."""
    built = {}

    def get(arch):
        if arch not in built:
            model_dir, model = make_tiny_model_dir(arch, str(tmp_path_factory.mktemp(arch)))
            prompts = PROMPTS + [SHARED + [1, 2], SHARED + [3]]
            built[arch] = model_dir, {tuple(p): hf_greedy(model, p, GREEDY.max_tokens) for p in prompts}
        return built[arch]

    return get


def greedy(model_dir, **kw):
    llm = LLM(
        model_dir,
        **(
            dict(
                dtype="float32",
                num_gpu_blocks_override=64,
                max_num_seqs=8,
                max_num_batched_tokens=16,
                block_size=8,
                max_model_len=64,
                enforce_eager=True,
                compilation_cache_dir=None,
            )
            | kw
        ),
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def check_free(llm):
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "KV blocks leaked"


# (arch, tensor_parallel_size, pipeline_parallel_size, enable_expert_parallel): every architecture once (Gemma 2's
# soft-capped, per-layer-windowed attention inside the tp shard_map; Gemma 3's sliding layers on one pipeline stage
# and its global one on the other), the MoE models at tp 2 with and without expert parallelism (Qwen2-MoE with its
# shared expert and a dense layer).
RUNS = [
    ("qwen3", 1, 1, False),
    ("llama32", 1, 1, False),
    ("gemma2", 2, 1, False),
    ("gemma3", 1, 2, False),
    ("mixtral", 1, 1, False),
    ("mixtral", 2, 1, False),
    ("qwen2_moe", 2, 1, True),
    ("qwen3_moe", 2, 1, True),
]


@pytest.mark.parametrize(
    "arch, tp, pp, ep",
    RUNS,
    ids=[f"{a}-tp{t}" + (f"-pp{p}" if p > 1 else "") + ("-ep" if e else "") for a, t, p, e in RUNS],
)
def test_greedy_matches_hf(cases, arch, tp, pp, ep):
    """A 16-token budget splits the long prompts into chunks; the second request of a shared prefix reads its
    first two blocks from the prefix cache."""
    model_dir, refs = cases(arch)
    llm, got = greedy(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep)
    assert got == [refs[tuple(p)] for p in PROMPTS]
    first = llm.generate({"prompt_token_ids": SHARED + [1, 2]}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": SHARED + [3]}, GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == refs[tuple(SHARED + [1, 2])]
    assert second.outputs[0].token_ids == refs[tuple(SHARED + [3])]
    assert second.num_cached_tokens == 16
    check_free(llm)
    if arch in MOE_ARCHS and tp > 1:
        # Expert parallelism keeps whole experts on a device; without it each device holds every expert's slice.
        w = llm.llm_engine.runner.params["layers"][0]["w_experts_gate_up"]
        E, D, _, F = w.shape
        assert {s.data.shape for s in w.addressable_shards} == {(E // tp, D, 2, F) if ep else (E, D, 2, F // tp)}
