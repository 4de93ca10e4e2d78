"""RequestOutput / CompletionOutput carry vLLM's fields with vLLM's defaults, reprs and merging (vLLM 0.10-0.11's
vllm/outputs.py)."""

from __future__ import annotations

import logging

from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput


def _completion(index=0, text="Paris", token_ids=(5, 6), finish_reason=None):
    return CompletionOutput(
        index, text, list(token_ids), -1.5, [{5: Logprob(-0.5, 1, "Par")}, {6: Logprob(-1.0)}], finish_reason
    )


def test_defaults_of_fields_jaxllm_has_no_feature_for():
    out = RequestOutput("r1", "The capital", [1, 2], None, [_completion()], False)
    assert out.metrics is None and out.lora_request is None and out.num_cached_tokens is None
    assert out.encoder_prompt is None and out.encoder_prompt_token_ids is None
    assert out.multi_modal_placeholders == {} and out.kv_transfer_params is None
    c = out.outputs[0]
    assert c.lora_request is None and c.finish_reason is None and c.stop_reason is None and not c.finished()
    # vLLM's positional order: metrics, lora_request, encoder_prompt, encoder_prompt_token_ids, num_cached_tokens
    out = RequestOutput("r1", None, [1], None, [], True, None, None, "enc", [9], 4)
    assert (out.encoder_prompt, out.encoder_prompt_token_ids, out.num_cached_tokens) == ("enc", [9], 4)


def test_reprs_in_vllms_order():
    out = RequestOutput(
        "r1", "The capital", [1, 2], None, [_completion(finish_reason="length")], True, num_cached_tokens=0
    )
    completion = (
        "CompletionOutput(index=0, text='Paris', token_ids=[5, 6], cumulative_logprob=-1.5, "
        "logprobs=[{5: Logprob(logprob=-0.5, rank=1, decoded_token='Par')}, "
        "{6: Logprob(logprob=-1.0, rank=None, decoded_token=None)}], finish_reason=length, "
        "stop_reason=None)"
    )
    assert repr(out.outputs[0]) == completion
    assert repr(out) == (
        "RequestOutput(request_id=r1, prompt='The capital', prompt_token_ids=[1, 2], encoder_prompt=None, "
        f"encoder_prompt_token_ids=None, prompt_logprobs=None, outputs=[{completion}], finished=True, "
        "metrics=None, lora_request=None, num_cached_tokens=0, multi_modal_placeholders={})"
    )


def test_extra_arguments_are_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        out = RequestOutput("r1", None, [1], None, [], True, some_future_field=3)
    assert out.finished and not hasattr(out, "some_future_field")
    assert "Ignoring extra arguments" in caplog.text and "some_future_field" in caplog.text


def test_add_aggregates_deltas_or_replaces():
    first = RequestOutput("r", None, [1], None, [_completion(text="Pa", token_ids=[5])], False)
    first.add(
        RequestOutput(
            "r",
            None,
            [1],
            None,
            [
                _completion(text="ris", token_ids=[6], finish_reason="stop"),
                _completion(index=1, text="x", token_ids=[7]),
            ],
            True,
        ),
        aggregate=True,
    )
    assert first.finished and [c.text for c in first.outputs] == ["Paris", "x"]
    assert first.outputs[0].token_ids == [5, 6] and first.outputs[0].finish_reason == "stop"
    assert len(first.outputs[0].logprobs) == 4
    first.add(RequestOutput("r", None, [1], None, [_completion(text="Lyon", token_ids=[8])], True), aggregate=False)
    assert first.outputs[0].text == "Lyon" and first.outputs[0].token_ids == [8]
