"""The batched LoRA matmul: every token adds its own adapter's (x @ A) @ B to a projection, adapters held in S device
slots. A pure function of arrays, so the mix of adapters in a batch is data, never a new program.

    select(slots [T], S, dtype) -> w [T, S]                one-hot of each token's slot (-1, the base model: zeros)
    delta(kind, x, A, B, w) -> [T, *out] (the slots' dtype; lm_head: float32; gate_up: [2, T, F])
                                                           every slot's shrink, masked to the token's own, expanded

Slot arrays (jaxllm/lora/peft.py's per-adapter layouts with a slot axis S, ranks zero-padded to R = max_lora_rank;
P: the parts q, k, v of qkv / gate, up of gate_up):

    qkv      A [D, S, 3, R]      B [S, 3, R, K, G + 2, H]   (block-diagonal: part p's rows feed only its columns)
                                 or [G + 2, S, R, K, H]     (per column of a kv head; when the zeros would be large)
    o        A [N, H, S, R]      B [S, R, D]
    gate_up  A [D, S, 2, R]      B [2, S, R, F]
    down     A [F, S, R]         B [S, R, D]
    embed    A [V, S, R]         B [S, R, D]                (A's rows are looked up by token id)
    lm_head  A [D, S, R]         B [S, R, V]

Why these layouts: every GEMM reads its weights in place. A GEMM (cuBLAS, XLA:CPU's) needs each operand as
[batch, rows, cols] with the batch axes leading and the contracted and the kept axes each contiguous; an axis order
that is not is copied (transposed) by XLA before the GEMM, every step: with the slot axis leading, that copy of
every slot array (read + write + the GEMM's read: ~3x the bytes) was most of LoRA's decode cost. So A contracts on
its leading axes and keeps (S, [P,] R) together; B contracts on its leading axes and keeps the output.
tests/test_lora.py checks the compiled delta() holds no copy of a slot array. The dot_generals below list the
contracted axes in memory order: jnp.einsum contracted the old B [S, R, D] over (R, S), which XLA copied too.

One shrink and one expand GEMM per projection group, as vLLM's packed modules: q, k and v share x, so their shrink
is one GEMM x @ A [D, S * 3R]; their expand is one GEMM over (S, 3, R) into the fused qkv output's own layout
[T, K, G + 2, H] (each kv head's G q heads, then k, v), B holding zeros where a part's rank does not feed a column
(3x the parts' bytes: 4.7 MB a layer instead of 1.6 at the 8B shape, S 8, rank 16). Its output needs no transpose, so
XLA adds it to the base projection in the GEMM's epilogue (cuBLAS's beta = 1). Where those zeros would pass
QKV_BLOCK_DIAGONAL_MAX_ZEROS (more slots or a larger rank: reading them costs more than the kernel they save, and
they take device memory) B is stored per column of a kv head instead, the expand a GEMM batched over the G + 2
columns (q's shrink read G times) whose [G + 2, T, K, H] output is transposed where it is added. gate_up's parts
are as wide as the MLP (a block-diagonal B would read twice its bytes, 7 MB a layer more): its expand is a GEMM
batched over the two parts, whose output [2, T, F] the decoder adds where the activation reads gate and up (one
elementwise fusion, no transpose).

Everything runs in the slots' dtype (the model's by default): the GEMMs accumulate in float32 inside cuBLAS and
round once, as PEFT's bf16 modules do (lora_B(lora_A(x)) rounded, then added to the rounded base output). A
float32 result (preferred_element_type) made XLA's GPU backend convert operands and outputs around every LoRA GEMM
(H100 trace, bench/results/lora_profile_h100_22a07c6.json: ~10 us of converts a layer) and kept the base GEMMs from
fusing the residual add into their epilogue. The per-token mask is one multiply of the shrink's output [T, S, P, R].

Why every slot: the shrink x @ A for all S slots is one GEMM that reads each slot's A once, and masking its output
to the token's own slot before the expand makes the expand one GEMM over (S, R) as well. In a decode step
(memory-bound) that reads every slot's A and B once per step, as BGMV kernels do; gathering A / B per token (the
reference below) would copy them T times. The cost grows with max_loras, not with the adapters a step uses: prefill
FLOPs are T * D * S * 3R for the qkv shrink (at S * 3R = 384, 6% of an 8B qkv GEMM).
The reference gathers per token: obviously right, and the tests compare the two.

Fused into the base weights (on one device with unquantized base weights, slots.py's absorb): qkv's and gate_up's
A are stored as columns beside the base weight, W [D, base | S * P * R], so one GEMM gives the base projection and
the shrink (masked after it); o's and down's B are stored as rows under it, W [base | S * R, D], so one GEMM over
[input | masked shrink] gives the base projection plus the expand, with the residual added in its epilogue. That
removes four GEMM launches a layer: H100, 8B shape, 8 adapters, batch 64: 16 kernels a layer instead of 20,
batch-64 ITL 7.33 ms against 7.87 (base 6.44; bench/results/lora_h100_8b82c90.json, lora_h100_e3a7cfd.json).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

F32 = jnp.float32


def select(slots, num_slots: int, dtype=F32):
    """[T] int32 slot per token (-1: no adapter) -> [T, S] one-hot weights."""
    return (slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)[None, :]).astype(dtype)


def num_slots(ab) -> int:
    """S of an embed / lm_head / o / down slot pair (A, B): B is [S, R, out]."""
    return ab[1].shape[0]


def qkv_parts(G: int) -> list[int]:
    """Which part (q 0, k 1, v 2) each of the G + 2 columns of a kv head belongs to."""
    return [0] * G + [1, 2]


# The bytes of zeros a layer's block-diagonal qkv B may hold (2 of its 3 parts' worth): ~1 us of an H100's memory
# time, about what the transposed add it saves costs. The 8B shape at max_loras 8, rank 16 holds 3.1 MB.
QKV_BLOCK_DIAGONAL_MAX_ZEROS = 4 * 2**20
# Shrinks of up to this many tokens run as up to SHRINK_SPLITS float32 partials over the input (see _shrink).
# H100, 8 adapters, batch 64: 16 slices 7.75-7.79 ms ITL vs 8 slices 7.88 (one call, lora_h100_7efd0bb*.json).
SHRINK_SPLITS = 16
SHRINK_SPLIT_MAX_TOKENS = 512
SHRINK_SPLIT_MIN_INPUTS = 128  # input features per slice, at least


def qkv_block_diagonal(S: int, R: int, K: int, G: int, H: int, itemsize: int) -> bool:
    """Static: whether qkv's slot B is block-diagonal [S, 3, R, K, G + 2, H] (else [G + 2, S, R, K, H])."""
    return 2 * S * R * K * (G + 2) * H * itemsize <= QKV_BLOCK_DIAGONAL_MAX_ZEROS


