"""The speculation switch-off (jaxllm/spec_decode/policy.py) against the verify step's measured cost: at every
(batch, K) of bench/spec_decode.py's H200 table, a step the GPU model chooses to speculate must not be slower
than a plain one by more than the table's noise, for any tokens-per-step E the workload may emit."""

import json
import os

import pytest

from jaxllm.spec_decode.policy import VERIFY_COSTS, SpecPolicy

TABLE = os.path.join(os.path.dirname(__file__), "..", "bench", "results", "spec_decode_h200_dca975d.json")


def measured():
    with open(TABLE) as f:
        rows = json.load(f)["verify"]["rows"]
    return [(r["batch"], int(k), ms / r["plain_ms"]) for r in rows for k, ms in r["spec_ms"].items()]


@pytest.mark.parametrize("emitted", [1.0, 1.1, 1.3, 1.6, 2.0, 3.0, 4.0, 6.0, 9.0])
def test_gpu_model_never_speculates_where_the_measured_step_is_slower(emitted):
    for batch, k, cost in measured():
        e = min(emitted, k + 1)  # K proposals emit at most K + 1 tokens
        if SpecPolicy(k, VERIFY_COSTS["gpu"]).pays(batch, e):
            assert e / cost > 0.95, (batch, k, e, cost)


def test_gpu_model_speculates_where_it_clearly_pays():
    """Not a model that never speculates: where the measured speed-up is >= 1.3x, it speculates."""
    chosen = [
        SpecPolicy(k, VERIFY_COSTS["gpu"]).pays(batch, min(e, k + 1))
        for batch, k, cost in measured()
        for e in (2.0, 4.0, 9.0)
        if min(e, k + 1) / cost >= 1.3
    ]
    assert chosen and all(chosen)


def test_switch_off_batch_follows_acceptance():
    low, high = SpecPolicy(4).max_batch(1.3), SpecPolicy(4).max_batch(4.0)
    assert 0 < low < 16 < 64 < high
    assert SpecPolicy(4).max_batch(1.0) == 0  # nothing accepted: never
    assert SpecPolicy(4, disable_by_batch_size=8).max_batch(4.0) == 7  # vLLM's fixed threshold replaces the model
