"""The engine's side of speculative decoding (LLMEngine holds one SpecDecoding when it is on): whether a step
speculates (the policy), the proposals (n-gram lookup here on the host; a drafter's come with each verify step's
results), what a verify step teaches the policy, and the counters for EngineStats."""

from __future__ import annotations

from jaxllm.engine.protocol import SpecDecodeStats


class SpecDecoding:
    def __init__(self, speculation):
        """speculation: spec_decode.setup.Speculation (the resolved config, the policy, the drafter if any)."""
        self.config, self.policy, self.drafter = speculation.config, speculation.policy, speculation.drafter
        self.proposer = None
        if self.drafter is None:
            from jaxllm.spec_decode.ngram import NgramProposer

            self.proposer = NgramProposer(
                self.config.prompt_lookup_min, self.config.prompt_lookup_max, self.config.num_speculative_tokens
            )

    @property
    def scheduler_kwargs(self) -> dict:
        """A drafter writes its KV for the next proposals past the verified tokens (K lookahead slots) and
        proposes in verify steps only, so every speculating decode step is one."""
        on = self.drafter is not None
        return dict(num_lookahead_tokens=self.config.num_speculative_tokens if on else 0, verify_every_decode=on)

    def propose(self, running) -> None:
        """Proposals for the running sequences that decode next: n-gram lookup over their tokens, or the drafter's
        from the previous verify step, kept for the sequences that may take them. Not for sequences whose next
        tokens' processing depends on host state the rejection sampler does not see per position: structured
        outputs (the grammar advances per token), bad_words and min_tokens still pending (their biases follow the
        tokens); penalties, logit biases, top-k / top-p / min_p and logprobs are applied per position on the
        device."""
        for seq in running:
            sp = seq.sampling_params
            if (
                seq.num_pending
                or seq.num_computed_tokens != seq.num_known_tokens - 1
                or sp is not None
                and (sp.structured_outputs is not None or sp.bad_words or len(seq.output_token_ids) < sp.min_tokens)
            ):
                seq.spec_token_ids = []
            elif self.proposer is not None:
                seq.spec_token_ids = self.proposer.propose(seq)

    def after_verify(self, handle, result, sampled: dict) -> None:
        """A verify step's results: E for the policy (tokens per sequence step; with a drafter only over the
        sequences that had proposals, the first verify step after a pause having none), and the drafter's next
        proposals (set before the engine processes the tokens; a sequence that finishes drops them)."""
        proposed = {s.seq.seq_id for s in handle.sched.scheduled if s.spec_token_ids}
        seqs = [i for i in sampled if self.drafter is None or i in proposed]
        self.policy.observe(len(seqs), sum(len(sampled[i]) - 1 for i in seqs))

    def take_drafts(self, handle, result) -> None:
        if result.draft_tokens is None:
            return
        for s in handle.sched.scheduled:
            row = handle.rows.get(s.seq.seq_id)
            if row is not None and not s.seq.is_finished:
                s.seq.spec_token_ids = result.draft_tokens[row].tolist()

    def stats(self, sd) -> SpecDecodeStats:
        """EngineStats' copy of the scheduler's counters."""
        return SpecDecodeStats(
            sd.num_drafts,
            sd.num_draft_tokens,
            sd.num_accepted_tokens,
            list(sd.num_accepted_tokens_per_pos) or [0] * self.config.num_speculative_tokens,
        )
