"""The whole engine against HF transformers: greedy tokens equal under batching, chunked prefill, prefix
caching and preemption; sampling, stops, logprobs and validation behave like vLLM."""

import gc
import json
import os
import re
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.engine.sampler import SamplerFlags
from jaxllm.engine.step_io import StepVariant
from jaxllm.sampling_params import RequestOutputKind
from tests.tiny_models import make_tiny_model_dir

PROMPTS = [
    [5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 3, 83, 27],
    [101, 7],
    [8] * 19,
    [3],
    [44, 55, 66, 77, 88, 99, 11, 22, 33],
]
SHARED = [7, 21, 3, 99, 14, 5, 61, 33, 48, 2, 17, 85, 40, 12, 6, 90, 71, 25, 58, 9]  # > 2 blocks of 8
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny")))


def hf_greedy(model, prompt, n):
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


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


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def hf_refs(tiny):
    _, model = tiny
    return {tuple(p): hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS + [SHARED + [1, 2], SHARED + [3]]}


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny[0])


def check_free(llm):
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "KV blocks leaked"


def test_greedy_batch_matches_hf(llm, hf_refs):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert token_ids(outs) == [hf_refs[tuple(p)] for p in PROMPTS]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    check_free(llm)


def test_chunked_prefill_tiny_budget(tiny, hf_refs):
    llm = make_llm(tiny[0], max_num_batched_tokens=8, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert token_ids(outs) == [hf_refs[tuple(p)] for p in PROMPTS]
    check_free(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_never_changes_greedy(tiny, hf_refs, prefix_caching):
    llm = make_llm(tiny[0], enable_prefix_caching=prefix_caching)
    first = llm.generate({"prompt_token_ids": SHARED + [1, 2]}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": SHARED + [3]}, GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == hf_refs[tuple(SHARED + [1, 2])]
    assert second.outputs[0].token_ids == hf_refs[tuple(SHARED + [3])]
    assert second.num_cached_tokens == (16 if prefix_caching else 0)
    check_free(llm)


def test_cache_salt_isolates_the_prefix_cache(tiny, hf_refs):
    """vLLM's cache_salt (a prompt dict key; the server's request field): cached blocks are shared only between
    requests with the same salt, and the tokens do not change."""
    llm = make_llm(tiny[0], enable_prefix_caching=True)

    def run(tail, salt=None):
        prompt = {"prompt_token_ids": SHARED + tail} | ({"cache_salt": salt} if salt is not None else {})
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_refs[tuple(SHARED + tail)]
        return out.num_cached_tokens

    assert run([1, 2], "tenant-a") == 0
    assert (run([3], "tenant-b"), run([3]), run([3], "tenant-a")) == (0, 0, 16)
    assert run([1, 2]) == 16  # the unsalted run of SHARED + [3] cached it
    for bad in ("", 7):
        with pytest.raises(ValueError, match="Parameter 'cache_salt' must be a non-empty string if provided."):
            llm.generate({"prompt_token_ids": SHARED, "cache_salt": bad}, GREEDY, use_tqdm=False)
    check_free(llm)


def test_preemption_keeps_greedy(tiny, hf_refs):
    llm = make_llm(tiny[0], num_gpu_blocks_override=9, max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert token_ids(outs) == [hf_refs[tuple(p)] for p in PROMPTS]
    check_free(llm)


def _same_prompt_logprobs(got, want):
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        for t in g:
            assert g[t].logprob == pytest.approx(w[t].logprob, abs=1e-5)


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny):
    """A chunked prefill preempted halfway is recomputed from position 0: the prompt logprobs already kept
    stay, the recomputed ones are not filed a second time (they landed on later positions before)."""
    llm = make_llm(tiny[0], num_gpu_blocks_override=10, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
    prompt = list(range(10, 50))
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    alone = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].prompt_logprobs
    before = llm.llm_engine.scheduler.num_preemptions
    busy = llm.generate(
        [{"prompt_token_ids": list(range(60, 100))}, {"prompt_token_ids": prompt}],
        [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), sp],
        use_tqdm=False,
    )[1]
    assert llm.llm_engine.scheduler.num_preemptions > before
    _same_prompt_logprobs(busy.prompt_logprobs, alone)
    check_free(llm)


def test_prompt_logprobs_not_taken_from_an_aborted_request_of_the_same_id(tiny):
    llm = make_llm(tiny[0], max_num_batched_tokens=16)
    engine = llm.llm_engine
    prompt = list(range(60, 90))
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    want = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].prompt_logprobs
    engine.add_request("x", {"prompt_token_ids": list(range(10, 50))}, sp)
    engine.step()  # its first chunk is in flight
    engine.abort_request("x")
    engine.add_request("x", {"prompt_token_ids": prompt}, sp)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["x"]
    _same_prompt_logprobs(done[0].prompt_logprobs, want)
    check_free(llm)


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        [SamplingParams(temperature=0.7, seed=i, max_tokens=8) for i in range(4)] + [sp],
        use_tqdm=False,
    )
    again = llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, sp, use_tqdm=False)
    assert alone == again == batched[0].outputs[0].token_ids == batched[1].outputs[0].token_ids
    other = llm.generate(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(temperature=1.0, seed=99, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert other[0].outputs[0].token_ids != alone
    assert len(batch) == 5


def test_n_and_logprobs(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, logprobs=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == 5
        for tok, d in zip(c.token_ids, c.logprobs):
            assert tok in d and 3 <= len(d) <= 4
            assert all(lp.logprob <= 0 for lp in d.values())
        assert c.cumulative_logprob == pytest.approx(
            sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)), rel=1e-5
        )
    check_free(llm)


def test_logprobs_without_detokenize_carry_no_text(llm):
    """detokenize=False: no text, and no decoded_token in the sampled or prompt logprobs (vLLM's); with it, both."""
    outs = [
        llm.generate(
            {"prompt_token_ids": PROMPTS[1]},
            SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1, detokenize=detok),
            use_tqdm=False,
        )[0]
        for detok in (False, True)
    ]
    for out, detok in zip(outs, (False, True)):
        entries = [d for d in out.outputs[0].logprobs] + [d for d in out.prompt_logprobs if d is not None]
        assert entries and all((lp.decoded_token is not None) == detok for d in entries for lp in d.values())
        assert (out.outputs[0].text != "") == detok
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    check_free(llm)


