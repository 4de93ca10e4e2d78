"""When a step speculates: a cost model of the verify step against the tokens it is expected to emit.

A decode step's time is t(n) = a + b * n for n tokens: a reads the weights (the same for any batch while the
step is weight-bound), b is each token's share of the compute. Speculating with K proposals per sequence runs
B * (K + 1) tokens instead of B, plus a cost per sequence of its own, and emits E tokens per sequence instead of
1, so it pays when

    E * (R + B) > (1 + overhead) * (R + B * (K + 1) + C * B)

with R = a / b, the number of tokens whose compute equals one weight read, C the verify step's extra cost per
sequence in tokens (the ragged attention path over K + 1 queries per sequence instead of the fused decode
kernel, K + 1 output-head rows, the rejection sampler) and overhead its fixed extra cost. The constants are fitted
to bench/spec_decode.py's verify table on an H200 (8B shape, 512-token context, k 1..8, B 1..64:
bench/results/spec_decode_h200_dca975d.json) so that the model's cost is never more than 5% under a measured one
(R 310, C 3, overhead 0.2; it is up to 22% over, at B = 1, where speculation pays anyway). The measured verify
step costs 1.06x a plain step at B 1, 1.47x at B 16 (K 1) and 1.99x / 3.23x at B 64 (K 1 / 8): a workload
emitting E = 1.3 tokens per step therefore stops speculating at B ~ 6, one with E = 4 at K 4 at B ~ 150
(tests/test_spec_policy.py checks the model against every measured point).

E is measured: the mean tokens emitted per sequence in the speculative steps so far (an exponential average, so
it follows the workload), starting from a prior of K / 2 accepted tokens. A step that does not speculate
teaches nothing, so after PROBE_EVERY steps without speculation one is speculated to measure E again.
`disable_by_batch_size` (vLLM's name) replaces the model by a fixed threshold: speculate below that many
running sequences.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyCost:
    """The cost model's constants (module docstring): R, C and the fixed overhead."""

    tokens_per_weight_read: float
    tokens_per_seq: float
    overhead: float


# GPU: fitted on the H200 (module docstring). CPU: every token costs compute (no weight-read floor worth speaking
# of), which a small R says; the tests' tiny models speculate at small batches there.
VERIFY_COSTS = {"gpu": VerifyCost(310.0, 3.0, 0.2), "cpu": VerifyCost(4.0, 0.0, 0.05)}
PROBE_EVERY = 64
_EMA = 0.05


@dataclass
class SpecPolicy:
    num_spec: int
    cost: VerifyCost = VERIFY_COSTS["gpu"]
    disable_by_batch_size: int | None = None
    max_seqs: int = 1 << 16  # the largest batch whose speculative step is compiled (the runner's spec_max_seqs)

    def __post_init__(self) -> None:
        self.expected_emitted = 1.0 + self.num_spec / 2
        self._idle_steps = 0

    def pays(self, batch: int, expected_emitted: float | None = None) -> bool:
        """Whether a speculative step of `batch` sequences is expected to beat a plain one."""
        if batch > self.max_seqs:
            return False
        if self.disable_by_batch_size is not None:
            return batch < self.disable_by_batch_size
        e = self.expected_emitted if expected_emitted is None else expected_emitted
        c = self.cost
        r = c.tokens_per_weight_read
        return e * (r + batch) > (1 + c.overhead) * (r + batch * (self.num_spec + 1 + c.tokens_per_seq))

    def max_batch(self, expected_emitted: float | None = None) -> int:
        """The largest batch that speculates at this E (0: none)."""
        b = 0
        while self.pays(b + 1, expected_emitted) and b < 1 << 16:
            b += 1
        return b

    def speculate(self, batch: int) -> bool:
        """The engine's per-step switch."""
        if batch == 0:
            return False
        if self.pays(batch):
            self._idle_steps = 0
            return True
        self._idle_steps += 1
        if (
            self.disable_by_batch_size is None
            and self._idle_steps >= PROBE_EVERY
            and self.pays(batch, 1 + self.num_spec)
        ):
            self._idle_steps = 0
            return True
        return False

    def observe(self, num_seqs: int, num_accepted: int) -> None:
        """A speculative step emitted num_seqs + num_accepted tokens for num_seqs sequences."""
        if num_seqs:
            e = 1.0 + num_accepted / num_seqs
            self.expected_emitted += _EMA * (e - self.expected_emitted)