def _dot(x, w, contract: int, batch: int = 0, out=None):
    """x [*batch, T.., *c] . w [*batch, *c, out..] over the last `contract` axes of x and the `contract` axes after
    w's batch axes, in memory order on both (result in out, by default the operands' dtype)."""
    cx = tuple(range(x.ndim - contract, x.ndim))
    cw = tuple(range(batch, batch + contract))
    b = tuple(range(batch))
    return jax.lax.dot_general(x, w, ((cx, cw), (b, b)), preferred_element_type=out)


def shrink_splits(k: int) -> int:
    """Slices of a decode-sized shrink over k inputs: the most, up to SHRINK_SPLITS (a power of two), that divide
    k into slices of >= SHRINK_SPLIT_MIN_INPUTS (1: no split)."""
    s = SHRINK_SPLITS
    while s > 1 and (k % s or k // s < SHRINK_SPLIT_MIN_INPUTS):
        s //= 2
    return s


def _shrink(x, A, contract: int, w):
    """x [T, in..] . A [in.., S, (P,) R] over the `contract` input axes, masked to each token's slot (w [T, S], A's
    dtype) -> [T, S, (P,) R] in A's dtype. Decode-sized batches (T <= SHRINK_SPLIT_MAX_TOKENS) split the input into
    shrink_splits(k) slices as one batched GEMM of float32 partials, summed where the mask is applied (one fusion):
    cuBLAS split such a tall, narrow GEMM itself and ran a splitKreduce kernel and the mask's multiply after it
    (H100, batch 64: 4.8-5.7 us + 2.1 us + 1.5-1.9 us a shrink, lora_h100_44de14e.json)."""
    T, out = x.shape[0], A.shape[contract:]
    k = x.size // T
    mask = w.reshape(w.shape + (1,) * (len(out) - 1))
    splits = shrink_splits(k)
    if T > SHRINK_SPLIT_MAX_TOKENS or splits < 2:
        return _dot(x, A, contract) * mask
    xs = x.reshape(T, splits, k // splits)
    As = A.reshape((splits, k // splits) + out)
    parts = jax.lax.dot_general(xs, As, (((2,), (1,)), ((1,), (0,))), preferred_element_type=F32)  # [splits, T, ..]
    return (parts.sum(0) * mask).astype(A.dtype)


def delta(kind: str, x, A, B, w):
    """The LoRA term of projection `kind` for tokens x with slot weights w [T, S] (see the module docstring)."""
    dt = B.dtype
    w = w.astype(dt)  # one-hot: exact in any dtype
    if kind == "embed":  # x: token ids [T]; A's rows [S, R] are looked up, not multiplied
        return _dot(A[x] * w[:, :, None], B, 2)
    # The shrink reads x through an optimization barrier: XLA's GPU DotMerger merges a small dot into a large one
    # that shares its operand (x @ W_qkv and x @ A_qkv) by concatenating their weights, which copied the base
    # weight every step (H100, 8 adapters, batch 64: a 34.7 us concatenate a layer, lora_profile_h100_16d6b33.json).
    x = jax.lax.optimization_barrier(x.astype(dt))
    if kind == "qkv":
        return _expand_qkv(_shrink(x, A, 1, w), B)
    if kind == "gate_up":
        return _expand_gate_up(_shrink(x, A, 1, w), B)
    u = _shrink(x, A, 2 if kind == "o" else 1, w)  # [T, S, R]
    return _dot(u, B, 2, out=F32 if kind == "lm_head" else None)  # logits are float32


def _expand_qkv(u, B):
    """Masked shrink u [T, S, 3, R] . qkv's B -> [T, K, G + 2, H]."""
    if B.ndim == 6:  # block-diagonal [S, 3, R, K, G + 2, H]
        return _dot(u, B, 3)
    # per column [G + 2, S, R, K, H]: the columns lead u (each reads its part's shrink) and the expand's output
    u = jnp.moveaxis(jnp.take(u, jnp.asarray(qkv_parts(B.shape[0] - 2)), axis=2), 2, 0)
    return jnp.moveaxis(_dot(u, B, 2, batch=1), 0, 2)  # [G + 2, T, K, H] -> [T, K, G + 2, H]


def _expand_gate_up(u, B):
    """Masked shrink u [T, S, 2, R] . gate_up's B [2, S, R, F] -> [2, T, F] (the part leads: a batch axis)."""
    return _dot(jnp.moveaxis(u, 2, 0), B, 2, batch=1)


# ---- LoRA fused into the base projections (one device, 16-bit base weights: slots.py's fused layouts) ----
# The column-parallel projections (qkv, gate_up) hold every slot's A as columns beside the base weight, so one GEMM
# computes the base projection and the shrink; the row-parallel ones (o, down) hold every slot's B as rows under
# the base weight, so one GEMM over [input | masked shrink] computes the base projection and the expand.


def qkv_shape(B) -> tuple[int, int, int]:
    """(K, G + 2, H) of the qkv projection whose slot B this is (either layout)."""
    return B.shape[3:] if B.ndim == 6 else (B.shape[3], B.shape[0], B.shape[4])


def _fused_in(h, W, n_base: int, w, parts: int):
    """h [T, D] @ W [D, n_base + S * parts * R] -> (the base projection [T, n_base], the shrink [T, S, parts, R]
    masked to each token's slot)."""
    T, S = h.shape[0], w.shape[1]
    out = jnp.dot(h, W)
    u = out[:, n_base:].reshape(T, S, parts, -1) * w.astype(out.dtype)[:, :, None, None]
    return out[:, :n_base], u


def fused_qkv(h, W, B, w, bias=None):
    """The qkv projection with each token's LoRA term: h [T, D], W [D, K * (G + 2) * H + S * 3 * R] -> [T, K,
    G + 2, H] (the delta first in the sum, as add() puts it)."""
    shape = qkv_shape(B)
    base, u = _fused_in(h, W, math.prod(shape), w, 3)
    base = base.reshape(h.shape[0], *shape)
    if bias is not None:
        base = base + bias
    return _expand_qkv(u, B).astype(base.dtype) + base


def fused_gate_up(h, W, B, w, bias=None):
    """(gate, up) [T, F] each with its LoRA term: h [T, D], W [D, 2 * F + S * 2 * R]."""
    F = B.shape[-1]
    base, u = _fused_in(h, W, 2 * F, w, 2)
    base = base.reshape(h.shape[0], 2, F)
    if bias is not None:
        base = base + bias
    d = _expand_gate_up(u, B).astype(base.dtype)
    return base[:, 0] + d[0], base[:, 1] + d[1]


def fused_out(x, A, W, w):
    """The o / down projection with each token's LoRA term: x [T, N, H] (o, A [N, H, S, R]) or [T, F] (down,
    A [F, S, R]), W [N * H or F + S * R, D]: the shrink, masked, then one GEMM of [x | shrink] and W."""
    T = x.shape[0]
    u = _shrink(x, A, x.ndim - 1, w.astype(A.dtype))
    return jnp.dot(jnp.concatenate([x.reshape(T, -1), u.reshape(T, -1).astype(x.dtype)], axis=1), W)


FUSED_BASE = {"qkv": "w_qkv", "o": "wo", "gate_up": "w_gate_up", "down": "w_down"}  # slot kind -> base weight
FUSED_KINDS = ("qkv", "o", "gate_up", "down")  # the projections fused (slots.py: where fuses_base() allows it)


def join_base(w, x, columns: bool):
    """A base weight and a slot array as one 2-D array: x's [D, S * P * R] columns beside w [D, ..] (columns:
    qkv's, gate_up's A) or x's [S * R, D] rows under w [.., D] (o's, down's B)."""
    if columns:
        D = w.shape[0]
        return jnp.concatenate([w.reshape(D, -1), x.reshape(D, -1).astype(w.dtype)], axis=1)
    return jnp.concatenate([w.reshape(-1, w.shape[-1]), x.reshape(-1, x.shape[-1]).astype(w.dtype)])


COLUMN_KINDS = ("qkv", "gate_up")  # fused as A's columns beside the base weight; o, down as B's rows under it


def fuse_pair(kind: str, w, a, b, join=join_base):
    """kind's fused pair from its base weight w and slot arrays (A, B): (join(w, A), B) for the COLUMN_KINDS,
    (A, join(w, B)) otherwise (join: join_base, or a jitted copy of it)."""
    if kind in COLUMN_KINDS:
        return join(w, a, columns=True), b
    return a, join(w, b, columns=False)


def fuse_layer(base: dict, slots: dict) -> dict:
    """One layer's fused arrays from its base weights (w_qkv [D, K, G + 2, H], wo [N, H, D], w_gate_up [D, 2, F],
    w_down [F, D]) and slot arrays (the layouts above): {"qkv_fused": (W, B), "o_fused": (A, W), "gate_up_fused":
    (W, B), "down_fused": (A, W)} for the FUSED_KINDS, the other kinds' slot arrays as they are."""
    out = {k: v for k, v in slots.items() if k not in FUSED_KINDS}
    for kind in FUSED_KINDS:
        out[f"{kind}_fused"] = fuse_pair(kind, base[FUSED_BASE[kind]], *slots[kind])
    return out


def slot_major(kind: str, A, B):
    """The slot arrays of kind with the slot axis leading: A [S, in.., (P,) R], B [S, (P,) R, out..] (gate_up's B
    [S, 2, R, F]; qkv's per-column B [S, R, K, G + 2, H])."""
    A = jnp.moveaxis(A, 2 if kind == "o" else 1, 0)
    if kind == "gate_up":
        B = jnp.transpose(B, (1, 0, 2, 3))
    elif kind == "qkv" and B.ndim == 5:
        B = jnp.transpose(B, (1, 2, 3, 0, 4))
    return A, B


def delta_reference(kind: str, x, A, B, slots):
    """delta() by gathering each token's own A and B (slots [T], -1: none), in float32."""
    A, B = slot_major(kind, A, B)
    s = jnp.maximum(slots, 0)
    live = (slots >= 0).astype(F32)
    At, Bt = A[s].astype(F32), B[s].astype(F32)  # [T, ...]
    if kind == "embed":
        u = jnp.take_along_axis(At, x[:, None, None], axis=1)[:, 0]  # [T, R]
        out = jnp.einsum("TR,TRD->TD", u, Bt)
    elif kind == "qkv":
        u = jnp.einsum("TD,TDpR->TpR", x.astype(F32), At)
        if Bt.ndim == 6:
            out = jnp.einsum("TpR,TpRKgH->TKgH", u, Bt)
        else:
            u = jnp.take(u, jnp.asarray(qkv_parts(Bt.shape[3] - 2)), axis=1)
            out = jnp.einsum("TgR,TRKgH->TKgH", u, Bt)
    elif kind == "gate_up":
        out = jnp.einsum("TcR,TcRF->cTF", jnp.einsum("TD,TDcR->TcR", x.astype(F32), At), Bt)
        return out * live[None, :, None]
    else:
        eq = {"o": "TNH,TNHR->TR", "down": "TF,TFR->TR", "lm_head": "TD,TDR->TR"}[kind]
        out = jnp.einsum("TR,TR...->T...", jnp.einsum(eq, x.astype(F32), At), Bt)
    return out * live.reshape((-1,) + (1,) * (out.ndim - 1))


def add(y, kind: str, x, lora, w):
    """y + the LoRA term, in y's dtype; lora: the layer's (A, B) of kind, or None (y unchanged). The sum is the
    last operation on the expand GEMM's output, so XLA can run it in that GEMM's epilogue, and the delta is its
    first operand: XLA's GemmRewriter matches add(GEMM, bias) trying operand 0 as the GEMM first and gives up when
    that GEMM already adds a bias. For o / down the decoder passes y = residual + base output (the base model's
    add, in the base GEMM's epilogue), whose GEMM has run that add: with y first, neither add ran in an epilogue
    (two `wrapped_add` kernels a layer in an H100 trace, lora_h100_797b2f2.json)."""
    if lora is None:
        return y
    d = delta(kind, x, *lora, w).astype(y.dtype)
    return (jnp.moveaxis(d, 0, 1) if kind == "gate_up" else d) + y


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weights", "token_slots"], meta_fields=[])
@dataclass(frozen=True)
class LoRAInputs:
    """What a step passes the decoder for LoRA: the slot arrays (slots.py) and each token's slot."""

    weights: dict  # {"layers": [{"qkv": (A, B), "o", "gate_up", "down"}], "embed": (A, B), "lm_head": (A, B)}
    token_slots: jax.Array  # [T] int32 slot of each token's adapter; -1: the base model (and padding)

    @property
    def num_slots(self) -> int:
        return num_slots(self.weights["embed"])

    @property
    def dtype(self):
        return self.weights["embed"][1].dtype
