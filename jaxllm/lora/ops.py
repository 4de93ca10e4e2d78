"""The batched LoRA matmul: every token adds its own adapter's (x @ A) @ B to a projection, adapters held in S device
slots. A pure function of arrays, so the mix of adapters in a batch is data, never a new program.

    select(slots [T], S) -> w [T, S]                        one-hot of each token's slot (-1, the base model: zeros)
    delta(kind, x, A, B, w) -> [T, *out] float32            every slot's shrink, masked to the token's own, expanded

Slot arrays (jaxllm/lora/peft.py's layouts with a leading slot axis, ranks zero-padded to R = max_lora_rank):
qkv A [S, D, 3, R] B [S, R, K, G + 2, H]; o A [S, N, H, R] B [S, R, D]; gate_up A [S, D, 2, R] B [S, R, 2, F];
down A [S, F, R] B [S, R, D]; embed A [S, V, R] B [S, R, D]; lm_head A [S, D, R] B [S, R, V].

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


def _qkv_parts(G: int):
    """Which shrink part (q 0, k 1, v 2) each of the G + 2 columns of a kv head reads."""
    return jnp.asarray([0] * G + [1, 2], jnp.int32)


def delta(kind: str, x, A, B, w):
    """The LoRA term of projection `kind` for tokens x with slot weights w [T, S] (see the module docstring)."""
    dt = B.dtype
    if kind == "embed":  # x: token ids [T]; A's rows are looked up, not multiplied
        u = jnp.moveaxis(A[:, x], 0, 1).astype(F32) * w[:, :, None]  # [T, S, R]
        return jnp.einsum("TSR,SRD->TD", u.astype(dt), B, preferred_element_type=F32)
    x = x.astype(dt)
    if kind == "qkv":
        u = jnp.einsum("TD,SDjR->TSjR", x, A, preferred_element_type=F32) * w[:, :, None, None]
        u = jnp.take(u, _qkv_parts(B.shape[3] - 2), axis=2)  # [T, S, G + 2, R]
        return jnp.einsum("TSgR,SRKgH->TKgH", u.astype(dt), B, preferred_element_type=F32)
    if kind == "gate_up":
        u = jnp.einsum("TD,SDcR->TScR", x, A, preferred_element_type=F32) * w[:, :, None, None]
        return jnp.einsum("TScR,SRcF->TcF", u.astype(dt), B, preferred_element_type=F32)
    eq = {"o": "TNH,SNHR->TSR", "down": "TF,SFR->TSR", "lm_head": "TD,SDR->TSR"}[kind]
    u = jnp.einsum(eq, x, A, preferred_element_type=F32) * w[:, :, None]
    return jnp.einsum("TSR,SR...->T...", u.astype(dt), B, preferred_element_type=F32)


def delta_reference(kind: str, x, A, B, slots):
    """delta() by gathering each token's own A and B (slots [T], -1: none), in float32."""
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
        return self.weights["embed"][0].shape[0]
