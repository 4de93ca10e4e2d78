"""Speculative decoding with a drafter on the device (a draft model, EAGLE and EAGLE-3 heads in the public
checkpoints' layout, tests/eagle_heads.py): greedy outputs are token for token those without speculation whatever
the drafter proposes, batched and with preemption; the draft model's KV follows the target's (the target as its own
draft has every proposal accepted); the counters; the checks before anything loads."""

import json
import os

import pytest

from jaxllm import LLM, SamplingParams
from tests.eagle_heads import reference_proposals, save_draft_model, save_eagle_head
from tests.tiny_models import make_tiny_model_dir

PROMPTS = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35] * 2, [101, 7], [8] * 19, [3], [44, 55, 66, 77, 88, 99, 11, 22, 33]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
K = 3


def make_llm(model_dir, **kw):
    base = dict(
        dtype="float32",
        num_gpu_blocks_override=96,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=8,
        enforce_eager=True,
        max_model_len=128,
    )
    return LLM(model_dir, **(base | kw))


def spec_cfg(model, **kw):  # disable_by_batch_size: CPU's cost model would stop speculating at ~3 sequences
    return {"model": model, "num_speculative_tokens": K, "disable_by_batch_size": 64} | kw


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def run(llm, prompts=PROMPTS, params=GREEDY):
    return ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def check_free(llm):
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "KV blocks leaked"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny")))[0]


@pytest.fixture(scope="module")
def want(tiny):
    return run(make_llm(tiny))


@pytest.fixture(scope="module")
def heads(tiny, tmp_path_factory):
    with open(os.path.join(tiny, "config.json")) as f:
        target = json.load(f)
    root = tmp_path_factory.mktemp("heads")
    return {
        "draft": save_draft_model(str(root / "draft"), target["vocab_size"]),
        "eagle": save_eagle_head(str(root / "eagle"), target, "eagle"),
        # a 2-layer target: the feature layers come from the config (vLLM's default needs L >= 4)
        "eagle3": save_eagle_head(str(root / "eagle3"), target, "eagle3", feature_layers=[0, 1, 1]),
    }


def test_the_target_as_its_own_draft_has_every_proposal_accepted(tiny, want):
    """The draft model's KV follows the target's through prefill, verify steps and rollbacks: drafting with the
    target itself, every proposal is the target's own greedy token (a stale or misplaced draft KV entry would
    propose something else)."""
    llm = make_llm(tiny, speculative_config=spec_cfg(tiny))
    assert run(llm) == want
    st = llm.llm_engine.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens == st.num_draft_tokens
    assert st.num_accepted_tokens_per_pos[0] == st.num_drafts and st.num_draft_tokens > 2 * st.num_drafts
    check_free(llm)


@pytest.mark.parametrize("drafter", ["self", "eagle3"])
def test_outputs_that_reach_max_model_len(tiny, heads, drafter):
    """Sequences that run into max_model_len (max_tokens None fills the context): the drafter's lookahead pages stop
    at max_model_len, where the runner's block tables end (they went past it and killed the engine: IndexError in
    InputBatch.rows, a black-box report); the outputs are the engine's without speculation, finish "length"."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    prompts = [[3], [101, 7], [8] * 19]
    kw = dict(max_model_len=64, block_size=8)
    want = run(make_llm(tiny, **kw), prompts, params)
    llm = make_llm(tiny, speculative_config=spec_cfg(tiny if drafter == "self" else heads[drafter]), **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert ids(outs) == want and all(len(p) + len(w) == 64 for p, w in zip(prompts, want))
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.llm_engine.scheduler.spec_stats.num_drafts > 0
    check_free(llm)


@pytest.mark.parametrize("method", ["draft", "eagle", "eagle3"])
def test_greedy_is_identical_with_a_random_drafter_batched_and_preempted(tiny, heads, want, method):
    """Random drafters propose mostly wrong tokens: the outputs are the target's anyway, batched, and under a KV
    cache small enough to preempt (chunked prefill, prefix hits on the second run); no page leaks."""
    llm = make_llm(
        tiny,
        speculative_config=spec_cfg(heads[method]),
        num_gpu_blocks_override=16,
        max_model_len=64,
        max_num_batched_tokens=16,
    )
    eng = llm.llm_engine
    assert eng.spec.method == {"draft": "draft_model"}.get(method, method)  # detected from the files
    assert run(llm) == want
    assert run(llm, PROMPTS[:2]) == want[:2]
    st = eng.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_draft_tokens > 0 and eng.scheduler.num_preemptions > 0
    assert 0 <= st.num_accepted_tokens <= st.num_draft_tokens
    assert sum(st.num_accepted_tokens_per_pos) == st.num_accepted_tokens
    check_free(llm)


def test_checks_before_anything_loads(tiny, heads, tmp_path):
    other = save_draft_model(str(tmp_path / "other"), 96)
    with pytest.raises(
        ValueError,
        match="Target and draft model should have the same vocabulary size. Target "
        "model vocab_size=128. Draft model vocab_size=96.",
    ):
        make_llm(tiny, speculative_config=spec_cfg(other))
    with pytest.raises(ValueError, match="EAGLE-3 feature layers"):  # vLLM's default layers need 4+ target layers
        cfg = json.load(open(os.path.join(heads["eagle3"], "config.json")))
        del cfg["eagle_aux_hidden_state_layer_ids"]
        bad = tmp_path / "eagle3"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(cfg))
        make_llm(tiny, speculative_config=spec_cfg(str(bad), method="eagle3"))


def test_eagle3_default_feature_layers():
    from jaxllm.spec_decode.heads import feature_layers

    assert feature_layers({}, 32) == (2, 16, 29)  # Llama-3.1-8B: vLLM's (2, L // 2, L - 3)
    assert feature_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}}, 32) == (1, 5, 9)


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle3"])
def test_greedy_is_identical_under_tensor_parallel(tiny, heads, want, method):
    """tp = 2 on simulated devices: the verify step's attention runs in shard_map over the heads, the drafter (a
    draft model, an EAGLE-3 head) is sharded as the target is, its KV pages too; outputs are those without
    speculation at tp = 1."""
    cfg = (
        {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
            "disable_by_batch_size": 64,
        }
        if method == "ngram"
        else spec_cfg(heads[method])
    )
    llm = make_llm(tiny, tensor_parallel_size=2, speculative_config=cfg)
    assert run(llm) == want
    st = llm.llm_engine.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0 if method == "ngram" else st.num_drafts > 0
    check_free(llm)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_head_proposals_match_a_torch_reference_of_the_published_layout(tiny, heads, method, monkeypatch):
    """The proposals of the first verify step equal those of an independent torch implementation of the head
    (tests/eagle_heads.py: vLLM's computation on the published tensors and the HF target's hidden states): the
    loader's layout (fc's input order, midlayer norms, d2t) and the drafter's KV and features are checked, which
    greedy identity alone cannot do."""
    from jaxllm.spec_decode.engine import SpecDecoding
    from tests.tiny_models import make_hf_model

    seen = []
    take = SpecDecoding.take_drafts

    def record(self, handle, result):
        take(self, handle, result)
        if result.draft_tokens is not None and not seen:
            seq = handle.sched.scheduled[0].seq
            seen.append((seq.prompt_token_ids + seq.output_token_ids, list(seq.spec_token_ids)))

    monkeypatch.setattr(SpecDecoding, "take_drafts", record)
    llm = make_llm(tiny, speculative_config=spec_cfg(heads[method]))
    run(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    tokens, proposals = seen[0]
    assert proposals == reference_proposals(make_hf_model("llama"), heads[method], method, tokens, K)
