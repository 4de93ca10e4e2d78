"""Speculative decoding's host parts: SpeculativeConfig (vLLM's keys, defaults and messages), the n-gram
proposer against vLLM's rule written out by brute force."""

import numpy as np
import pytest

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.configs import SpeculativeConfig
from jaxllm.engine.sequence import Sequence
from jaxllm.spec_decode.ngram import NgramProposer, propose_ngram


def brute_force_ngram(tokens, min_n, max_n, k):
    """vLLM's rule spelled out: the longest n in [min_n, max_n] whose suffix occurs earlier (ending before the
    last token), its earliest occurrence, and the up to k tokens after it."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        for s in range(0, total - n):
            if tokens[s : s + n] == suffix:
                return tokens[s + n : s + n + k]
    return []


def test_ngram_examples_from_vllm():
    # vLLM's docstring: [1,2,3,4,2,3], min 2, max 3, k 4 -> [4, 2, 3]
    assert propose_ngram(np.array([1, 2, 3, 4, 2, 3]), 2, 3, 4).tolist() == [4, 2, 3]
    assert propose_ngram(np.array([1, 2, 3, 4, 2, 3]), 3, 3, 4).tolist() == []
    assert propose_ngram(np.array([5]), 1, 3, 4).tolist() == []
    assert propose_ngram(np.array([7, 7, 7, 7]), 1, 2, 3).tolist() == [7, 7]  # overlapping occurrences


@pytest.mark.parametrize("seed", range(4))
def test_ngram_matches_the_brute_force_rule(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        vocab = int(rng.integers(2, 6))
        tokens = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        got = propose_ngram(np.array(tokens), lo, hi, k).tolist()
        assert got == brute_force_ngram(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_ngram_proposer_extends_its_buffer_as_the_sequence_grows():
    prop = NgramProposer(1, 3, 4)
    seq = Sequence("a", [1, 2, 3, 9, 1, 2])
    assert prop.propose(seq) == [3, 9, 1, 2]
    seq.output_token_ids += [3, 9]
    assert prop.propose(seq) == brute_force_ngram(seq.all_token_ids, 1, 3, 4)
    seq.output_token_ids += list(range(20, 120))  # past the first buffer
    assert prop.tokens(seq).tolist() == seq.all_token_ids
    assert prop.propose(seq, k=2) == []


def test_speculative_config_forms_and_defaults():
    c = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max, c.model) == ("ngram", 5, 5, None)
    c = SpeculativeConfig.from_value('{"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4}')
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = SpeculativeConfig.from_value({"model": "/d", "num_speculative_tokens": 2})
    assert (c.method, c.model) == (None, "/d")  # draft_model or eagle: read from the model's config by setup
    assert SpeculativeConfig.from_value(None) is None


@pytest.mark.parametrize(
    "value, msg",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            r"Expected num_speculative_tokens to be greater than zero \(0\)",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min=0 must be > 0"),
        ({"num_speculative_tokens": 2}, "num_speculative_tokens was provided without speculative model."),
        ({"model": "/d"}, "num_speculative_tokens must be provided with speculative model"),
        ({"method": "medusa", "model": "/d", "num_speculative_tokens": 2}, "method='medusa' is not supported"),
        ({"method": "bogus", "num_speculative_tokens": 2}, "method='bogus' is not supported"),  # not "without model"
        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "x"}, "unsupported keys"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
            "Expect the batch size threshold of disabling speculative decoding is > 1",
        ),
        ("{not json", "speculative_config is not valid JSON"),
    ],
)
def test_speculative_config_errors(value, msg):
    with pytest.raises(ValueError, match=msg):
        SpeculativeConfig.from_value(value)


def test_engine_args_validate_the_speculative_config_early():
    with pytest.raises(ValueError, match="cannot be other value than 1 or target model tensor_parallel_size"):
        EngineArgs(
            speculative_config={"model": "/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 3},
            tensor_parallel_size=2,
        ).validate()
    with pytest.raises(ValueError, match="pipeline parallelism"):
        EngineArgs(
            speculative_config={"method": "ngram", "num_speculative_tokens": 2}, pipeline_parallel_size=2
        ).validate()


def test_serve_flag_is_a_usage_error_when_invalid(capsys):
    from server.args import engine_kwargs, parse_args

    args = parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    assert "Expected num_speculative_tokens to be greater than zero (-1)" in capsys.readouterr().err