@pytest.mark.parametrize("stop", [["never-in-this-vocab"], None])
def test_output_kinds_cumulative_delta_and_final_only(llm, stop):
    """vLLM's RequestOutputKind: CUMULATIVE outputs carry everything so far, DELTA only what is new (joined, the
    same as the final cumulative output; the prompt's logprobs once), FINAL_ONLY one output at the end (without
    stop strings its tokens are decoded once, when it finishes: the same text).
    LLM.generate asks for FINAL_ONLY on a copy: the caller's params are left as they were."""
    engine = llm.llm_engine
    base = dict(
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=9,
        logprobs=2,
        prompt_logprobs=1,
        ignore_eos=True,
        stop=stop,
    )
    got = {}
    for kind in RequestOutputKind:
        engine.add_request(kind.name, {"prompt_token_ids": PROMPTS[0]}, SamplingParams(output_kind=kind, **base))
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    cum, delta, final = got["CUMULATIVE"], got["DELTA"], got["FINAL_ONLY"]
    assert len(final) == 1 and final[0].finished and len(cum) >= base["max_tokens"]
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    end = cum[-1]
    assert [c.token_ids for c in final[0].outputs] == [c.token_ids for c in end.outputs]
    assert [c.text for c in final[0].outputs] == [c.text for c in end.outputs]
    for c in end.outputs:
        parts = [p for o in delta for p in o.outputs if p.index == c.index]
        assert sum((p.token_ids for p in parts), []) == c.token_ids
        assert "".join(p.text for p in parts) == c.text
        joined = [d for p in parts for d in p.logprobs]  # another row of the batch: equal up to rounding
        assert [list(d) for d in joined] == [list(d) for d in c.logprobs]
        assert [lp.logprob for d in joined for lp in d.values()] == pytest.approx(
            [lp.logprob for d in c.logprobs for lp in d.values()], abs=1e-5
        )
        assert parts[-1].cumulative_logprob == pytest.approx(c.cumulative_logprob, abs=1e-4)
        assert parts[-1].finish_reason == "length"
    sent = [o.prompt_logprobs for o in delta if o.prompt_logprobs is not None]
    assert len(sent) == 1 and len(sent[0]) == len(end.prompt_logprobs) == len(PROMPTS[0])
    assert [None if d is None else list(d) for d in sent[0]] == [
        None if d is None else list(d) for d in end.prompt_logprobs
    ]
    sp = SamplingParams(**base)
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, use_tqdm=False)
    assert sp.output_kind is RequestOutputKind.CUMULATIVE
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in end.outputs]
    assert [c.text for c in out.outputs] == [c.text for c in end.outputs]
    check_free(llm)


@pytest.mark.parametrize("stop", [["never-in-this-vocab"], None])
def test_final_text_only_outputs_carry_the_tokens_and_the_text_at_the_end(llm, stop):
    """SamplingParams.final_text_only (the server's whole responses): cumulative outputs still come every step with
    the tokens so far (the server's metrics and admission count them). Without stop strings the tokens are held
    and decoded once, when each sequence finishes, so earlier outputs carry no text; the final text is the same."""
    engine = llm.llm_engine
    base = dict(n=2, temperature=1.0, seed=5, max_tokens=9, ignore_eos=True, stop=stop)
    got = {}
    for name, final_text_only in (("streamed", False), ("whole", True)):
        params = SamplingParams(final_text_only=final_text_only, **base)
        engine.add_request(name, {"prompt_token_ids": PROMPTS[0]}, params)
    held = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
        req = engine._requests.get("whole")
        held += [s.detok.held for s in req.seqs] if req is not None else []
    streamed, whole = got["streamed"], got["whole"]
    assert [[c.token_ids for c in o.outputs] for o in whole] == [[c.token_ids for c in o.outputs] for o in streamed]
    assert [c.text for c in whole[-1].outputs] == [c.text for c in streamed[-1].outputs]
    assert whole[-1].finished and all(c.text for c in whole[-1].outputs)
    early = [c.text for o in whole[:-1] for c in o.outputs]
    if stop is None:
        assert set(early) == {""} and max(held) == base["max_tokens"] - 1
    else:
        assert early == [c.text for o in streamed[:-1] for c in o.outputs] and set(held) == {0}
    check_free(llm)


