"""StepPreparer: the host half of a step, SchedulerOutput -> PreparedStep (padded numpy inputs, the bucket and
the StepVariant that names the program to run), no device work.

Separate from the runner (runner.py), which launches and collects steps on the device: preparing is host
bookkeeping only (the InputBatch rows, the previous step's sampled rows, LoRA slot assignment), timed on its own
by bench/host_overhead.py. The runner owns one and calls prepare() for every step; launch records the rows whose
tokens the next step reads from the device (prev_rows).

Steady decode (the same sequences as the last step, each one token further, every input still on the device) takes a
shorter path (_next_decode): the last step's arrays with the positions, pages and sampling steps moved on, packed
from the last step's buffers (packing.repack). prepare + pack of a batch-1 decode step took 0.116 ms on the 2-core CPU
VM and 0.32-0.40 ms on an H200's host, where a quantized model's step is host-bound (bench/HISTORY.md "Stop 61"); the
short path takes 0.046 ms there (0.174 -> 0.094 at 64 sequences, 0.380 -> 0.250 at 256; bench/host_overhead.py,
bench/HISTORY.md "Stop 70").
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from jaxllm.engine.input_batch import HAS_PARAMS, PROMPT_LOGPROBS, InputBatch
from jaxllm.engine.inputs import bucket, step_inputs
from jaxllm.engine.packing import decode_steps, pack_host_args, repack, row_widths, sampler_flags, sampling_arrays
from jaxllm.engine.programs import StepPrograms
from jaxllm.engine.sampler import SamplerFlags
from jaxllm.engine.scheduler import SchedulerOutput
from jaxllm.engine.step_io import PreparedStep, StepVariant
from jaxllm.models.attention import AttentionMetadata

PAD_PAGE = 0  # block 0 is reserved by the block manager: safe for padding to point at
# Field readers for map() over a step's sequences in prepare(): a C-level loop, several times cheaper than a
# Python one at 256 sequences. ScheduledSeq fields, then Sequence fields.
_seq, _start, _num_tokens, _sample, _token_ids = map(attrgetter, ("seq", "start", "num_tokens", "sample", "token_ids"))
_seq_id, _spec_token_ids, _lora_id = attrgetter("seq_id"), attrgetter("spec_token_ids"), attrgetter("lora_id")


@dataclass
class _Decode:
    """A decode step that the next one may continue (StepPreparer._next_decode): its sequences, in order, and what
    it was prepared from and into."""

    seqs: list
    ids: list
    starts: np.ndarray  # [n] each sequence's position in that step
    live: np.ndarray  # the sampled rows with sampling params (sampling_arrays' live)
    p: PreparedStep


class StepPreparer:
    def __init__(
        self,
        batch: InputBatch,
        programs: StepPrograms,
        *,
        seq_buckets: tuple[int, ...],
        token_buckets: tuple[int, ...],
        block_size: int,
        max_pages: int,
        max_logprobs: int,
        vocab_size: int,
        lora=None,
        drafter: bool = False,
    ):
        """batch: the runner's InputBatch (persistent rows per sequence); programs: its StepPrograms (which
        variants exist: speculative decoding's verify steps); lora: jaxllm.lora.slots.LoRASlots or None;
        drafter: a draft model runs after each step (its host inputs are prepared too)."""
        self.batch, self.programs = batch, programs
        self.seq_buckets, self.token_buckets = seq_buckets, token_buckets
        self.block_size, self.max_pages = block_size, max_pages
        self.max_logprobs, self.vocab_size = max_logprobs, vocab_size
        self.lora, self.drafter = lora, drafter
        # Each sequence's row in the device's prev_tokens after the last launched step (its sampled rows): where
        # a step reads a token that is still on the device.
        self.prev_rows: dict[str, int] = {}
        # Decode-only steps whose longest live context (seq_len after the step) is at least this many tokens run
        # their bucket's long-context program (StepVariant.long_context); 0: never. The runner sets it
        # (runner.long_decode_from: Hopper, the Pallas backend, one process, no pipeline or drafter).
        self.long_decode_from = 0
        self._last_decode: _Decode | None = None  # the last step, where the next may continue it (_next_decode)

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """The host half of a step: padded numpy inputs and the bucket, no device work (timed by
        bench/host_overhead.py)."""
        # The host budget is ~1 ms at 256 sequences (issue 7), so per-sequence work is C-level map()s over
        # the scheduled list plus numpy; Python loops only visit the rare chunks that need more (prompt
        # logprobs, penalties, biases).
        p = self._next_decode(sched)
        if p is not None:
            return p
        self._last_decode = None
        batch = self.batch
        batch.release(sched.freed)
        batch.truncate(sched.trimmed)
        scheduled = sched.scheduled
        n = len(scheduled)
        seqs = list(map(_seq, scheduled))
        rows = batch.rows(seqs)
        q_lens = np.fromiter(map(_num_tokens, scheduled), np.int32, n)
        starts = np.fromiter(map(_start, scheduled), np.int32, n)
        sample = list(map(_sample, scheduled))
        known = list(map(_token_ids, scheduled))  # [] for a decode of a token still on the device
        from_device = np.fromiter(map(len, known), np.int32, n) < q_lens
        n_tok = int(q_lens.sum())
        decode_only = n_tok == n  # every chunk is one token
        spec = self.programs.num_spec and (sched.verify or any(map(_spec_token_ids, scheduled)))  # (scheduler)
        if spec:  # (a drafter's verify step may have no proposals yet: still the verify program)
            decode_only = False
            v_spec = self.programs.spec_variant(bucket(n, self.seq_buckets), SamplerFlags())
            B, T = v_spec.num_seqs, v_spec.num_tokens
        elif decode_only:
            B = T = bucket(n, self.seq_buckets)
        else:
            # Mixed steps: B follows T (B <= n_tok <= T), so there is one mixed variant per token bucket.
            T = bucket(max(n_tok, n), self.token_buckets)
            B = bucket(min(T, self.seq_buckets[-1]), self.seq_buckets)
        # Flat token ids: the known ones, and a 0 placeholder where the device feeds the previous step's token
        # for this sequence (src_rows: its row in prev_tokens).
        token_ids = np.zeros(n_tok, np.int32)
        src_rows = np.full(T, -1, np.int32)
        first_tok = np.cumsum(q_lens) - q_lens
        dev = np.flatnonzero(from_device)
        if len(dev) < n:
            host_tok = ~np.repeat(from_device, q_lens)
            token_ids[host_tok] = np.fromiter(itertools.chain.from_iterable(known), np.int32, n_tok - len(dev))
        ids = list(map(_seq_id, seqs))
        if len(dev):
            dev_ids = ids if len(dev) == n else [ids[i] for i in dev.tolist()]
            src_rows[first_tok[dev]] = list(map(self.prev_rows.__getitem__, dev_ids))
        inp = step_inputs(
            token_ids,
            q_lens,
            starts,
            batch.num_pages[rows],
            batch.tables[rows],
            self.block_size,
            T,
            B,
            self.max_pages,
            PAD_PAGE,
        )
        sample_idx = list(itertools.compress(range(n), sample))
        sample_rows = dict(zip(itertools.compress(ids, sample), sample_idx))
        features = batch.features[rows]
        flags = sampler_flags(seqs, features, self.max_logprobs)
        prompt_rows = {}
        prompt_targets = np.full(T, -1, np.int32)
        for i in np.flatnonzero(features & PROMPT_LOGPROBS).tolist():
            s, lo = scheduled[i], int(first_tok[i])
            if s.start < s.seq.num_prompt_tokens:  # token j's target: the prompt token after it, if any
                prompt_rows[ids[i]] = (lo, s.num_tokens, s.start)
                targets = s.seq.prompt_token_ids[s.start + 1 : s.start + s.num_tokens + 1]
                prompt_targets[lo : lo + len(targets)] = targets
        prompt_k = self.max_logprobs if prompt_rows else 0
        live = np.asarray(sample_idx, np.int64)
        if not features.all():  # some sequences have no sampling params: they take padding rows
            live = live[(features[live] & HAS_PARAMS) != 0]
        smd = sampling_arrays(batch, self.vocab_size, B, flags, seqs, rows, live)
        long = decode_only and 0 < self.long_decode_from <= int(inp.seq_lens.max())
        meta = AttentionMetadata(
            inp.positions, inp.slot_mapping, inp.seq_lens, inp.query_start_loc, inp.block_tables, decode_only, long
        )
        num_spec = self.programs.num_spec if spec else 0
        v = StepVariant(T, B, decode_only, flags, prompt_k, row_widths(smd), num_spec, long_context=long)
        logits_slot = self._spec_rows(scheduled, inp.query_start_loc, B) if spec else inp.logits_indices
        token_slots, loads = None, []
        if self.lora is not None:  # each token's adapter slot (-1: the base model, padding); the sampled rows' too
            slot_of, loads = self.lora.assign(map(_lora_id, seqs))
            seq_slots = np.fromiter((slot_of.get(i, -1) for i in map(_lora_id, seqs)), np.int32, n)
            token_slots = np.full(T, -1, np.int32)
            token_slots[:n_tok] = np.repeat(seq_slots, q_lens)
            smd = dataclasses.replace(smd, lora_slots=token_slots[inp.logits_indices])
        host_args = (inp.token_ids, src_rows, meta, logits_slot, smd, prompt_targets, token_slots)
        slot = smd.bitmask_slot
        masked = [(int(slot[i]), seqs[i]) for i in np.flatnonzero(slot >= 0).tolist()] if flags.grammar else []
        extras = self._draft_extras(scheduled, rows, B) if self.drafter else None
        p = PreparedStep(v, host_args, sample_rows, prompt_rows, flags.num_logprobs, masked, sched, extras, loads)
        if decode_only and len(dev) == n and len(sample_rows) == n and self._continuable(flags):
            p.packed = pack_host_args(host_args)  # (the next step repacks from it)
            self._last_decode = _Decode(seqs, ids, starts, live, p)
        return p

    def _continuable(self, flags: SamplerFlags) -> bool:
        """Whether _next_decode may continue a decode step with these flags: none of its inputs changes from step to
        step other than by position (penalties' token lists, logit biases and grammar masks do), and no adapter
        slots, drafter or verify steps."""
        return (
            not (flags.penalties or flags.bias or flags.grammar or self.lora is not None or self.drafter)
            and not self.programs.num_spec
        )

    def _next_decode(self, sched: SchedulerOutput) -> PreparedStep | None:
        """The step after a steady decode step, or None where it is not one: the same sequences in the same order,
        one token each, every input the token the last step sampled (on the device), nothing freed or trimmed and
        the same sampler flags. Its arrays are the last step's with each sequence's position, context length,
        new pages, cache slot, source row and sampling step moved on: what prepare() would make, with fewer numpy
        calls (tests/test_prepare.py compares the two)."""
        last = self._last_decode
        if last is None or sched.freed or sched.trimmed or sched.verify:
            return None
        scheduled, seqs = sched.scheduled, last.seqs
        n = len(scheduled)
        if n != len(seqs) or not all(map(operator.is_, map(_seq, scheduled), seqs)):
            return None
        starts = np.fromiter(map(_start, scheduled), np.int32, n)
        if (
            not np.array_equal(starts, last.starts + 1)
            or any(map(_token_ids, scheduled))
            or not all(map(_sample, scheduled))
            or any(q != 1 for q in map(_num_tokens, scheduled))
        ):
            return None
        batch, S = self.batch, self.block_size
        rows = batch.rows(seqs)
        if (batch.num_pages[rows] * S <= starts).any():
            return None  # (a page missing: prepare() reports it)
        p = last.p
        token_ids, _, meta, logits_indices, smd, prompt_targets, _ = p.host_args
        flags = sampler_flags(seqs, batch.features[rows], self.max_logprobs)
        if flags != p.variant.flags:
            return None
        positions, seq_lens, slot_mapping = meta.positions.copy(), meta.seq_lens.copy(), meta.slot_mapping.copy()
        positions[:n] = starts
        seq_lens[:n] = starts + 1
        block_tables = meta.block_tables.copy()
        block_tables[:n] = batch.tables[rows, : block_tables.shape[1]]
        slot_mapping[:n] = block_tables[np.arange(n), starts // S] * S + starts % S
        src_rows = np.full(len(positions), -1, np.int32)
        src_rows[:n] = list(map(self.prev_rows.__getitem__, last.ids))
        steps = smd.steps.copy()
        live = last.live
        if len(live):
            live_seqs = seqs if len(live) == n else [seqs[i] for i in live.tolist()]
            steps[live] = decode_steps(live_seqs)
        long = 0 < self.long_decode_from <= int(seq_lens.max())
        meta = AttentionMetadata(positions, slot_mapping, seq_lens, meta.query_start_loc, block_tables, True, long)
        v = p.variant if long == p.variant.long_context else dataclasses.replace(p.variant, long_context=long)
        smd = dataclasses.replace(smd, steps=steps)
        host_args = (token_ids, src_rows, meta, logits_indices, smd, prompt_targets, None)
        packed = repack(host_args, p.host_args, p.packed)
        p = PreparedStep(v, host_args, dict(p.sample_rows), {}, p.num_logprobs, [], sched, None, [], packed)
        self._last_decode = _Decode(seqs, last.ids, starts, live, p)
        return p

    def _draft_extras(self, scheduled, rows: np.ndarray, B: int) -> tuple:
        """The draft program's host inputs: (next_ids [B]: the known token after a chunk that samples none, a
        partial prefill's, else -1; num_pages [B]: each sequence's pages, 0 for padding)."""
        n = len(scheduled)
        next_ids = np.full(B, -1, np.int32)
        for i in itertools.compress(range(n), [not s.sample for s in scheduled]):
            s = scheduled[i]
            if s.start + s.num_tokens < s.seq.num_known_tokens:
                next_ids[i] = s.seq.token_at(s.start + s.num_tokens)
        num_pages = np.zeros(B, np.int32)
        num_pages[:n] = self.batch.num_pages[rows]
        return next_ids, num_pages

    def _spec_rows(self, scheduled, query_start_loc: np.ndarray, B: int):
        """A verify step's (logits_indices [B * (K + 1)]: each sequence's last-token row and its proposals'
        rows, repeated past them; drafts [B, K]; num_drafts [B])."""
        K, n = self.programs.num_spec, len(scheduled)
        num_drafts = np.zeros(B, np.int32)
        num_drafts[:n] = np.fromiter(map(len, map(_spec_token_ids, scheduled)), np.int32, n)
        drafts = np.zeros((B, K), np.int32)
        for i in np.flatnonzero(num_drafts).tolist():
            drafts[i, : num_drafts[i]] = scheduled[i].spec_token_ids
        first = query_start_loc[:B] - np.where(np.arange(B) < n, 0, query_start_loc[:B])  # padding rows: 0
        rows = first[:, None] + np.minimum(np.arange(K + 1)[None, :], num_drafts[:, None])
        return rows.reshape(-1).astype(np.int32), drafts, num_drafts
