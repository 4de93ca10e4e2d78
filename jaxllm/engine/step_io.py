"""A step's host-side data: the program it runs (StepVariant) and that program's arguments (step_args,
draft_args), the inputs ModelRunner.prepare makes (PreparedStep), the dispatched step launch returns
(StepHandle), the results collect reads back (StepResult), and the dummy inputs of a step's shapes that the
start-up compiles trace (dummy_host_inputs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from jaxllm.engine.input_batch import InputBatch
from jaxllm.engine.packing import pack_host_args, sampling_arrays
from jaxllm.engine.sampler import SamplerFlags
from jaxllm.engine.scheduler import SchedulerOutput
from jaxllm.models.attention import AttentionMetadata


@dataclass(frozen=True)
class StepVariant:
    num_tokens: int  # T bucket
    num_seqs: int  # B bucket
    decode_only: bool
    flags: SamplerFlags
    prompt_logprobs: int  # top-k for prompt logprobs, 0 = off
    sampler_widths: tuple = (1, 1, 1, 1, 1, 1)  # padded widths of the ragged sampling rows, then the number of
    # structured-output masks (SamplingMetadata.token_bitmask)
    num_spec: int = 0  # speculative decoding: K proposals verified per sequence (spec_step_fn); 0 = a plain step
    draft: bool = False  # the draft program that follows this shape's steps (spec_decode/drafter.py); flags unused
    # A decode-only step whose longest live context is long (prepare.py, StepPreparer.long_decode_from): the
    # bucket's second program, whose decode attention is the kernel that is faster at long contexts
    # (AttentionMetadata.long_context). Compiled in the background at the bucket's first long step.
    long_context: bool = False

    @property
    def shape_name(self) -> str:
        """B x T, with a trailing d for decode-only steps and L for their long-context program (logs, benchmark
        rows)."""
        return f"{self.num_seqs}x{self.num_tokens}{'d' if self.decode_only else ''}{'L' if self.long_context else ''}"


def step_args(host_args, params, kv_caches, prev_tokens, lora=None, packed: tuple | None = None) -> tuple:
    """A step program's arguments: the device state and the host inputs, packed (pack_host_args, or packed: that
    of host_args, made already); with LoRA, the adapter slot arrays last (jaxllm/lora/slots.py: arguments, never
    constants, so swapping adapters recompiles nothing)."""
    ints, floats, layout = packed or pack_host_args(host_args)
    return (params, kv_caches, ints, floats, prev_tokens, layout) + (() if lora is None else (lora,))


def draft_args(host_args, params, draft, prev_in, prev_out, feats, emitted, extras) -> tuple:
    """A draft program's arguments (drafter.draft_step_fn): draft = (draft params, draft KV), extras = (next_ids
    [B], num_pages [B]) numpy."""
    ints, floats, layout = pack_host_args(host_args)
    return (params, *draft, ints, floats, prev_in, prev_out, feats, emitted, *extras, layout)


def dummy_host_inputs(
    v: StepVariant, *, max_pages: int, batch: InputBatch, vocab_size: int, lora: bool = False
) -> tuple:
    """Host inputs of v's shapes that write no KV slot: (token_ids, src_rows, meta, logits_indices, smd,
    prompt_targets, token_slots), token_slots (and smd.lora_slots) None without LoRA, else no adapter anywhere.
    What the start-up compiles trace (StepPrograms' dummy_host)."""
    T, B = v.num_tokens, v.num_seqs
    z = lambda *shape, dt=np.int32: np.zeros(shape, dt)  # noqa: E731
    meta = AttentionMetadata(
        z(T), np.full(T, -1, np.int32), z(B), z(B + 1), z(B, max_pages), v.decode_only, v.long_context
    )
    smd = sampling_arrays(batch, vocab_size, B, v.flags)
    logits = (z(B * (v.num_spec + 1)), z(B, v.num_spec), z(B)) if v.num_spec else z(B)  # see _spec_rows
    token_slots = None
    if lora:
        smd, token_slots = dataclasses.replace(smd, lora_slots=np.full(B, -1, np.int32)), np.full(T, -1, np.int32)
    return z(T), np.full(T, -1, np.int32), meta, logits, smd, np.full(T, -1, np.int32), token_slots


_F32 = np.dtype(np.float32)


def unpack_outputs(packed: np.ndarray, like: tuple) -> list[np.ndarray]:
    """step_fns.with_packed's int32 [B, W] on the host, split back into arrays of the shapes and dtypes of like
    (the step's device outputs; only their metadata is read)."""
    out, at, B = [], 0, packed.shape[0]
    for a in like:
        tail = a.shape[1:]
        w = math.prod(tail)
        col = packed[:, at : at + w]
        out.append((col.view(np.float32) if a.dtype == _F32 else col).reshape(B, *tail))
        at += w
    return out


@dataclass
class StepHandle:
    """A dispatched step: device results plus what is needed to read them."""

    sched: SchedulerOutput
    rows: dict[str, int]  # seq_id -> row of the sampled outputs (sample=True chunks only)
    outputs: tuple  # device arrays: (sampled outputs, their packed copy last (step_fns.with_packed); prompt
    # logprobs or None; the drafter's proposals or None)
    prompt_rows: dict[str, tuple[int, int, int]]  # seq_id -> (first token index, count, first prompt position)
    num_logprobs: int
    hidden: object = None  # the sampled rows' hidden states [B, D] on the device (None: not kept)


@dataclass
class PreparedStep:
    """One step's host-side inputs (numpy) and its variant, before dispatch."""

    variant: StepVariant
    host_args: tuple  # (token_ids [T], src_rows [T], meta, logits_indices [B], smd, prompt_targets [T],
    # token_slots [T]: each token's LoRA slot, None without LoRA)
    sample_rows: dict[str, int]
    prompt_rows: dict[str, tuple[int, int, int]]
    num_logprobs: int
    masked: list = dataclasses.field(default_factory=list)  # (row of smd.token_bitmask, the sequence whose mask it is)
    sched: SchedulerOutput | None = None
    draft_extras: tuple | None = None  # with a drafter: (next_ids [B], num_pages [B]), see drafter.draft_step_fn
    lora_loads: list = dataclasses.field(default_factory=list)  # (slot, adapter) to write before the step runs
    # host_args packed (pack_host_args: ints, floats, layout) where prepare made them; None: packed at launch
    packed: tuple | None = None


@dataclass
class StepResult:
    tokens: np.ndarray  # [B]
    logprobs: np.ndarray  # [B]
    ranks: np.ndarray  # [B]
    top_ids: np.ndarray  # [B, k]
    top_logprobs: np.ndarray  # [B, k]
    prompt: tuple | None  # (target logprobs [T], ranks [T], top ids [T, k], top logprobs [T, k])
    # Speculative steps: tokens, logprobs and ranks are [B, K + 1] and the top-k [B, K + 1, k], each row's emitted
    # tokens first; num_emitted [B] says how many (None for a plain step)
    num_emitted: np.ndarray | None = None
    draft_tokens: np.ndarray | None = None  # [B, K]: a drafter's proposals for the next step (verify steps)
