"""LLM.beam_search (vLLM's offline beam search) against HF transformers' log-probabilities on the same tiny model:
the engine's beams equal a beam search run on HF's next-token log-softmax, beam width 1 is HF's greedy output, and
the search's own rules (EOS ends a beam, length penalty, max_model_len) hold on a scripted model."""

import math

import pytest
import torch

from jaxllm import LLM, BeamSearchParams, TextPrompt, TokensPrompt
from jaxllm.beam_search import beam_search_score, run_beam_search
from jaxllm.outputs import Logprob, RequestOutput
from jaxllm.sampling_params import ParameterError
from tests.tiny_models import make_tiny_model_dir

PROMPTS = [[5, 9, 2, 77, 3, 14, 15], [101, 7], [44, 55, 66, 77, 88]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny_beam")))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(
        tiny[0],
        dtype="float32",
        num_gpu_blocks_override=128,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        block_size=8,
        enforce_eager=True,
        max_model_len=64,
    )


def hf_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0, ignore_eos=False):
    """The same search on HF's log-probabilities (an independent forward pass), best first: [(tokens, cum)]."""
    live, ended = [(list(prompt), 0.0)], []

    def score(beam):
        return beam_search_score(beam[0], beam[1], eos, length_penalty)

    for _ in range(max_tokens):
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].double(), -1)
            top = torch.topk(logp, 2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (ended if t == eos and not ignore_eos else grown).append((tokens + [t], cum + lp))
        live = sorted(grown, key=score, reverse=True)[:width]
    return sorted(ended + live, key=score, reverse=True)[:width]


def test_beams_equal_a_search_on_hf_logprobs(llm, tiny):
    model = tiny[1]
    eos = llm.get_tokenizer().eos_token_id
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.7)
    outs = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = hf_beam_search(model, prompt, 3, 6, eos, length_penalty=0.7)
        assert [b.tokens for b in out.sequences] == [r[0] for r in ref]
        for beam, (_, cum) in zip(out.sequences, ref, strict=True):
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert beam.tokens[: len(prompt)] == prompt and len(beam.logprobs) == len(beam.tokens) - len(prompt)
            assert beam.text == llm.get_tokenizer().decode(beam.tokens)  # prompt included, as vLLM's
        scores = [beam_search_score(b.tokens, b.cum_logprob, eos, 0.7) for b in out.sequences]
        assert scores == sorted(scores, reverse=True)
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "KV blocks leaked"


def test_width_one_is_greedy(llm, tiny):
    model = tiny[1]
    model.generation_config.eos_token_id = None
    out = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))[0]
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0]
    assert out.sequences[0].tokens == ref.tolist()


def test_prompt_forms_and_concurrency_limit(llm):
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    text = "the engine"
    ids = tok.encode(text)
    forms = [text, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids), {"prompt_token_ids": ids}]
    outs = llm.beam_search(forms, params, concurrency_limit=3)
    assert all([b.tokens for b in o.sequences] == [b.tokens for b in outs[0].sequences] for o in outs)
    assert outs[0].sequences[0].tokens[: len(ids)] == ids


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: BeamSearchParams(beam_width=0, max_tokens=4), "beam_width"),
        (lambda: BeamSearchParams(beam_width=2, max_tokens=1.5), "max_tokens"),
        (lambda: BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1), "temperature"),
        (lambda: BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    ],
)
def test_bad_params_name_their_field(make, field):
    with pytest.raises(ParameterError, match=field) as e:
        make()
    assert e.value.parameter == field


def test_a_prompt_past_max_model_len_is_refused_as_generate_refuses_it(llm):
    """(It came back as a beam of the prompt alone, finished "length".)"""
    with pytest.raises(ValueError, match="is longer than the maximum model length of 64"):
        llm.beam_search([[5] * 80], BeamSearchParams(beam_width=2, max_tokens=3))


def test_too_wide_for_max_logprobs_is_refused(llm):
    with pytest.raises(ParameterError, match=r"beam_width \(11\) needs 2 \* beam_width log-probabilities"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search([PROMPTS[0]], {"beam_width": 2})


class _Scripted:
    """generate() of a model whose next-token log-probabilities are a function of the sequence."""

    def __init__(self, table):
        self.table, self.calls = table, []

    def __call__(self, prompts, sp, loras):
        self.calls.append(len(prompts))
        outs = []
        for p in prompts:
            step = {t: Logprob(lp) for t, lp in self.table(p["prompt_token_ids"]).items()}
            out = RequestOutput.__new__(RequestOutput)
            out.outputs = [type("C", (), {"logprobs": [step]})()]
            outs.append(out)
        return outs


def test_eos_ends_a_beam_and_length_penalty_ranks_the_ended():
    """EOS (2) is the likeliest token after [1]: that beam ends after one token, the others go on. With no length
    penalty the short ended beam (higher summed log-probability) wins; a length penalty of 3 favours the long ones."""
    table = lambda ids: {2: math.log(0.5), 7: math.log(0.3), 8: math.log(0.2)}  # noqa: E731
    outs = {
        lp: run_beam_search(
            [[1]], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=lp), _Scripted(table),
            eos_token_id=2, max_model_len=64,
        )[0].sequences
        for lp in (0.0, 3.0)
    }  # fmt: skip
    assert outs[0.0][0].tokens == [1, 2] and outs[0.0][0].finish_reason == "stop"
    assert outs[3.0][0].tokens == [1, 7, 7, 7] and outs[3.0][0].finish_reason == "length"
    ignored = run_beam_search(
        [[1]], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True), _Scripted(table),
        eos_token_id=2, max_model_len=64,
    )[0].sequences  # fmt: skip
    # an EOS at the end is not counted in the length (vLLM's score), so the all-EOS beam, likeliest, ranks second
    assert [b.tokens for b in ignored] == [[1, 2, 2, 7], [1, 2, 2, 2]]


def test_beams_stop_at_max_model_len():
    scripted = _Scripted(lambda ids: {5: -0.1, 6: -0.2})
    out = run_beam_search(
        [[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=10), scripted, eos_token_id=0, max_model_len=6
    )[0]
    assert [len(b.tokens) for b in out.sequences] == [6, 6] and scripted.calls == [1, 2, 2]
