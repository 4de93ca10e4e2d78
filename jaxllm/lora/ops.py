"""The batched LoRA matmul: every token adds its own adapter's (x @ A) @ B to a projection, adapters held in S device
slots. A pure function of arrays, so the mix of adapters in a batch is data, never a new program.

    select(slots [T], S) -> w [T, S]                        one-hot of each token's slot (-1, the base model: zeros)
    delta(kind, x, A, B, w) -> [T, *out] float32            every slot's shrink, masked to the token's own, expanded

Slot arrays (jaxllm/lora/peft.py's per-adapter layouts with a slot axis S, ranks zero-padded to R = max_lora_rank;
P: the parts q, k, v of qkv / gate, up of gate_up):

    qkv      A [D, S, 3, R]      B [G + 2, S, R, K, H]   (B's leading axis: the column of a kv head, as in the base)
    o        A [N, H, S, R]      B [S, R, D]
    gate_up  A [D, S, 2, R]      B [2, S, R, F]
    down     A [F, S, R]         B [S, R, D]
    embed    A [V, S, R]         B [S, R, D]             (A's rows are looked up by token id)
    lm_head  A [D, S, R]         B [S, R, V]

Why these layouts: every GEMM reads its weights in place. A GEMM (cuBLAS, XLA:CPU's) needs each operand as
[batch, rows, cols] with the batch axes leading and the contracted and the kept axes each contiguous; an axis order
that is not is copied (transposed) by XLA before the GEMM, every step: with the slot axis leading, that copy of
every slot array (read + write + the GEMM's read: ~3x the bytes) was most of LoRA's decode cost. So A contracts on
its leading axes and keeps (S, [P,] R) together; B contracts on (S, R) and keeps the output; qkv's and gate_up's B
lead with their part as a GEMM batch axis (qkv's q columns read part 0 of the shrink, k part 1, v part 2), so the
expand is one batched GEMM whose output is transposed into the projection's layout (activations: small).
tests/test_lora.py checks the compiled delta() holds no copy of a slot array. The dot_generals below list the
contracted axes in memory order: jnp.einsum contracted the old B [S, R, D] over (R, S), which XLA copied too.

Why every slot: the shrink x @ A for all S slots is one GEMM ([T, D] x [D, S * 3R]) that reads each slot's A once,
and masking its output to the token's own slot before the expand makes the expand one GEMM over (S, R) as well.
In a decode step (memory-bound) that reads every slot's A and B once per step, as BGMV kernels do; gathering A / B
per token (the reference below) would copy them T times. The cost grows with max_loras, not with the adapters a
step uses: prefill FLOPs are T * D * S * 3R for the qkv shrink (at S * 3R = 384, 6% of an 8B qkv GEMM).
The reference gathers per token: obviously right, and the tests compare the two.
"""

from __future__ import annotations

import functools
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


def _qkv_parts(G: int):
    """Which shrink part (q 0, k 1, v 2) each of the G + 2 columns of a kv head reads."""
    return jnp.asarray([0] * G + [1, 2], jnp.int32)


def _dot(x, w, contract: int, batch: int = 0):
    """x [*batch, T.., *c] . w [*batch, *c, out..] over the last `contract` axes of x and the `contract` axes after
    w's batch axes, in memory order on both (float32 result)."""
    cx = tuple(range(x.ndim - contract, x.ndim))
    cw = tuple(range(batch, batch + contract))
    b = tuple(range(batch))
    return jax.lax.dot_general(x, w, ((cx, cw), (b, b)), preferred_element_type=F32)


def delta(kind: str, x, A, B, w):
    """The LoRA term of projection `kind` for tokens x with slot weights w [T, S] (see the module docstring)."""
    dt = B.dtype
    if kind == "embed":  # x: token ids [T]; A's rows [S, R] are looked up, not multiplied
        u = A[x].astype(F32) * w[:, :, None]  # [T, S, R]
        return _dot(u.astype(dt), B, 2)
    x = x.astype(dt)
    if kind in ("qkv", "gate_up"):
        u = _dot(x, A, 1) * w[:, :, None, None]  # [T, S, P, R]
        if kind == "qkv":
            u = jnp.take(u, _qkv_parts(B.shape[0] - 2), axis=2)  # [T, S, G + 2, R]
        u = jnp.moveaxis(u, 2, 0).astype(dt)  # the part leads: the expand's batch axis
        out = _dot(u, B, 2, batch=1)  # [P, T, *out]
        return jnp.moveaxis(out, 0, 2 if kind == "qkv" else 1)  # qkv [T, K, G + 2, H], gate_up [T, 2, F]
    u = _dot(x, A, 2 if kind == "o" else 1) * w[:, :, None]  # [T, S, R]
    return _dot(u.astype(dt), B, 2)


def slot_major(kind: str, A, B):
    """The slot arrays of kind with the slot axis leading and qkv's / gate_up's part beside B's output, as
    peft.py's per-adapter layouts with a leading S: qkv A [S, D, 3, R] B [S, R, K, G + 2, H], gate_up B
    [S, R, 2, F], the others A [S, in.., R] B [S, R, out]."""
    A = jnp.moveaxis(A, 2 if kind == "o" else 1, 0)
    if kind == "qkv":
        B = jnp.transpose(B, (1, 2, 3, 0, 4))
    elif kind == "gate_up":
        B = jnp.transpose(B, (1, 2, 0, 3))
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
        G = B.shape[3] - 2
        u = jnp.einsum("TD,TDjR->TjR", x.astype(F32), At)
        u = jnp.take(u, _qkv_parts(G), axis=1)
        out = jnp.einsum("TgR,TRKgH->TKgH", u, Bt)
    elif kind == "gate_up":
        out = jnp.einsum("TcR,TRcF->TcF", jnp.einsum("TD,TDcR->TcR", x.astype(F32), At), Bt)
    else:
        eq = {"o": "TNH,TNHR->TR", "down": "TF,TFR->TR", "lm_head": "TD,TDR->TR"}[kind]
        out = jnp.einsum("TR,TR...->T...", jnp.einsum(eq, x.astype(F32), At), Bt)
    return out * live.reshape((-1,) + (1,) * (out.ndim - 1))


def add(y, kind: str, x, lora, w):
    """y + the LoRA term (y's dtype); lora: the layer's (A, B) of kind, or None (y unchanged)."""
    if lora is None:
        return y
    return (y.astype(F32) + delta(kind, x, *lora, w)).astype(y.dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weights", "token_slots"], meta_fields=[])
@dataclass(frozen=True)
class LoRAInputs:
    """What a step passes the decoder for LoRA: the slot arrays (slots.py) and each token's slot."""

    weights: dict  # {"layers": [{"qkv": (A, B), "o", "gate_up", "down"}], "embed": (A, B), "lm_head": (A, B)}
    token_slots: jax.Array  # [T] int32 slot of each token's adapter; -1: the base model (and padding)

    @property
    def num_slots(self) -> int:
        return num_slots(self.weights["embed"])