def test_delta_outputs_send_each_completion_when_it_has_news_and_its_finish_once(llm):
    """n=2 where one sequence stops early (a stop token only it samples, found from a seeded first run): in
    DELTA outputs the stopped completion is not sent again, and a running one only with new tokens."""
    engine = llm.llm_engine
    base = dict(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    (first,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(**base), use_tqdm=False)
    a, b = (c.token_ids for c in first.outputs)
    stop = next(t for t in a[2:] if t not in b and t not in a[: a.index(t)])
    engine.add_request(
        "d",
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(output_kind=RequestOutputKind.DELTA, stop_token_ids=[stop], **base),
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    sent = {0: [], 1: []}
    for o in outs:
        for c in o.outputs:
            assert c.token_ids or c.finish_reason, "a completion sent with nothing new"
            sent[c.index].append(c)
    assert [c.finish_reason for c in sent[0]].count("stop") == 1 and sent[0][-1].finish_reason == "stop"
    assert sum((c.token_ids for c in sent[0]), []) == a[: a.index(stop) + 1]
    assert sum((c.token_ids for c in sent[1]), []) == b and len(sent[1]) > len(sent[0])
    assert [c.finish_reason for c in sent[1]].count("length") == 1 and outs[-1].finished
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="stream")
    check_free(llm)


def test_greedy_logprobs_match_hf(llm, tiny):
    _, model = tiny
    p = PROMPTS[0]
    out = llm.generate(
        {"prompt_token_ids": p},
        SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1, ignore_eos=True),
        use_tqdm=False,
    )[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([p + out.outputs[0].token_ids])).logits[0].double(), -1)
    first = out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]]
    assert first.rank == 1 and first.logprob == pytest.approx(float(ref[len(p) - 1].max()), abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for i in range(1, len(p)):
        assert out.prompt_logprobs[i][p[i]].logprob == pytest.approx(float(ref[i - 1, p[i]]), abs=1e-4)


def test_stop_token_ids_min_tokens_and_stop_strings(llm, hf_refs):
    ref = hf_refs[tuple(PROMPTS[0])]
    stop_tok = ref[3]
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    k = ref.index(stop_tok)
    assert c.token_ids == ref[: k + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    # min_tokens suppresses the stop token until enough tokens exist.
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(temperature=0, max_tokens=10, min_tokens=k + 2, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) >= k + 2
    full = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full[4:7]
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=10, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == full[: full.index(stop)]
    incl = llm.generate(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(temperature=0, max_tokens=10, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert incl.text == full[: full.index(stop) + len(stop)]
    check_free(llm)


def test_stop_token_text_kept_only_with_include_stop_str(llm, hf_refs):
    """A stop token id's own text is in the output only with include_stop_str_in_output (vLLM V1)."""
    ref = hf_refs[tuple(PROMPTS[0])]
    stop_tok = ref[3]
    k = ref.index(stop_tok)
    tok = llm.get_tokenizer()
    for include, n in ((False, k), (True, k + 1)):
        c = llm.generate(
            {"prompt_token_ids": PROMPTS[0]},
            SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok], include_stop_str_in_output=include),
            use_tqdm=False,
        )[0].outputs[0]
        assert c.token_ids == ref[: k + 1] and c.stop_reason == stop_tok
        assert c.text == tok.decode(ref[:n], skip_special_tokens=True)


def test_generation_config_eos_ids_and_max_new_tokens(tiny, hf_refs, tmp_path):
    """generation_config.json's extra EOS ids stop like stop_token_ids and report their id as stop_reason
    (the tokenizer's own EOS reports None); its max_new_tokens is the default params' max_tokens, and does not cap
    an explicit max_tokens (vLLM: update_from_generation_config takes only the EOS ids from the file)."""
    model_dir = shutil.copytree(tiny[0], tmp_path / "model")
    ref = hf_refs[tuple(PROMPTS[0])]
    extra = ref[2]
    with open(model_dir / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [2, extra], "max_new_tokens": 6}, f)
    llm = make_llm(str(model_dir))
    c = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[
        0
    ].outputs[0]
    assert c.token_ids == ref[: ref.index(extra) + 1] and c.finish_reason == "stop" and c.stop_reason == extra
    c = llm.generate(
        {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    assert c.outputs[0].token_ids == ref[:10] and c.outputs[0].finish_reason == "length"
    assert llm.get_default_sampling_params().max_tokens == 6
    c = llm.generate({"prompt_token_ids": PROMPTS[0]}, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) <= 6 and (c.finish_reason == "stop" or len(c.token_ids) == 6)


def test_generation_config_sampling_defaults_apply_whatever_do_sample_says(tiny, tmp_path):
    """vLLM's get_diff_sampling_param reads temperature, top_p, top_k, min_p and repetition_penalty from
    generation_config.json with no do_sample gate (many checkpoints ship do_sample false beside them)."""
    model_dir = shutil.copytree(tiny[0], tmp_path / "model")
    with open(model_dir / "generation_config.json", "w") as f:
        json.dump(
            {
                "do_sample": False,
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "min_p": None,
                "repetition_penalty": 1.05,
            },
            f,
        )
    sp = make_llm(str(model_dir)).get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (0.6, 0.9, 20, 0.0, 1.05)


def test_max_logprobs_minus_one_returns_the_whole_vocabulary(tiny):
    llm = make_llm(tiny[0], max_logprobs=-1)
    V = llm.llm_engine.vocab_size
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[1]},
        SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=5, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [len(d) for d in out.outputs[0].logprobs] == [V, V]
    assert out.prompt_logprobs[0] is None and 5 <= len(out.prompt_logprobs[1]) <= 6
    ranks = sorted(lp.rank for lp in out.outputs[0].logprobs[0].values())
    assert ranks == list(range(1, V + 1))


def test_failed_add_leaves_nothing_behind(llm, monkeypatch):
    """A request whose set-up fails after it was registered (here: the bad-words encoding) is removed again:
    a half-added request used to wait forever and hang every later generate()."""
    from jaxllm.engine import llm_engine

    def boom(seq, tokenizer):
        raise RuntimeError("bad words exploded")

    monkeypatch.setattr(llm_engine, "bias_row", boom)
    with pytest.raises(RuntimeError, match="exploded"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(bad_words=["x"], max_tokens=10), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 10
    check_free(llm)


def test_request_failing_mid_generate_aborts_the_call(llm, monkeypatch):
    """A request that fails while its output is processed raises out of generate(), and the call's other
    requests are aborted with it: nothing stays in the engine, which keeps working."""
    real = llm.llm_engine._on_token

    def on_token(req, *args):
        if req.prompt_token_ids == [9, 9]:
            raise RuntimeError("detokenizer exploded")
        return real(req, *args)

    monkeypatch.setattr(llm.llm_engine, "_on_token", on_token)
    with pytest.raises(RuntimeError, match="exploded"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [9, 9]}], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.llm_engine._requests  # (the step already in flight is collected by the next call)
    check_free(llm)
    assert len(llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 10
    assert not llm.llm_engine.has_unfinished_requests()
    check_free(llm)


def test_offline_api_input_errors(llm):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.generate("x", {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts \(2\) and priority \(1\)"):
        llm.generate(["a", "b"], GREEDY, priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(5, use_tqdm=False)
    with pytest.raises(ValueError, match="Got priority 2 but Priority scheduling is not enabled"):  # fcfs
        llm.generate(["a", "b"], GREEDY, priority=[0, 2], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="logit_bias must map token ids to numbers"):
        SamplingParams(logit_bias={"abc": 1})
    with pytest.raises(ValueError, match="logit_bias values must be finite"):
        SamplingParams(logit_bias={1: float("nan")})
    with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
        SamplingParams(bad_words=[1])
    assert SamplingParams(bad_words="abc").bad_words == ["abc"]
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of ints"):
        llm.generate({"prompt_token_ids": [1.0, 2]}, use_tqdm=False)
    for name, value in (("max_model_len", "512"), ("max_num_seqs", 0), ("max_num_batched_tokens", -1)):
        with pytest.raises(ValueError, match=f"{name} must be a positive integer, got {value!r}"):
            LLM(None, **{name: value})
    assert not llm.llm_engine.has_unfinished_requests()


def test_text_prompts_and_chat(llm, monkeypatch):
    outs = llm.generate(["the engine was paged", "blocks were counted"], GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    assert outs[0].prompt_token_ids == tok.encode("the engine was paged")
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)
    chat = llm.chat([{"role": "user", "content": "the scheduler saw"}], GREEDY, use_tqdm=False)
    assert (
        chat[0].outputs[0].token_ids
        and chat[0].prompt_token_ids[-1] == tok.encode("<s>assistant:", add_special_tokens=False)[-1]
    )
    # OpenAI content parts: text parts joined with newlines (vLLM); other parts are refused
    parts = llm.chat(
        [{"role": "user", "content": [{"type": "text", "text": "the scheduler"}, {"type": "text", "text": "saw"}]}],
        GREEDY,
        use_tqdm=False,
    )
    joined = llm.chat([{"role": "user", "content": "the scheduler\nsaw"}], GREEDY, use_tqdm=False)
    assert parts[0].prompt_token_ids == joined[0].prompt_token_ids
    with pytest.raises(ValueError, match="Content part type 'image_url'"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    # vLLM's argument order (lora_request fourth) and its content formats; a message without a role is refused
    # (it was dropped from the prompt), as are pooling calls on a generative model
    again = llm.chat([{"role": "user", "content": "the scheduler saw"}], GREEDY, False, None, None, "string")
    assert again[0].outputs[0].token_ids == chat[0].outputs[0].token_ids
    seen, apply = [], tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda conv, **kw: seen.append(conv) or apply(conv, **kw))
    template = "{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]}]
    for fmt in ("openai", "auto"):
        llm.chat(msgs, GREEDY, use_tqdm=False, chat_template=template, chat_template_content_format=fmt)
    monkeypatch.undo()
    assert seen[0][0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert seen[1][0]["content"] == "a\nb"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat([{"role": "user", "content": "x"}], GREEDY, chat_template_content_format="json")
    with pytest.raises(ValueError, match="must be a dict with a 'role' string"):
        llm.chat([{"role": "system", "content": "s"}, {"content": "where did I go"}], GREEDY, use_tqdm=False)
    for call in (llm.encode, llm.embed):
        with pytest.raises(ValueError, match=r"only supported for pooling models"):
            call("x")
    assert not llm.llm_engine.has_unfinished_requests()


def test_penalties_and_logit_bias(llm, hf_refs):
    ref = hf_refs[tuple(PROMPTS[2])]
    banned = ref[0]
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[2]},
        SamplingParams(temperature=0, max_tokens=10, logit_bias={banned: -100.0}, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert banned not in out.token_ids
    rep = llm.generate(
        {"prompt_token_ids": PROMPTS[2]},
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=5.0, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert rep.token_ids != ref
    allowed = llm.generate(
        {"prompt_token_ids": PROMPTS[2]},
        SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=[10, 11], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert set(allowed.token_ids) <= {10, 11}
    check_free(llm)


def test_use_tqdm_callable_makes_the_progress_bar(llm):
    """vLLM's use_tqdm also takes a callable that builds the bar (e.g. functools.partial(tqdm, leave=False))."""
    made = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.n = kw, 0
            made.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], GREEDY, use_tqdm=Bar)
    assert len(outs) == 3 and len(made) == 1
    assert made[0].kw["total"] == 3 and made[0].n == 3 and made[0].closed and "disable" not in made[0].kw


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, hf_refs):
    """vLLM's SamplingParams.truncate_prompt_tokens: the prompt's last k tokens (-1: max_model_len); larger
    than max_model_len, or 0, is refused."""
    long = [9, 9, 9] + PROMPTS[0]
    (out,) = llm.generate(
        {"prompt_token_ids": long},
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, truncate_prompt_tokens=len(PROMPTS[0])),
        use_tqdm=False,
    )
    assert out.prompt_token_ids == PROMPTS[0] and out.outputs[0].token_ids == hf_refs[tuple(PROMPTS[0])]
    (out,) = llm.generate(
        {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2, truncate_prompt_tokens=-1), use_tqdm=False
    )
    assert out.prompt_token_ids == PROMPTS[0]
    with pytest.raises(
        ValueError,
        match=r"truncate_prompt_tokens value \(129\) is greater than max_model_len "
        r"\(128\). Please, select a smaller truncation size.",
    ):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(truncate_prompt_tokens=129), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1 or -1, got 0"):
        SamplingParams(truncate_prompt_tokens=0)
    check_free(llm)


def test_priority_scheduling_policy(tiny):
    """scheduling_policy="priority" (vLLM's): lower priority values are admitted first; fcfs refuses non-zero
    priorities (above). With room for one sequence at a time, the order of admission is the order of the
    first tokens."""
    llm = make_llm(tiny[0], scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}], GREEDY, priority=[5, 1], use_tqdm=False
    )
    first = [o.metrics.first_token_time for o in outs]
    assert first[1] < first[0]
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority'"):
        make_llm(tiny[0], scheduling_policy="lifo")
    check_free(llm)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"temperature": -1}, "temperature must be non-negative, got -1."),
        ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0."),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5."),
        ({"top_k": -2}, r"top_k must be 0 \(disable\), or at least 1, got -2."),
        ({"min_p": 2}, r"min_p must be in \[0, 1\], got 2."),
        ({"presence_penalty": 3}, r"presence_penalty must be in \[-2, 2\], got 3."),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3."),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0."),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"max_tokens": 3, "min_tokens": 4}, "min_tokens must be less than or equal to max_tokens=3, got 4."),
        ({"stop": ["a", ""]}, "stop cannot contain an empty string."),
        ({"stop": "a", "detokenize": False}, "stop strings are only supported when detokenize is True"),
        ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"logprobs": -2}, "logprobs must be non-negative, got -2."),
        # types, which otherwise failed the whole batch mid-run (black-box report, stop 70)
        ({"logprobs": 1.5}, "logprobs must be an integer, got 1.5."),
        ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5."),
        ({"top_k": True}, "top_k must be an integer, got True."),
        ({"temperature": "1"}, "temperature must be a number, got '1'."),
        ({"stop": [1]}, r"stop must be a string or a list of strings, got \[1\]."),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5."),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers, got 5."),
        ({"allowed_token_ids": [1.0]}, r"allowed_token_ids must be a list of integers, got \[1.0\]."),
    ],
)
def test_sampling_params_validation(kw, msg):
    with pytest.raises(ValueError, match=msg) as e:
        SamplingParams(**kw)
    assert e.value.parameter in kw  # names the field (the server's error param)


