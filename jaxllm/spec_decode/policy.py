"""When a step speculates: a cost model of the verify step against the tokens it is expected to emit.

A decode step's time is t(n) = a + b * n for n tokens: a reads the weights (the same for any batch while the
step is weight-bound), b is each token's share of the compute. Speculating with K proposals per sequence runs
B * (K + 1) tokens instead of B and emits E tokens per sequence instead of 1, so it pays when

    E * t(B) > (1 + overhead) * t(B * (K + 1))   <=>   E * (R + B) > (1 + overhead) * (R + B * (K + 1))

with R = a / b, the number of tokens whose compute equals one weight read, and overhead the verify step's fixed
extra cost (the K + 1 output-head rows, the rejection sampler, the ragged attention path instead of the fused
decode kernel). R is a property of the device more than of the model (weight bytes / bandwidth against 2 *
params / FLOP/s): the Llama-3-8B shape on an H100 ran batch 1 at 5.45 ms and batch 64 at 6.76 ms per step (README,
run 35), b = 0.0208 ms, R ~ 260; bench/spec_decode.py measures the verify step's cost at each (B, K) to check it.
So, for E = 2 at K = 4 speculation pays below B ~ 80, for E = 1.3 below ~20, for E = 1 never.

E is measured: the mean tokens emitted per sequence in the speculative steps so far (an exponential average, so
it follows the workload), starting from a prior of K / 2 accepted tokens. A step that does not speculate
teaches nothing, so after PROBE_EVERY steps without speculation one is speculated to measure E again.
`disable_by_batch_size` (vLLM's name) replaces the model by a fixed threshold: speculate below that many
running sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

# Tokens per weight read (R above): the H100 measurement; on CPU every token costs compute (no weight-read floor
# worth speaking of), which a small R says.
TOKENS_PER_WEIGHT_READ = {"gpu": 260.0, "cpu": 4.0}
VERIFY_OVERHEAD = 0.05
PROBE_EVERY = 64
_EMA = 0.05


@dataclass
class SpecPolicy:
    num_spec: int
    tokens_per_weight_read: float = TOKENS_PER_WEIGHT_READ["gpu"]
    disable_by_batch_size: int | None = None
    overhead: float = VERIFY_OVERHEAD
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
        r = self.tokens_per_weight_read
        return e * (r + batch) > (1 + self.overhead) * (r + batch * (self.num_spec + 1))

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
