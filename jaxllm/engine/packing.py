"""A step's host inputs on their way to the device: the sampling arrays, then two transfer buffers.

The runner (runner.py: prepare) builds a step's host inputs as padded numpy arrays: the token ids and attention
metadata (inputs.py) and the sampling arrays made here (sampling_arrays: a SamplingMetadata of numpy rows, and
sampler_flags: the static switches they need). pack_host_args then lays all of them out in one int32 and one
float32 array, so a step costs two host-to-device transfers; unpack_host_args undoes it inside the compiled
step (programs.py), with static slices described by PackedLayout. No compiling happens here.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from operator import attrgetter

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.input_batch import (
    ALLOWED_IDS,
    FILTERING,
    HAS_PARAMS,
    LOGPROBS,
    PADDING_ROW,
    PENALTIES,
    STRUCTURED,
    InputBatch,
)
from jaxllm.engine.sampler import SamplerFlags, SamplingMetadata, pad_rows

_bias_row, _output_token_ids, _num_pending, _token_bitmask = map(
    attrgetter, ("bias_row", "output_token_ids", "num_pending", "token_bitmask")
)

# SamplingMetadata's ragged per-row fields, padded with (fill, dtype); a StepVariant's sampler_widths are their
# widths in this order, all 1 (one column of fill) unless the step's flags need them.
ROW_FIELDS = (
    ("penalty_tokens", -1, np.int32),
    ("penalty_is_output", False, bool),
    ("bias_ids", -1, np.int32),
    ("bias_values", 0.0, np.float32),
    ("allowed_ids", -1, np.int32),
)


def sampler_flags(seqs, features: np.ndarray, max_logprobs: int) -> SamplerFlags:
    """features: InputBatch.features of seqs' rows (what their sampling params need, fixed per request);
    only the engine's per-token logit biases (seq.bias_row) and grammar masks (seq.token_bitmask) change
    from step to step."""
    bits = int(np.bitwise_or.reduce(features)) if len(features) else 0
    has_params = (features & HAS_PARAMS).tolist()
    bias = bool(bits & ALLOWED_IDS) or any(map(_bias_row, itertools.compress(seqs, has_params)))
    grammar = bool(bits & STRUCTURED) and any(
        m is not None for m in map(_token_bitmask, itertools.compress(seqs, has_params))
    )
    return SamplerFlags(
        bool(bits & FILTERING), bool(bits & PENALTIES), bias, max_logprobs if bits & LOGPROBS else 0, grammar
    )


def decode_steps(seqs) -> np.ndarray:
    """Each sequence's sampling step ([n] int32): the index of the token this step samples among its outputs, which
    with the row's seed keys its random draw."""
    n = len(seqs)
    n_out = np.fromiter(map(len, map(_output_token_ids, seqs)), np.int32, n)
    return n_out + np.fromiter(map(_num_pending, seqs), np.int32, n) - 1