def test_sampling_params_small_temperature_and_unset_seed_as_vllm(caplog):
    """vLLM's SamplingParams: a positive temperature under 0.01 is raised to 0.01 with a warning (it samples: n > 1
    is allowed), and seed=-1 means no seed."""
    with caplog.at_level("WARNING", logger="jaxllm"):
        sp = SamplingParams(temperature=1e-6, n=2)
    assert (sp.temperature, sp.n) == (0.01, 2) and "maxed it out to 0.01" in caplog.text
    assert SamplingParams(temperature=0.003).temperature == 0.01 and SamplingParams(temperature=0).greedy
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=5).seed == 5


def test_sampling_params_take_numpy_numbers_and_tuples():
    sp = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), stop=("a",), stop_token_ids=(1, 2))
    assert sp.max_tokens == 3 and sp.stop == ["a"] and sp.stop_token_ids == [1, 2]


def test_engine_level_validation(llm):
    with pytest.raises(
        ValueError,
        match=r"The decoder prompt \(length 200\) is longer than the maximum model "
        r"length of 128",
    ):
        llm.generate({"prompt_token_ids": [1] * 200}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="Requested logprobs of 21, which is greater than max allowed: 20"):
        llm.generate("x", SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [5, 100000]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="cannot be empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    # A bad prompt in a list leaves nothing behind, and the engine still works.
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1] * 200}], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    check_free(llm)
    assert llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_runner_rows_come_back_when_a_step_schedules_nothing(tiny):
    """One sequence finishes while the other waits on its last token still on the device: that schedule() is
    empty and no step runs. The finished sequence's InputBatch row must still come back (it leaked, one per
    such step, until generate() failed with "InputBatch has no free row")."""
    llm = make_llm(tiny[0], max_num_seqs=2)
    batch = llm.llm_engine.runner.batch
    rows = batch.tables.shape[0]
    params = [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    ]
    for _ in range(3 * rows):
        outs = llm.generate([{"prompt_token_ids": [5, 9]}, {"prompt_token_ids": [7]}], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 5]
    assert len(batch._free) + len(llm.llm_engine.scheduler._freed) == rows
    check_free(llm)


