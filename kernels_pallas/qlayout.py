"""The packed layout of weight-only int4 / int8 linear weights that kernels_pallas.quantized_matmul reads, and the
helpers that build it from a checkpoint's plain integers (the loader's side) or from float weights (tests, bench).

The math. A linear layer y[m, n] = sum_k x[m, k] W[k, n] (W is [K, N]: in features x out features, the transpose
of torch's Linear.weight) with W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]: q unsigned b-bit integers
(b = 4 or 8), groups of G consecutive rows g(k) = k // G sharing a scale s and a zero point z (G = -1: one group
over all of K, "per channel"); symmetric checkpoints have no zeros and z = 2^(b-1) (GPTQ's sym convention; a signed
int4 / int8 checkpoint such as compressed-tensors' is q = w_signed + 2^(b-1) with no zeros).

The layout (`QuantizedWeight`), "planes". P = 32 // b values share one int32 word (8 for int4, 4 for int8). A
plane is L consecutive rows of K (L = `plane`: 32, 64 or 128, a divisor of G; see choose_plane); a tile is P
planes, L * P rows (int4 with L = 128: 1024 rows). K is padded with rows of zeros to Kp, a whole number of tiles.
Tile t is stored as L words per column: bit field j (bits [b*j, b*j + b), least significant first) of word row
L * t + r holds q[t * L * P + L * j + r, n], for j < P, r < L. So field j of a tile's L words is plane j:
  qweight [Kp / P, N] int32   (the bit pattern; values with the top bit set are negative as int32)
  scales  [ceil(Kp / G), N]   the model's dtype (bfloat16 / float16; float32 allowed); rows past K's groups are 0
  zeros   [ceil(Kp / G), N] or None   same dtype as scales, integer values in [0, 2^b); None: symmetric
  perm    [K] int32 or None   act-order: see below
Per channel: scales / zeros have one row. N is not padded: column-parallel (tensor-parallel) sharding splits
every array on its last axis; row-parallel sharding splits K, which needs each shard to be a whole number of
tiles (else repack each shard on its own: the helpers take any [K, N]).

Why this layout: a kernel program owning BN columns reads a tile as one [L, BN] int32 block (BN * 4 contiguous
bytes per row; 32 KB at L = 128, BN = 64: one large load in flight per tile), and extracts plane j with one shift
and mask, elementwise, into an [L, BN] block that multiplies a contiguous [M, L] slice of x in one MMA: no
register tile is ever reshaped or interleaved, and a plane lies inside one group (L divides G), so its group
scale applies to the MMA's result once per column instead of to every weight.

Act-order (GPTQ desc_act, a g_idx per row: row k's group is g_idx[k], not k // G). The sum over k may be taken
in any order: y = x @ W = x[:, perm] @ W[perm, :] for any permutation perm of K. With perm = a stable argsort of
g_idx, row i of W[perm] belongs to group g_idx[perm[i]] = i // G (each group has exactly G rows), so the permuted
weight has plain contiguous groups. pack_quantized applies perm to q's rows once at load time and keeps it in the
layout; quantized_matmul gathers x's columns by it (x[:, perm], a small XLA gather of [M, K]) before the kernel.
The permuted rows are no longer K's natural order, so an act-order weight cannot be row-sharded (vLLM's Marlin
has the same limit for row-parallel layers with act-order: it gathers the full input).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

PLANES = (128, 64, 32)  # rows of K per bit field of a tile (see the module docstring), largest first
MAGIC = 0x4B000000  # float32 2^23: bits (MAGIC | q) read as float32 are exactly 2^23 + q for 0 <= q < 2^23


def per_word(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits={bits}: only 4 and 8 bit weights are supported")
    return 32 // bits


def choose_plane(k: int, bits: int, group_size: int) -> int:
    """The default plane height: the largest of 128 / 64 / 32 that divides the group (any, per channel) and makes
    K a whole number of tiles; if none does, the largest that divides the group (K is then padded). 0 when no
    plane divides the group (group sizes that are not a multiple of 32: only the dequantize path takes those)."""
    fits = [p for p in PLANES if group_size == -1 or group_size % p == 0]
    if not fits:
        return 0
    exact = [p for p in fits if k % (p * per_word(bits)) == 0]
    return (exact or fits)[0]


def padded_k(k: int, bits: int, plane: int) -> int:
    t = plane * per_word(bits)
    return -(-k // t) * t


def num_groups(kp: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-kp // group_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A [K, N] weight in the packed layout (module docstring). A pytree: the arrays are its leaves, the rest is
    static. parts: the output widths of a fused projection whose N columns are the concatenation of several
    (q / k / v, gate / up), or None; quantized_matmul(..., split=True) returns one output per part."""

    qweight: jax.Array
    scales: jax.Array
    zeros: jax.Array | None
    perm: jax.Array | None
    bits: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))
    plane: int = dataclasses.field(metadata=dict(static=True))
    parts: tuple[int, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def n(self) -> int:
        return self.qweight.shape[-1]

    @property
    def kp(self) -> int:
        return self.qweight.shape[0] * per_word(self.bits)

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads from the weight (qweight, scales, zeros)."""
        arrs = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrs)


def act_order_perm(g_idx, group_size: int) -> np.ndarray | None:
    """The row permutation that makes an act-order weight's groups contiguous (module docstring): a stable argsort
    of g_idx [K]. None when g_idx already is k // G (no act-order). Raises if some group does not hold exactly
    group_size rows (then no permutation gives contiguous groups of G)."""
    g = np.asarray(g_idx).astype(np.int64).reshape(-1)
    K = g.shape[0]
    G = K if group_size == -1 else group_size
    natural = np.arange(K) // G
    if np.array_equal(g, natural):
        return None
    perm = np.argsort(g, kind="stable")
    if not np.array_equal(g[perm], natural):
        raise ValueError(
            f"g_idx does not put exactly group_size={group_size} rows in each group; "
            "this act-order layout cannot be permuted into contiguous groups"
        )
    return perm.astype(np.int32)


def pack_quantized(
    q, scales, zeros=None, *, bits: int, group_size: int, g_idx=None, parts=None, dtype=None, plane=None
) -> QuantizedWeight:
    """Packs a plain quantized weight into the layout (numpy, at load time).
    q [K, N]: unsigned integers in [0, 2^bits) (any integer dtype); scales [ceil(K / G), N] (G = group_size, -1: one
    row); zeros: the same shape with integer values in [0, 2^bits), or None (symmetric, z = 2^(bits - 1)).
    g_idx [K] (act-order checkpoints): row k's group; the rows are permuted once (act_order_perm). dtype: the
    scales' dtype in the layout (default: scales' own). parts: see QuantizedWeight. plane: rows per plane
    (default choose_plane; 32 for group sizes no plane divides, which the kernel then refuses)."""
    P = per_word(bits)
    q = np.asarray(q)
    if q.ndim != 2:
        raise ValueError(f"q must be [K, N], got shape {q.shape}")
    K, N = q.shape
    if group_size != -1 and (group_size <= 0 or K % group_size):
        raise ValueError(f"group_size={group_size} must divide K={K} (or be -1: per channel)")
    G = K if group_size == -1 else group_size
    ng = K // G
    scales = np.asarray(scales)
    if scales.shape != (ng, N):
        raise ValueError(f"scales must be [{ng}, {N}] for K={K}, group_size={group_size}; got {scales.shape}")
    if zeros is not None and np.shape(zeros) != (ng, N):
        raise ValueError(f"zeros must be [{ng}, {N}] like scales; got {np.shape(zeros)}")
    if q.min(initial=0) < 0 or q.max(initial=0) >= 1 << bits:
        raise ValueError(f"q must hold unsigned {bits}-bit values in [0, {1 << bits})")
    if parts is not None and sum(parts) != N:
        raise ValueError(f"parts {parts} must add up to N={N}")
    plane = plane or choose_plane(K, bits, group_size) or PLANES[-1]
    if plane not in PLANES:
        raise ValueError(f"plane={plane} must be one of {PLANES}")
    perm = None if g_idx is None else act_order_perm(g_idx, group_size)
    if perm is not None:
        q = q[perm]
    T = plane * P
    Kp = padded_k(K, bits, plane)
    qp = np.zeros((Kp, N), np.uint32)
    qp[:K] = q
    # [tiles, P planes, L rows, N] -> field j of word (t, r) = plane j's row r
    planes = qp.reshape(Kp // T, P, plane, N)
    words = np.zeros((Kp // T, plane, N), np.uint32)
    for j in range(P):
        words |= planes[:, j] << np.uint32(bits * j)
    dtype = jax.dtypes.canonicalize_dtype(dtype or scales.dtype)  # float64 scales -> float32 (no x64)
    gp = num_groups(Kp, group_size)
    s = np.zeros((gp, N), np.float32)
    s[:ng] = scales
    z = None
    if zeros is not None:
        z = np.zeros((gp, N), np.float32)
        z[:ng] = zeros
        z = jnp.asarray(z, dtype)
    return QuantizedWeight(
        qweight=jnp.asarray(words.reshape(Kp // P, N).view(np.int32)),
        scales=jnp.asarray(s, dtype),
        zeros=z,
        perm=None if perm is None else jnp.asarray(perm),
        bits=bits,
        group_size=group_size,
        k=K,
        plane=plane,
        parts=None if parts is None else tuple(int(p) for p in parts),
    )


def unpack_quantized(w: QuantizedWeight) -> np.ndarray:
    """The layout's integers back as q [K, N] (uint8 / uint16), in the stored (act-order permuted) row order."""
    P = per_word(w.bits)
    words = np.asarray(w.qweight).view(np.uint32).reshape(-1, w.plane, w.n)
    mask = np.uint32((1 << w.bits) - 1)
    planes = np.stack([(words >> np.uint32(w.bits * j)) & mask for j in range(P)], axis=1)  # [t, P, 32, N]
    return planes.reshape(-1, w.n)[: w.k].astype(np.uint8)