def sampling_arrays(
    batch: InputBatch,
    vocab_size: int,
    B: int,
    flags: SamplerFlags,
    seqs=(),
    rows: np.ndarray | None = None,
    live: np.ndarray | None = None,
) -> SamplingMetadata:
    """B rows: seqs[i] for i in live (an index array: sampled, with sampling params) take the settings of
    their InputBatch row rows[i]; every other row is padding."""
    table = np.tile(np.asarray(PADDING_ROW, np.float32), (B, 1))
    seeds = np.zeros(B, np.uint32)
    steps = np.zeros(B, np.int32)
    n_live = 0 if live is None else len(live)
    if n_live:
        # Usually every sequence is sampled: a slice then spares the fancy indexing.
        at = slice(0, n_live) if n_live == len(seqs) else live
        live_rows = rows[at]
        table[at] = batch.sampling[live_rows]
        seeds[at] = batch.seeds[live_rows]
        live_seqs = seqs if n_live == len(seqs) else [seqs[i] for i in live.tolist()]
        steps[at] = decode_steps(live_seqs)
    temp, top_p, top_k, min_p, pres, freq, rep = table.T
    top_k = top_k.astype(np.int32)
    empty = [[]] * B
    pen_rows, pen_out, bias_ids, bias_vals, allowed = empty, empty, empty, empty, empty
    live = [] if live is None else live.tolist()
    if flags.penalties:
        pen_rows, pen_out = [[] for _ in range(B)], [[] for _ in range(B)]
        for i in live:
            seq = seqs[i]
            pen_rows[i] = seq.all_token_ids
            pen_out[i] = [False] * seq.num_prompt_tokens + [True] * seq.num_output_tokens
    if flags.bias:  # otherwise every bias row and allowed list is empty (see sampler_flags)
        bias_ids, bias_vals, allowed = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
        for i in live:
            row = seqs[i].bias_row or {}
            bias_ids[i], bias_vals[i] = list(row.keys()), list(row.values())
            allowed[i] = list(seqs[i].sampling_params.allowed_token_ids or [])

    slot = np.full(B, -1, np.int32)
    bitmask = np.full((1, 1), -1, np.int32)
    if flags.grammar:  # only the constrained rows' masks go to the device (each is V / 8 bytes)
        rows_c = [i for i in live if seqs[i].token_bitmask is not None]
        bitmask = np.full((1 << max(len(rows_c) - 1, 0).bit_length(), (vocab_size + 31) // 32), -1, np.int32)
        if rows_c:
            np.stack([seqs[i].token_bitmask for i in rows_c], out=bitmask[: len(rows_c)])
        slot[rows_c] = np.arange(len(rows_c))
    ragged = (pen_rows, pen_out, bias_ids, bias_vals, allowed)  # in ROW_FIELDS' order
    return SamplingMetadata(
        temp,
        top_p,
        top_k,
        min_p,
        pres,
        freq,
        rep,
        seeds,
        steps,
        *(
            np.full((B, 1), fill, dtype) if r is empty else pad_rows(r, 1, fill, dtype)
            for r, (_, fill, dtype) in zip(ragged, ROW_FIELDS)
        ),
        bitmask,
        slot,
    )


def row_widths(smd: SamplingMetadata) -> tuple:
    """smd's ragged rows' widths (ROW_FIELDS' order), then its number of structured-output masks: a
    StepVariant's sampler_widths."""
    return tuple(getattr(smd, name).shape[1] for name, _, _ in ROW_FIELDS) + (smd.token_bitmask.shape[0],)


def plain(smd: SamplingMetadata) -> SamplingMetadata:
    """smd with the default flags' one-column ragged rows (the start-up programs' shapes); the start-up
    program's own sampling is discarded when the flags are not the default."""
    B = smd.temperature.shape[0]
    return dataclasses.replace(
        smd,
        **{name: np.full((B, 1), fill, dtype) for name, fill, dtype in ROW_FIELDS},
        token_bitmask=np.full((1, 1), -1, np.int32),
        bitmask_slot=np.full(B, -1, np.int32),
    )


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["treedef", "leaves"])
@dataclass(frozen=True)
class PackedLayout:
    """Where each host input of a step sits in its two transfer buffers (a pytree with no leaves: static).
    leaves: per leaf of treedef, (dtype name, shape, "i" (int32 buffer) or "f" (float32 buffer), offset)."""

    treedef: object
    leaves: tuple


def pack_host_args(host_args) -> tuple[np.ndarray, np.ndarray, PackedLayout]:
    """A step's ~23 host arrays (token ids, attention metadata, the sampling arrays) as one int32 and one
    float32 array: two host-to-device transfers per step instead of one per array, and fewer graph nodes for
    XLA to repoint at new input buffers. int32 leaves go in as they are, uint32 as their bits, bool as 0 / 1."""
    leaves, treedef = jax.tree.flatten(host_args)
    ints, floats, spec, ni, nf = [], [], [], 0, 0
    for x in leaves:
        x = np.asarray(x)
        dt = x.dtype
        if dt == _F32:
            spec.append(("float32", x.shape, "f", nf))
            nf += _append_aligned(floats, x.ravel())
            continue
        name = _INT_NAMES.get(dt)
        if name is None:
            raise TypeError(f"step input of dtype {dt} cannot be packed (int32, uint32, bool, float32)")
        flat = x.ravel().view(np.int32) if dt == _U32 else x.ravel().astype(np.int32, copy=False)
        spec.append((name, x.shape, "i", ni))
        ni += _append_aligned(ints, flat)
    cat = lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt)  # noqa: E731
    return cat(ints, np.int32), cat(floats, np.float32), PackedLayout(treedef, tuple(spec))