def test_start_up_objects_are_moved_out_of_the_collector(tiny):
    """A full collection walked every object start-up left (~10^6 with an 8B model's engine) and stalled the
    step in flight by up to 0.48 s on the H100's host. The engine freezes them once built, as vLLM does."""
    gc.unfreeze()
    llm = make_llm(tiny[0])
    assert gc.get_freeze_count() > len(gc.get_objects())  # most live objects are out of the collector's view
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_startup_fails_clearly_when_the_gpu_memory_is_not_free(monkeypatch):
    """As vLLM: if another process holds so much of a GPU the engine will use that gpu_memory_utilization of it
    is not free, startup fails naming both figures (before the backend starts; the driver is asked directly)."""
    from jaxllm.engine import device_memory

    GiB = 2**30
    asked = []
    free = {0: (75 * GiB, 80 * GiB), 1: (20.5 * GiB, 80 * GiB)}
    monkeypatch.setattr(device_memory, "_cuda_free_memory", lambda n: asked.append(n) or [free[i] for i in range(n)])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)

    def check(fraction, n):
        monkeypatch.setattr(device_memory, "_free_memory_checked", False)
        device_memory.check_free_device_memory(fraction, n)

    check(0.9, 1)  # 75 of 80 GiB free: enough
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Free memory on device (20.5/80.0 GiB) on startup is less than desired GPU memory utilization (0.9, "
            "72.0 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
        ),
    ):
        check(0.9, 2)  # tp 2: the second GPU is mostly taken
    device_memory.check_free_device_memory(0.9, 2)  # once per process
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    check(0.9, 2)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    check(0.9, 2)
    assert asked == [1, 2]