def unpack_planes(qweight, bits: int, plane: int):
    """jnp: the layout's words [Kp / P, N] -> the integers q [Kp, N] (int32 in [0, 2^bits)), rows in the stored order,
    K's zero padding included."""
    P = per_word(bits)
    n = qweight.shape[-1]
    words = qweight.reshape(-1, 1, plane, n)  # [tiles, 1, L, N]
    shifts = (jnp.arange(P, dtype=jnp.int32) * bits).reshape(1, P, 1, 1)
    q = jax.lax.shift_right_logical(words, shifts) & ((1 << bits) - 1)  # [tiles, P planes, L, N]
    return q.reshape(-1, n)


def dequantize(w: QuantizedWeight, dtype=None):
    """jnp: the [K, N] weight, (q - z) * s computed in float32 and rounded once to dtype (default: the scales'),
    rows in the stored order (x[:, w.perm] multiplies it). One XLA elementwise fusion over qweight."""
    n = w.n
    q = unpack_planes(w.qweight, w.bits, w.plane)[: w.k].astype(jnp.float32)
    G = w.k if w.group_size == -1 else w.group_size

    def rows(a):  # [groups, N] -> [K, N]: row k reads group k // G
        a = a.astype(jnp.float32)
        if w.group_size == -1:
            return a
        # A broadcast, not jnp.repeat: with total_repeat_length that lowers to a gather through an index array
        # built by a scatter and a cumsum, and the gather sat in the GPU's dequantize fusion (which wrote the bf16
        # weight at ~1.25 TB/s on an H100, KERNELS_NOTES "Quantized matmuls").
        ng = -(-w.k // G)
        return jnp.broadcast_to(a[:ng, None], (ng, G, n)).reshape(ng * G, n)[: w.k]

    z = rows(w.zeros) if w.zeros is not None else float(1 << (w.bits - 1))
    return ((q - z) * rows(w.scales)).astype(dtype or w.scales.dtype)


def quantize_weight(w, *, bits: int, group_size: int, sym: bool = True):
    """Round-to-nearest quantization of a float [K, N] weight (numpy): (q, scales, zeros or None) for
    pack_quantized. Symmetric: s = max|w| / (2^(b-1) - 1) per group, q = round(w / s) + 2^(b-1); asymmetric:
    s = (max - min) / (2^b - 1), z = round(-min / s). For tests, benchmarks and 16-bit checkpoints quantized at
    load time (vLLM's dynamic quantization methods); GPTQ / AWQ checkpoints bring their own q, s, z."""
    w = np.asarray(w, np.float32)
    K, N = w.shape
    G = K if group_size == -1 else group_size
    if K % G:
        raise ValueError(f"group_size={group_size} must divide K={K}")
    g = w.reshape(K // G, G, N)
    top = (1 << bits) - 1
    if sym:
        half = 1 << (bits - 1)
        s = np.abs(g).max(axis=1) / (half - 1)
        s = np.where(s > 0, s, 1.0)
        q = np.clip(np.rint(g / s[:, None]) + half, 0, top)
        return q.reshape(K, N).astype(np.int32), s, None
    lo, hi = g.min(axis=1), g.max(axis=1)
    s = (hi - lo) / top
    s = np.where(s > 0, s, 1.0)
    z = np.clip(np.rint(-lo / s), 0, top)
    q = np.clip(np.rint(g / s[:, None]) + z[:, None], 0, top)
    return q.reshape(K, N).astype(np.int32), s, z