def repack(host_args, last_args, last_packed: tuple) -> tuple[np.ndarray, np.ndarray, PackedLayout]:
    """pack_host_args(host_args) made from last_packed, the packing of last_args, a step's host inputs of the same
    structure and shapes: copies of its two buffers with the leaves that are not last_args' own objects written
    over theirs. The leaves a step shares with the one before (prepare.py's steady decode) must not have changed
    since; a structure, shape or dtype that differs packs anew."""
    leaves, treedef = jax.tree.flatten(host_args)
    old = jax.tree.leaves(last_args)
    ints, floats, layout = last_packed
    if treedef != layout.treedef or len(old) != len(leaves):
        return pack_host_args(host_args)
    ints, floats = ints.copy(), floats.copy()
    for x, y, (name, shape, buf, off) in zip(leaves, old, layout.leaves):
        if x is y:
            continue
        if x.shape != shape or _NAMES.get(x.dtype) != name:
            return pack_host_args(host_args)
        flat = x.ravel()
        if buf == "f":
            floats[off : off + flat.size] = flat
        else:
            ints[off : off + flat.size] = flat.view(np.int32) if name == "uint32" else flat
    return ints, floats, layout


# Each packed array starts at a multiple of 256 bytes: a static slice of a step argument can reach a kernel
# as that argument's buffer at the slice's offset, and Mosaic GPU kernels refuse inputs that are not 256-byte
# aligned ("Input buffer 1 is not 256-byte aligned": the decode kernel's block table, at the engine's batch
# shapes; bench/probes/mosaic_align_probe.py).
_PACK_ALIGN = 256 // 4
_PADS = {np.dtype(dt): np.zeros(_PACK_ALIGN, dt) for dt in (np.int32, np.float32)}
# dtypes as objects, and the int buffer's leaf dtypes by name: numpy's dtype.name and dtype == type comparisons
# cost ~1-3 us each, ~25 leaves a step (a batch-1 decode step's pack: 70 -> 25 us on the 2-core CPU VM)
_F32, _U32 = np.dtype(np.float32), np.dtype(np.uint32)
_INT_NAMES = {np.dtype(np.int32): "int32", _U32: "uint32", np.dtype(np.bool_): "bool"}
_NAMES = {**_INT_NAMES, _F32: "float32"}


def _append_aligned(parts: list, flat: np.ndarray) -> int:
    """Appends flat (int32 or float32) and the zeros that round it up to a whole number of _PACK_ALIGN
    elements; returns how many elements that added."""
    pad = -flat.size % _PACK_ALIGN
    parts.append(flat)
    if pad:
        parts.append(_PADS[flat.dtype][:pad])
    return flat.size + pad


def unpack_host_args(ints, floats, layout: PackedLayout):
    """pack_host_args inverted inside the jitted step (static slices of the two buffers)."""
    out = []
    for dtype, shape, buf, off in layout.leaves:
        n = int(np.prod(shape, dtype=np.int64))
        x = jax.lax.slice(ints if buf == "i" else floats, (off,), (off + n,)).reshape(shape)
        if dtype == "uint32":
            x = jax.lax.bitcast_convert_type(x, jnp.uint32)
        elif dtype == "bool":
            x = x != 0
        out.append(x)
    return jax.tree.unflatten(layout.treedef, out)