def test_gpu_memory_utilization_is_a_fraction_of_the_whole_device(monkeypatch):
    """jax's GPU allocator takes 0.75 of the device unless told otherwise, and the KV cache was sized inside
    that: 0.9 meant 0.75 of the device. The engine asks for gpu_memory_utilization before the backend starts
    (not when the user set the variable), and sizes the cache from the whole device. An engine without
    pipeline stages also asks for the stream-ordered allocator (cuda_async), unless the user chose one."""
    code = (
        "import os, sys; from jaxllm.engine.device_memory import request_device_memory; "
        "request_device_memory(0.85, int(sys.argv[1])); "
        "print(os.environ.get('XLA_CLIENT_MEM_FRACTION'), os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR'))"
    )
    env = {k: v for k, v in os.environ.items() if "MEM_FRACTION" not in k and k != "XLA_PYTHON_CLIENT_ALLOCATOR"}

    def run(e, pp="1"):
        return subprocess.run(
            [sys.executable, "-c", code, pp], env=e, capture_output=True, text=True, check=True
        ).stdout.split()[-2:]

    assert run(env) == ["0.8500", "cuda_async"]  # no pipeline stages (any tp): the stream-ordered allocator too
    assert run(env, pp="2") == ["0.8500", "None"]  # pp > 1: jax's default allocator
    # the user's choices stand
    assert run(env | {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}) == ["None", "cuda_async"]
    assert run(env | {"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"}) == ["0.8500", "bfc"]

    from types import SimpleNamespace

    import jax

    from jaxllm.engine import setup

    gib = 2**30
    dev = SimpleNamespace(memory_stats=lambda: {"bytes_limit": 72 * gib, "bytes_in_use": 16 * gib})
    monkeypatch.setattr(jax, "devices", lambda: [dev])
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=128, vocab_size=256, dtype="float32")
    args = SimpleNamespace(num_gpu_blocks_override=None, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")  # 72 GiB of an 80 GiB device
    blocks = setup._num_blocks(args, gib // 16, 16, 8, cfg, True)
    assert blocks == (72 - 16 - 1) * 16  # all of the allocator's 72 GiB, less weights and the 1 GiB floor
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")  # jax's default 0.75: 72 GiB of a 96 GiB device
    args.gpu_memory_utilization = 0.5  # 48 GiB of it
    assert setup._num_blocks(args, gib // 16, 16, 8, cfg, True) == (48 - 16 - 1) * 16
    # before the weights load (they load while the steps compile): their bytes are counted in advance
    dev.memory_stats = lambda: {"bytes_limit": 72 * gib, "bytes_in_use": 0}
    assert setup._num_blocks(args, gib // 16, 16, 8, cfg, True, weight_bytes=16 * gib) == (48 - 16 - 1) * 16


def test_max_model_len_and_kv_errors(tiny):
    with pytest.raises(ValueError, match=r"User-specified max_model_len \(1000\) is greater than the derived"):
        make_llm(tiny[0], max_model_len=1000)
    with pytest.raises(ValueError, match="decrease max_model_len"):
        make_llm(tiny[0], num_gpu_blocks_override=4, max_model_len=128)


def test_request_output_has_vllms_fields(llm):
    prompt = [17, 4, 96, 3, 58, 21, 9, 40, 2, 33, 70]  # 1 full block of 8: cached by the second request
    for cached in (0, 8):
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == cached
    assert out.lora_request is None and out.outputs[0].lora_request is None and out.multi_modal_placeholders == {}
    assert out.encoder_prompt is None and out.kv_transfer_params is None
    assert repr(out).startswith(
        f"RequestOutput(request_id={out.request_id}, prompt=None, prompt_token_ids="
        f"{prompt}, encoder_prompt=None, encoder_prompt_token_ids=None, "
    )
    assert repr(out).endswith("lora_request=None, num_cached_tokens=8, multi_modal_placeholders={})")


def test_max_model_len_caps_output(llm):
    out = llm.generate(
        {"prompt_token_ids": [3] * 125}, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    # max_tokens=None fills the context; a prompt of exactly max_model_len still gets its one token (vLLM)
    for n, want in ((100, 28), (128, 1)):
        out = llm.generate(
            {"prompt_token_ids": [3] * n},
            SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
            use_tqdm=False,
        )[0].outputs[0]
        assert len(out.token_ids) == want and out.finish_reason == "length"
    check_free(llm)


def whole_cache_rewrites(runner) -> list[str]:
    """HLO instructions of the runner's compiled steps that convert a whole layer's KV pages, or hold them in
    another dtype than the pages' own: a step that does rewrites every layer's cache (its cost grows with the
    cache, not the batch). An in-place scatter keeps the pages' dtype and converts only the new rows."""
    pages = runner.kv_caches[0][0]
    K, P, S, H = pages.shape
    shapes = {f"{K},{P},{S},{H}", f"{K},{P * S},{H}"}
    storage = {"uint8": "u8", "float32": "f32", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}[str(pages.dtype)]
    found = []
    for exe in runner.programs.compiled.values():
        for m in re.finditer(r"= (\w+)\[([\d,]+)\]\{[^}]*\} ([\w-]+)\(", exe.as_text()):
            dtype, shape, op = m.groups()
            if shape in shapes and (dtype != storage or op in ("convert", "bitcast-convert")):
                found.append(m.group(0))
    return found


@pytest.mark.parametrize("kv_dtype, np_name", [("fp8", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
def test_fp8_kv_cache(tiny, hf_refs, kv_dtype, np_name):
    llm = make_llm(tiny[0], kv_cache_dtype=kv_dtype)
    runner = llm.llm_engine.runner
    assert str(runner.kv_values_dtype) == np_name
    # On CPU the pages hold the fp8 values' bit patterns (see the test below): 1 byte per value as on a GPU.
    assert runner.kv_caches[0][0].dtype == jnp.uint8 and runner.attn.kv_dtype == np_name
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert runner.programs.compiled and not whole_cache_rewrites(runner)
    # With k_scale = v_scale = 1 (vLLM's default without calibration) this tiny model's small K/V values sit near
    # e4m3's subnormal range, so near-tied logits can flip; a broken fp8 path gives random tokens (1/128 each).
    same_first = sum(o.outputs[0].token_ids[0] == hf_refs[tuple(p)][0] for o, p in zip(outs, PROMPTS))
    assert same_first >= 3
    check_free(llm)


def test_cpu_fp8_kv_pages_are_written_in_place(tiny, monkeypatch):
    """XLA's CPU backend widens an fp8 scatter's whole operand and narrows it back, so with fp8-typed pages each
    step rewrote every layer's cache (1.7 s per token with a 256 MB cache, bench/probes/cpu_fp8_kv.py). The CPU
    pages hold the fp8 bit patterns as uint8 instead: the compiled steps convert no whole cache, and tokens and
    logprobs are those of fp8-typed pages (the same bytes)."""
    from jaxllm.engine import runner as runner_mod

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run():
        llm = make_llm(tiny[0], kv_cache_dtype="fp8")
        outs = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        return (
            llm.llm_engine.runner,
            [o.token_ids for o in outs],
            [[{t: lp.logprob for t, lp in d.items()} for d in o.logprobs] for o in outs],
        )

    r, tokens, lps = run()
    assert r.kv_caches[0][0].dtype == jnp.uint8 and not whole_cache_rewrites(r)
    monkeypatch.setattr(runner_mod, "kv_storage_dtype", lambda dtype: dtype)
    r8, tokens8, lps8 = run()
    assert r8.kv_caches[0][0].dtype == jnp.float8_e4m3fn
    assert whole_cache_rewrites(r8), "the check must see the widened scatter of fp8-typed pages"
    assert tokens == tokens8 and lps == lps8


def test_bad_kv_cache_dtype(tiny):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_llm(tiny[0], kv_cache_dtype="int4")


def test_non_default_sampler_flags_never_wait_for_a_step_compile(tiny):
    """After warm-up, a step with top-p / top-k, penalties, logit biases or logprobs whose step program is not
    compiled yet runs the bucket's start-up program and a sampler-only program on its rows while that step
    program compiles in the background; once it is ready the steps use it. Both ways give the same tokens and
    logprobs."""
    import threading

    llm = make_llm(tiny[0], enforce_eager=False, compilation_cache_dir=None)
    runner = llm.llm_engine.runner
    n_steps = len(runner.programs.compiled)
    gate = threading.Event()
    compile_in_background = runner.programs._compile_in_background
    runner.programs._compile_in_background = lambda v, args: gate.wait() and compile_in_background(v, args)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=6, ignore_eos=True),
        SamplingParams(
            temperature=1.0,
            presence_penalty=0.5,
            repetition_penalty=1.2,
            seed=4,
            max_tokens=6,
            ignore_eos=True,
            logprobs=2,
        ),
        SamplingParams(temperature=0, logit_bias={7: 5.0}, max_tokens=6, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]

    def run():
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [o.token_ids for o in outs], [
            [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs or []] for o in outs
        ]

    split = run()
    assert len(runner.programs.compiled) == n_steps and runner.programs.samplers and runner.programs.pending
    gate.set()
    runner.programs.wait_for_background_compiles()
    assert len(runner.programs.compiled) > n_steps and not runner.programs.pending
    n_samplers = len(runner.programs.samplers)
    whole = run()
    assert len(runner.programs.samplers) == n_samplers  # the step programs ran
    assert split[0] == whole[0]
    for a, b in zip(split[1], whole[1]):
        assert [sorted(d) for d in a] == [sorted(d) for d in b]
        for da, db in zip(a, b):
            assert [da[t] for t in sorted(da)] == pytest.approx([db[t] for t in sorted(db)], abs=1e-5)
    check_free(llm)


def test_background_compiles_at_tp_2(tiny):
    """At tp 2 a step program compiled in the background (here: logprobs') is lowered with the start-up prev_tokens
    as they are (uncommitted): their one-device spec made the compile fail against the params' mesh, so those steps
    ran split for good, with an error in the log."""
    llm = make_llm(tiny[0], enforce_eager=False, compilation_cache_dir=None, tensor_parallel_size=2)
    programs = llm.llm_engine.runner.programs
    n_steps = len(programs.compiled)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)[0].outputs[0]
    programs.wait_for_background_compiles()
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)[0].outputs[0]
    assert not programs._split_only and len(programs.compiled) > n_steps
    assert again.token_ids == first.token_ids
    check_free(llm)


def test_a_failed_background_compile_keeps_its_steps_running_split(tiny, hf_refs):
    """A step program compiling in the background that fails (here: raises) is logged and its steps keep
    running split: the requests finish with the right tokens. The error was raised from the step that found
    it done, failing every request in it (and killing AsyncLLM's engine loop, so every open request)."""
    llm = make_llm(tiny[0], enforce_eager=False, compilation_cache_dir=None)
    runner = llm.llm_engine.runner
    tries = []

    def fail(v, args):
        tries.append(v)
        raise RuntimeError("compile failed")

    runner.programs._compile_in_background = fail
    params = [GREEDY, SamplingParams(temperature=0, logprobs=1, max_tokens=10, ignore_eos=True)] * 2
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert token_ids(outs) == [hf_refs[tuple(p)] for p in PROMPTS[:4]]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        check_free(llm)
    runner.programs.wait_for_background_compiles()
    assert tries and len(tries) == len(set(tries))  # each failed variant is not compiled again


def test_long_context_decode_steps_run_their_own_program_once_compiled(tiny, hf_refs):
    """Decode-only steps whose longest live context reaches runner.host.long_decode_from run their bucket's
    long-context program (StepVariant.long_context; on Hopper its decode attention is the Mosaic GPU kernel, on
    CPU the same computation): the bucket's first such step starts that program's compile in the background
    and runs the start-up program meanwhile; once it is filed, long steps run it, shorter and mixed steps never,
    and a step with other sampler flags runs split on it. Greedy tokens equal HF's throughout."""
    import threading

    llm = make_llm(tiny[0], enforce_eager=False, compilation_cache_dir=None)
    runner, programs = llm.llm_engine.runner, llm.llm_engine.runner.programs
    assert runner.host.long_decode_from == 0  # off on CPU (long_decode_from)
    ran = []
    run_step = runner.run_step
    runner.run_step = lambda v, mode, host_args, *a: (
        ran.append((v, mode, host_args[2])) or run_step(v, mode, host_args, *a)
    )
    release, compile_step = threading.Event(), programs._compile_in_background
    programs._compile_in_background = lambda v, args: release.wait(60) and compile_step(v, args)
    runner.host.long_decode_from = 24  # prompt 0 (20 tokens) reaches it after 4 of its 10 tokens
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = [hf_refs[tuple(p)] for p in PROMPTS]

    def is_long(meta):
        return meta.decode_only and int(meta.seq_lens.max()) >= 24

    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert sum(is_long(meta) for _, _, meta in ran) >= 5  # ... which ran the start-up programs meanwhile
    assert not any(v.long_context or meta.long_context for v, _, meta in ran)
    long_v = [v for v in programs.pending if v.long_context]
    assert long_v == [StepVariant(8, 8, True, SamplerFlags(), 0, long_context=True)]
    # With logprobs and every decode step long, those steps run split on the start-up program meanwhile and start
    # no whole program for their flags (the long one would leave it unused once ready)
    runner.host.long_decode_from, ran[:] = 21, []  # prompt 0's first decode step has 21 tokens
    logprobs = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    assert token_ids(llm.generate(prompts, logprobs, use_tqdm=False)) == expected
    assert {mode for v, mode, meta in ran if meta.decode_only} == {"split"}
    assert not [v for v in (*programs.pending, *programs.compiled) if v.decode_only and v.flags != SamplerFlags()]
    runner.host.long_decode_from = 24
    release.set()
    programs.wait_for_background_compiles()
    assert long_v[0] in programs.compiled
    for params in (GREEDY, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)):
        ran.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert token_ids(outs) == expected
        check_free(llm)
        assert all(v.long_context == meta.long_context == is_long(meta) for v, _, meta in ran)
        assert sum(v.long_context for v, _, _ in ran) >= 5
    assert "split" in {mode for v, mode, _ in ran if v.long_context}  # logprobs: their whole program compiling
    programs.wait_for_background_compiles()


def test_long_decode_from_only_where_the_long_program_differs(monkeypatch):
    """The long-context programs exist on Hopper with the Pallas backend, 16-bit KV pages and the decode backend
    left to "auto", for sequences that can reach the length ($JAXLLM_LONG_DECODE_CONTEXT, default 2048)."""
    from jaxllm.engine import runner as runner_mod
    from jaxllm.models.attention import AttentionConfig

    pallas, bf16 = AttentionConfig(backend="pallas"), jnp.bfloat16
    monkeypatch.delenv("JAXLLM_DECODE_BACKEND", raising=False)
    monkeypatch.delenv("JAXLLM_LONG_DECODE_CONTEXT", raising=False)
    assert runner_mod.long_decode_from(pallas, 8192, bf16) == 0  # not on Hopper
    monkeypatch.setattr(runner_mod, "on_hopper", lambda: True)
    assert runner_mod.long_decode_from(pallas, 8192, bf16) == 2048
    assert runner_mod.long_decode_from(pallas, 8192, jnp.float16) == 2048
    assert runner_mod.long_decode_from(pallas, 2047, bf16) == 0
    assert runner_mod.long_decode_from(pallas, 8192, jnp.float8_e4m3fn) == 0
    assert runner_mod.long_decode_from(AttentionConfig(), 8192, bf16) == 0
    assert runner_mod.long_decode_from(AttentionConfig(backend="pallas", interpret=True), 8192, bf16) == 0
    monkeypatch.setenv("JAXLLM_LONG_DECODE_CONTEXT", "4096")
    assert runner_mod.long_decode_from(pallas, 8192, bf16) == 4096
    monkeypatch.setenv("JAXLLM_LONG_DECODE_CONTEXT", "0")
    assert runner_mod.long_decode_from(pallas, 8192, bf16) == 0
    monkeypatch.delenv("JAXLLM_LONG_DECODE_CONTEXT")
    monkeypatch.setenv("JAXLLM_DECODE_BACKEND", "triton")
    assert runner_mod.long_decode_from(pallas, 8192, bf16) == 0
    monkeypatch.setenv("JAXLLM_DECODE_BACKEND", "flash")
    with pytest.raises(ValueError, match="'flash' is not one of"):
        runner_mod.long_decode_from(pallas, 8192, bf16)
    monkeypatch.delenv("JAXLLM_DECODE_BACKEND")
    monkeypatch.setenv("JAXLLM_LONG_DECODE_CONTEXT", "2k")
    with pytest.raises(ValueError, match="JAXLLM_LONG_DECODE_CONTEXT='2k' is not an integer"):
        runner_mod.long_decode_from(pallas, 8192, bf16)


@pytest.mark.parametrize(
    "var,value,message",
    [
        ("JAXLLM_DECODE_BACKEND", "flash", "JAXLLM_DECODE_BACKEND='flash' is not one of"),
        ("JAXLLM_LONG_DECODE_CONTEXT", "2k", "JAXLLM_LONG_DECODE_CONTEXT='2k' is not an integer"),
    ],
)
def test_bad_decode_switches_fail_before_the_model_loads(monkeypatch, tmp_path, var, value, message):
    """A bad decode-attention switch is named before anything loads (here the model folder does not even exist)."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "no-model"))


def test_exit_does_not_wait_for_queued_background_compiles(tiny):
    """At interpreter exit the background compiles still queued are dropped (only the one running finishes):
    the process waited for every one of them (a whole step each: seconds to minutes on a large model, for
    every flags / bucket / row width variant requested so far) before it could exit. In its own process."""
    script = f"""
import time
from jaxllm import LLM, SamplingParams
llm = LLM({tiny[0]!r}, dtype="float32", num_gpu_blocks_override=96, max_num_seqs=8, max_num_batched_tokens=64,
          block_size=8, max_model_len=128, compilation_cache_dir=None)
runner = llm.llm_engine.runner
compile_step = runner.programs._compile
runner.programs._compile = lambda *a: print("compiling", flush=True) or time.sleep(4) or compile_step(*a)
params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **k)
          for k in (dict(logprobs=1), dict(logprobs=1, logit_bias={{3: 1.0}}), dict(presence_penalty=0.5))]
llm.generate([[1, 2, 3]] * 3, params, use_tqdm=False)
print("queued", len(runner.programs.pending), flush=True)
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("queued"))
    # no compile starts once the script is done (each takes 4 s here, so one finishing just as the script
    # ends, and its successor starting, is unlikely: with 1 s a CI run under load caught that window once)
    assert int(lines[at].split()[1]) >= 3 and "compiling" in lines[:at] and "compiling" not in lines[at:]


def test_cpu_kv_cache_of_a_16_bit_model_is_stored_as_float32(tiny, monkeypatch):
    """XLA's CPU backend widens a bf16 scatter's whole operand (the KV write copied every layer's cache each
    step), so on CPU the pages are float32 holding bf16 values: same tokens and logprobs as bf16 pages."""
    from jaxllm.engine import runner as runner_mod

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run():
        llm = make_llm(tiny[0], dtype="bfloat16")
        r = llm.llm_engine.runner
        outs = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        return (
            r,
            [o.token_ids for o in outs],
            [[{t: lp.logprob for t, lp in d.items()} for d in o.logprobs] for o in outs],
        )

    r, tokens, lps = run()
    assert r.kv_caches[0][0].dtype == jnp.float32
    assert r.kv_bytes_per_block(r.cfg, 8, "auto") == 2 * r.cfg.num_layers * r.cfg.num_kv_heads * 8 * r.cfg.head_dim * 4
    monkeypatch.setattr(runner_mod, "kv_storage_dtype", lambda dtype: dtype)
    r16, tokens16, lps16 = run()
    assert r16.kv_caches[0][0].dtype == jnp.bfloat16
    assert tokens == tokens16 and lps == lps16


def test_penalty_sampler_for_the_next_row_width_compiles_ahead(tiny):
    """Penalty rows (each sequence's token ids) double their width as sequences grow; each width is its own
    sampler program. The next width's is compiled in the background when a width is first used, so a running
    request does not wait for the compiler when its sequence crosses it."""
    llm = make_llm(tiny[0], enforce_eager=False, compilation_cache_dir=None)
    runner = llm.llm_engine.runner

    def penalty_widths():
        return {k[2][0] for k in runner.programs.samplers if k[1].penalties}

    def generate(n):
        sp = SamplingParams(temperature=1.0, presence_penalty=0.5, seed=5, max_tokens=n, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": PROMPTS[4]}, sp, use_tqdm=False)[0].outputs[0]
        runner.programs.wait_for_background_compiles()
        return out

    generate(4)  # 9 + 4 tokens: rows of width 16
    assert penalty_widths() == {16, 32}  # 32 compiled ahead, before any sequence needed it
    assert len(generate(12).token_ids) == 12  # 9 + 12 tokens: crosses into 32 (and compiles 64 ahead)
    assert penalty_widths() == {16, 32, 64}
    check_free(llm)


def test_packed_host_inputs_round_trip():
    """A step's host inputs (int32, uint32 seeds, bool rows, float32, 2-D tables, a static field) go to the
    device as one int32 and one float32 array and come back out of the jitted step equal, bit for bit."""
    import jax
    import numpy as np

    from jaxllm.engine.packing import pack_host_args, unpack_host_args
    from jaxllm.engine.sampler import SamplingMetadata
    from jaxllm.models.attention import AttentionMetadata

    rng = np.random.default_rng(0)
    B, T = 3, 5
    i32 = lambda *s: rng.integers(-5, 1000, s).astype(np.int32)  # noqa: E731
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    meta = AttentionMetadata(i32(T), i32(T), i32(B), i32(B + 1), i32(B, 4), True)
    smd = SamplingMetadata(
        f32(B),
        f32(B),
        i32(B),
        f32(B),
        f32(B),
        f32(B),
        f32(B),
        np.array([0, 2**32 - 1, 2**31 + 5], np.uint32),
        i32(B),
        i32(B, 2),
        np.array([[True, False], [False, False], [True, True]]),
        i32(B, 1),
        f32(B, 1),
        i32(B, 3),
        i32(2, 4),
        i32(B),
    )
    host = (i32(T), i32(T), meta, i32(B), smd, i32(T))
    ints, floats, layout = pack_host_args(host)
    assert ints.dtype == np.int32 and floats.dtype == np.float32
    # every array starts on a 256-byte boundary (Mosaic GPU kernels refuse inputs that do not)
    assert all(off % 64 == 0 for _, _, _, off in layout.leaves)
    got = jax.jit(unpack_host_args, static_argnums=2)(ints, floats, layout)
    want_leaves, want_tree = jax.tree.flatten(host)
    got_leaves, got_tree = jax.tree.flatten(got)
    assert got_tree == want_tree and got[2].decode_only is True
    for g, w in zip(got_leaves, want_leaves):
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)
    with pytest.raises(TypeError, match="dtype int64 cannot be packed"):
        pack_host_args((np.zeros(3, np.int64),))
