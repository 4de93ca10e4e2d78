"""FP8 W8A8 GEMV for the decode step's few rows (Pallas, Triton lowering): quant.fp8_matmul's function for M <= 2
rows with the activation quantization inside the GEMM's kernel.

    y = (round_e4m3(x / s) @ W^T) * s * w_scale, s = max(max|x_m| / 448, FP8_MIN_SCALE) per row

Grid (N / BN, splits). A program owns BN output columns and one contiguous run of K (split-K):
1. the token scales: max |x_m| over x's whole row (a few KB, read from L2 by every program);
2. per K tile: x's [M, BK] slice divided by its scale, clipped to e4m3's range, rounded to e4m3 and widened to
   float16 (every e4m3 value is a float16: exact), its M rows stacked to the MMA's 16; the [BN, BK] e4m3 weight tile
   widened to float16 (one conversion per two values on sm_89+, exact); one MMA into a float32 [16, BN] accumulator
   (the products are exact, the sums float32);
3. the split's sums times the token scale, then the channel (or tensor) scale, written as float32 partials
   [splits, M, N]; the caller sums them in x's dtype's rounding (in a fusion with whatever comes next: a residual
   add, silu * up, or the fused qkv/RoPE/write kernel, which takes split-K partials).

x may come in two other forms (X_MODES), each skipping step 1's pass over x's row, which every program makes (down:
57 KB of L2 reads a program at 2 rows): already in e4m3 with its token scales (the add + norm pass in front of qkv /
gate-up wrote them, quant.add_rms_norm(fp8=True)), or 16-bit with partial maxima of |x| whose max is the row's
(fp8_gemv_silu_kernel's output, for down).

fp8_gemv_silu_kernel: gate / up's GEMV with silu(gate) * up as its epilogue. Grid (F / BN,): program n multiplies
gate's rows n * BN.. and up's F + n * BN.. of the one [2F, K] weight over all of K (no split-K: the epilogue needs the
sums), rounds both to the output's dtype, writes silu(gate) * up [M, BN] and its rows' max of |a| [M, 1] (down's
token scales without a pass over a's row). It replaces fp8_gemv_kernel's gate / up call and XLA's silu * up fusion.
On an H200 (8B gate / up, bench/results/quant_kernels_fp8silu_sweep_h200_d1efdc2.json) the "split" layout's two
16-column MMAs a K step run at 53.6 us at 2 rows, slower than the GEMV and XLA's fusion (33.4); on a weight
interleaved at load time ("interleaved", interleave_gate_up: one [2 BN, K] block and one MMA a K step) it takes 31.5,
or 30.4 with e4m3 rows. "paired" (the default) reads the weight as it is, gate's and up's BN rows as one [2, BN, BK]
tile of w viewed [2, F, K], stacked into one MMA: compiled for sm_90a (bench/probes/deviceless_compile.py, no GPU
run yet) its PTX has the interleaved kernel's loads, cp.async, ldmatrix, MMAs and barriers one for one (only address
arithmetic differs) and 40-64 registers a thread against 48-73, no spills. The decoder runs it with
quant_matmul.FP8_GEMV_SILU on (off by default until an engine A/B on a GPU). The e4m3 rows (x_mode "e4m3") are the
decoder's default (FP8_ADD_NORM_E4M3).

What it replaces at the engine's batch-1 bucket (H100 trace, 8B fp8, b42ec8a): per projection an XLA reduce for
the token scales and a convert that writes the rounded x before XLA's GEMM (~1.2-1.6 us each). Measured on an H100
(bench/results/quant_kernels_h100_6755320_fp8_gemv.json, M 2, the call with its partials' sum): qkv 13.4, o 10.4,
gate_up 44.8, down 27.3 us against 15.3 / 12.3 / 46.9 / 27.4 for XLA's widened dot with the residual add; engine
batch-1 ITL 3.54 vs 3.65 ms (bench/KERNELS_NOTES.md "Measured in stop 47").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import mma, triton_params

MAX_ROWS = 2  # the engine's batch-1 decode bucket (2 rows); more rows take quant.fp8_matmul's dot
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
NUM_SMS = 132  # H100 / H200: sizes split-K statically


def supported(x_dtype, m: int, n: int, k: int) -> bool:
    """Inputs the kernel takes: 16-bit x of at most MAX_ROWS rows, N a multiple of 16, K of 128."""
    return (
        jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and 1 <= m <= MAX_ROWS
        and n % 16 == 0
        and k % 128 == 0
    )


def plan(n: int, k: int, block_n=None, block_k=None, splits=None):
    """Static (block_n, block_k, splits, tiles per split): ~4 programs an SM unless splits is given; 32 columns a
    program where that alone gives them (no split-K), else 64 and split-K. H100, M 2, 8B shapes, whole call incl.
    the partials' sum (bench/results/quant_kernels_h100_6755320_fp8_gemv.json): gate_up BN 32 one split 44.8 us vs
    BN 64 two splits 49.5; qkv / o / down BN 64 13.4 / 10.4 / 27.3 vs BN 32 13.9 / 11.1 / 28.4. H200, M 2, 16
    other tilings of qkv / o / down (bench/results/quant_kernels_fp8gemv_h200_dd2a220_sweep.json): none more than
    3 % faster than these."""
    bk = block_k or next(b for b in (256, 128) if k % b == 0)
    bn = block_n or (32 if n // 32 >= 4 * NUM_SMS and n % 32 == 0 else next(b for b in (64, 32, 16) if n % b == 0))
    tiles = k // bk
    if splits is None:
        splits = max(1, min(tiles, -(-4 * NUM_SMS // (n // bn))))
    per = -(-tiles // splits)
    return bn, bk, -(-tiles // per), per


# How the kernels take x (static): "row" 16-bit x whose token scales each program reduces from the whole row; "e4m3"
# x already rounded, xs its token scales [M, 1] (quant.Fp8Rows: the add + norm pass before it wrote them); "amax"
# 16-bit x with xs [M, P] partial maxima of |x| whose max is the row's (quant.RowsWithMax: the gate / up kernel's
# programs below wrote them), so a program reads P values a row instead of K.
X_MODES = ("row", "e4m3", "amax")


def _token_scales(x_ref, xs_ref, *, bk, min_scale, x_mode):
    """s [M, 1] float32: max(max|x_m| / 448, min_scale), or xs itself for e4m3 rows."""
    if x_mode == "e4m3":
        return xs_ref[...]
    f32 = jnp.float32
    # a static unroll of independent loads into an elementwise max, then one row reduction (a reduction per tile
    # costs a shared-memory round trip and a barrier each: ~0.5 us a tile)
    if x_mode == "amax":
        P = xs_ref.shape[1]
        c = P & -P  # the largest power of two dividing P: Triton's blocks are powers of two
        amax = xs_ref[:, pl.ds(0, c)]
        for i in range(1, P // c):
            amax = jnp.maximum(amax, xs_ref[:, pl.ds(i * c, c)])
    else:
        amax = jnp.abs(x_ref[:, pl.ds(0, bk)].astype(f32))
        for i in range(1, x_ref.shape[1] // bk):
            amax = jnp.maximum(amax, jnp.abs(x_ref[:, pl.ds(i * bk, bk)].astype(f32)))
    return jnp.maximum(amax.max(axis=1, keepdims=True) / FP8_MAX, min_scale)


def _x_tile(x_ref, k0, bk, s, x_mode):
    """x's [M, BK] slice at k0 rounded to e4m3 (W8A8's x) and widened to float16 (every e4m3 value is a float16:
    exact), its M rows stacked to the MMA's 16."""
    M = x_ref.shape[0]
    if x_mode == "e4m3":
        x = x_ref[:, pl.ds(k0, bk)]
    else:
        x = jnp.clip(x_ref[:, pl.ds(k0, bk)].astype(jnp.float32) / s, -FP8_MAX, FP8_MAX).astype(FP8)
    return jnp.broadcast_to(x.astype(jnp.float16)[None], (16 // M, M, bk)).reshape(16, bk)


def _scaled(acc, s, ws_ref, per_tensor):
    """A float32 [16, BN] accumulator of stacked rows as [M, BN] times the token and channel (or tensor) scales
    (ws_ref [BN], or [2, BN / 2] for the paired silu kernel's gate and up, or [1])."""
    M = s.shape[0]
    y = acc.reshape(16 // M, M, -1).max(axis=0)  # the copies are bitwise equal: max keeps them exact
    ws = ws_ref[0] if per_tensor else ws_ref[...].astype(jnp.float32).reshape(1, -1)
    return (y * s) * ws


def _split(refs, x_mode):
    """(xs_ref or None, the output refs) of a kernel's trailing refs."""
    return (None, refs) if x_mode == "row" else (refs[0], refs[1:])


def _gemv_acc(x_ref, w_ref, s, *, bk, x_mode, lo, hi, width):
    """x's rows (token scales s) times the weight block w_ref [width, K] (or [2, width / 2, K]: the paired silu
    kernel's gate and up rows, one tile of both) over K tiles lo..hi: a float32 [16, width] accumulator of stacked
    rows, one MMA a tile."""

    def tile(k0):
        if len(w_ref.shape) == 3:
            return w_ref[:, :, pl.ds(k0, bk)].reshape(width, bk)
        return w_ref[:, pl.ds(k0, bk)]

    def body(t, acc):
        k0 = t * bk
        return acc + mma(_x_tile(x_ref, k0, bk, s, x_mode), tile(k0).astype(jnp.float16), trans_b=True)

    return jax.lax.fori_loop(lo, hi, body, jnp.zeros((16, width), jnp.float32))


def _kernel(x_ref, w_ref, ws_ref, *refs, bk, per_split, tiles, min_scale, per_tensor, x_mode):
    xs_ref, (o_ref,) = _split(refs, x_mode)
    s = _token_scales(x_ref, xs_ref, bk=bk, min_scale=min_scale, x_mode=x_mode)  # [M, 1]
    lo = pl.program_id(1) * per_split
    hi = jnp.minimum(lo + per_split, tiles)
    acc = _gemv_acc(x_ref, w_ref, s, bk=bk, x_mode=x_mode, lo=lo, hi=hi, width=o_ref.shape[-1])
    o_ref[...] = _scaled(acc, s, ws_ref, per_tensor)


def _silu_store(g, u, a_ref, amax_ref):
    """gate and up (scaled, float32 [M, BN]) rounded to a's 16-bit dtype (the unfused GEMV's output), then HF's
    silu(gate) * up in that dtype (silu in float32 rounded, times up in float32 rounded) into a_ref, and its rows'
    max of |a| into amax_ref."""
    f32, dtype = jnp.float32, a_ref.dtype
    g, u = g.astype(dtype).astype(f32), u.astype(dtype).astype(f32)
    a = ((g * jax.nn.sigmoid(g)).astype(dtype).astype(f32) * u).astype(dtype)
    a_ref[...] = a
    amax_ref[...] = jnp.abs(a.astype(f32)).max(axis=1, keepdims=True)


def _silu_kernel(x_ref, wg_ref, wu_ref, sg_ref, su_ref, *refs, bk, tiles, min_scale, per_tensor, x_mode):
    xs_ref, (a_ref, amax_ref) = _split(refs, x_mode)
    s = _token_scales(x_ref, xs_ref, bk=bk, min_scale=min_scale, x_mode=x_mode)
    f32, op = jnp.float32, jnp.float16

    def body(t, accs):
        k0 = t * bk
        x = _x_tile(x_ref, k0, bk, s, x_mode)
        g = accs[0] + mma(x, wg_ref[:, pl.ds(k0, bk)].astype(op), trans_b=True)
        return g, accs[1] + mma(x, wu_ref[:, pl.ds(k0, bk)].astype(op), trans_b=True)

    zero = jnp.zeros((16, a_ref.shape[-1]), f32)
    g, u = jax.lax.fori_loop(0, tiles, body, (zero, zero))
    _silu_store(_scaled(g, s, sg_ref, per_tensor), _scaled(u, s, su_ref, per_tensor), a_ref, amax_ref)


def _silu_il_kernel(x_ref, w_ref, ws_ref, *refs, bk, tiles, min_scale, per_tensor, x_mode):
    """_silu_kernel with one [2 BN, BK] tile and one MMA a K step, as _kernel runs them, then the product split into
    gate's and up's BN columns: w_ref [2 BN, K] of an interleaved weight (interleave_gate_up), or [2, BN, K] of the
    weight as it is (layout "paired": gate's BN rows and up's in one block, their tiles stacked in registers)."""
    xs_ref, (a_ref, amax_ref) = _split(refs, x_mode)
    s = _token_scales(x_ref, xs_ref, bk=bk, min_scale=min_scale, x_mode=x_mode)
    acc = _gemv_acc(x_ref, w_ref, s, bk=bk, x_mode=x_mode, lo=0, hi=tiles, width=2 * a_ref.shape[-1])
    _silu_store(*jnp.split(_scaled(acc, s, ws_ref, per_tensor), 2, axis=1), a_ref, amax_ref)


def interleave_gate_up(w, w_scale, block_n: int):
    """A gate / up weight [2F, K] (gate's rows, then up's) and its scales [2F] (or [1]) in the order
    fp8_gemv_silu_kernel(interleaved=True) reads them: block n of 2 block_n rows is gate's rows n * block_n.. then
    up's F + n * block_n.. (a load-time permutation; the product's columns come out in the same order)."""
    F = w.shape[0] // 2
    if w.shape[0] % 2 or F % block_n:
        raise ValueError(f"w's rows {w.shape[0]} must be 2 F with F a multiple of block_n={block_n}")
    order = jnp.arange(2 * F).reshape(2, F // block_n, block_n).transpose(1, 0, 2).reshape(-1)
    w_scale = jnp.asarray(w_scale)
    return w[order], (w_scale if w_scale.size == 1 else w_scale.reshape(-1)[order])


def _x_operands(x, xs, x_mode, M, K):
    """The x operands' block specs and arrays for a grid whose index maps take two program ids (or one)."""
    if x_mode not in X_MODES:
        raise ValueError(f"x_mode must be one of {X_MODES}, got {x_mode!r}")
    specs, args = [pl.BlockSpec((M, K), lambda *_: (0, 0))], [x]
    if x_mode != "row":
        specs.append(pl.BlockSpec(xs.shape, lambda *_: (0, 0)))
        args.append(xs)
    return specs, args


def _check_x(x, xs, w, x_mode):
    """ValueError unless the kernels take x in x_mode (16-bit, or e4m3 for "e4m3"), xs and w (supported's shapes)."""
    M, K = x.shape
    e4m3 = x_mode == "e4m3"
    ok = (
        w.ndim == 2
        and w.shape[1] == K
        and jnp.dtype(w.dtype) == jnp.dtype(FP8)
        and (jnp.dtype(x.dtype) == jnp.dtype(FP8) if e4m3 else True)
        and supported(jnp.bfloat16 if e4m3 else x.dtype, M, w.shape[0], K)
        and (x_mode == "row" or (xs is not None and xs.ndim == 2 and xs.shape[0] == M))
        and (not e4m3 or xs.shape[1] == 1)
    )
    if not ok:
        xs_shape = None if xs is None else xs.shape
        raise ValueError(
            f"the fp8 GEMV kernels do not take x {x.dtype} {x.shape} (x_mode={x_mode!r}, xs {xs_shape}) with w "
            f"{w.dtype} {w.shape}"
        )


_STATIC = ("min_scale", "x_mode", "block_n", "block_k", "splits", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_gemv_kernel(
    x,
    w,
    w_scale,
    xs=None,
    *,
    min_scale,
    x_mode="row",
    block_n=None,
    block_k=None,
    splits=None,
    num_warps=4,
    num_stages=3,
    interpret=False,
):
    """x [M, K] (16-bit, or e4m3 for x_mode "e4m3"; M <= MAX_ROWS), w [N, K] float8_e4m3fn, w_scale [N] or [1] (per
    tensor) float32, xs: x's token scales [M, 1] ("e4m3") or partial maxima [M, P] ("amax"; X_MODES) -> float32
    partials [splits, M, N] whose sum is the scaled product (see the module docstring). Tuning (static): block_n,
    block_k, splits (plan()), num_warps, num_stages."""
    _check_x(x, xs, w, x_mode)
    M, K = x.shape
    N = w.shape[0]
    BN, BK, S, per = plan(N, K, block_n, block_k, splits)
    if N % BN or K % BK:
        raise ValueError(f"N={N} must be a multiple of block_n={BN} and K={K} of block_k={BK}")
    per_tensor = w_scale.size == 1
    ws = jnp.asarray(w_scale, jnp.float32).reshape(-1)
    kernel = functools.partial(
        _kernel, bk=BK, per_split=per, tiles=K // BK, min_scale=min_scale, per_tensor=per_tensor, x_mode=x_mode
    )
    x_specs, x_args = _x_operands(x, xs, x_mode, M, K)
    return pl.pallas_call(
        kernel,
        grid=(N // BN, S),
        in_specs=[
            x_specs[0],
            pl.BlockSpec((BN, K), lambda n, s: (n, 0)),
            pl.BlockSpec((1,), lambda n, s: (0,)) if per_tensor else pl.BlockSpec((BN,), lambda n, s: (n,)),
            *x_specs[1:],
        ],
        out_specs=pl.BlockSpec((None, M, BN), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((S, M, N), jnp.float32),
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"fp8_gemv_{BN=}_{BK=}_{S=}" + ("" if x_mode == "row" else f"_{x_mode}"),
    )(x_args[0], w, ws, *x_args[1:])


SILU_LAYOUTS = ("split", "paired", "interleaved")


def silu_plan(f: int, k: int, block_n=None, block_k=None, layout: str = "paired"):
    """Static (block_n, block_k) of fp8_gemv_silu_kernel: a program owns block_n gate and block_n up columns over the
    whole of K (no split: its epilogue needs the sums); 32 columns of each where that gives ~4 programs an SM, else
    16 (the 8B shape's F 14336: 896 programs of 16 + 16 columns, as many as fp8_gemv_kernel's plan runs for the
    same weight). K tiles of 128: two weight tiles a step hold more registers than fp8_gemv's one, and at 256 the
    8B gate / up kernel took 80 registers a thread with 4 bytes spilled (2 rows; 112 with e4m3 rows: 4 programs an
    SM, 896 programs in 1.7 waves) against 68-70 and no spill at 128 (bench/probes/deviceless_compile.py: XLA's
    Triton and ptxas for sm_90a, no GPU run). Layouts "paired" and "interleaved" (one MMA a step, as
    fp8_gemv_kernel): K tiles of 256 where K allows, as fp8_gemv_kernel's."""
    if layout not in SILU_LAYOUTS:
        raise ValueError(f"layout must be one of {SILU_LAYOUTS}, got {layout!r}")
    bk = block_k or next(b for b in ((128, 256) if layout == "split" else (256, 128)) if k % b == 0)
    return block_n or (32 if f // 32 >= 4 * NUM_SMS and f % 32 == 0 else 16), bk


@functools.partial(
    jax.jit,
    static_argnames=(
        "min_scale",
        "x_mode",
        "out_dtype",
        "layout",
        "block_n",
        "block_k",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def fp8_gemv_silu_kernel(
    x,
    w,
    w_scale,
    xs=None,
    *,
    min_scale,
    x_mode="row",
    out_dtype=None,
    layout="paired",
    block_n=None,
    block_k=None,
    num_warps=4,
    num_stages=3,
    interpret=False,
):
    """silu(gate) * up of an fp8 W8A8 gate / up weight w [2F, K] (gate's rows, then up's), w_scale [2F] or [1], for
    x [M, K] as fp8_gemv_kernel takes it (x_mode, xs) -> (a [M, F] in out_dtype (16-bit; x's dtype by default,
    required for e4m3 x), amax [M, F / block_n] float32): gate and up each rounded to that dtype, silu(gate) rounded,
    times up rounded (HF's ops in a 16-bit dtype), and the max of |a| over each program's columns (the next
    projection's token scales in x_mode "amax"). Program n multiplies gate's rows n * block_n.. and up's
    F + n * block_n.. (no split-K). layout (static; SILU_LAYOUTS): "split" loads and multiplies gate's and up's
    block_n rows as two tiles a K step; "paired" loads them as one [2, block_n, BK] tile of w viewed [2, F, K] and
    multiplies it in one MMA, as fp8_gemv_kernel does its [block_n, BK]; "interleaved" takes w and w_scale in
    interleave_gate_up(block_n)'s order and reads one [2 block_n, K] block. Tuning (static): block_n, block_k
    (silu_plan()), num_warps, num_stages."""
    _check_x(x, xs, w, x_mode)
    M, K = x.shape
    F = w.shape[0] // 2
    BN, BK = silu_plan(F, K, block_n, block_k, layout)
    if w.shape[0] % 2 or F % BN or K % BK:
        raise ValueError(f"w's rows {w.shape[0]} must be 2 F with F a multiple of block_n={BN}, K={K} of block_k={BK}")
    per_tensor = w_scale.size == 1
    ws = jnp.asarray(w_scale, jnp.float32).reshape(-1)
    P = F // BN
    if layout == "interleaved":  # one [2 BN, K] block of w and of its scales a program
        w_specs = [pl.BlockSpec((2 * BN, K), lambda n: (n, 0))]
        w_specs.append(pl.BlockSpec((1,), lambda n: (0,)) if per_tensor else pl.BlockSpec((2 * BN,), lambda n: (n,)))
        w_args = (w, ws)
    elif layout == "paired":  # gate's and up's BN rows (and scales) as one [2, BN, K] block of w viewed [2, F, K]
        w_specs = [pl.BlockSpec((2, BN, K), lambda n: (0, n, 0))]
        w_specs.append(pl.BlockSpec((1,), lambda n: (0,)) if per_tensor else pl.BlockSpec((2, BN), lambda n: (0, n)))
        w_args = (w.reshape(2, F, K), ws if per_tensor else ws.reshape(2, F))
    else:
        w_specs = [pl.BlockSpec((BN, K), lambda n: (n, 0)), pl.BlockSpec((BN, K), lambda n: (n + P, 0))]
        if per_tensor:
            w_specs += [pl.BlockSpec((1,), lambda n: (0,))] * 2
        else:
            w_specs += [pl.BlockSpec((BN,), lambda n: (n,)), pl.BlockSpec((BN,), lambda n: (n + P,))]
        w_args = (w, w, ws, ws)
    kernel = functools.partial(
        _silu_kernel if layout == "split" else _silu_il_kernel,
        bk=BK,
        tiles=K // BK,
        min_scale=min_scale,
        per_tensor=per_tensor,
        x_mode=x_mode,
    )
    x_specs, x_args = _x_operands(x, xs, x_mode, M, K)
    dtype = jnp.dtype(out_dtype or x.dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"fp8_gemv_silu_kernel writes a 16-bit a: out_dtype={out_dtype} for x {x.dtype}")
    return pl.pallas_call(
        kernel,
        grid=(P,),
        in_specs=[x_specs[0], *w_specs, *x_specs[1:]],
        out_specs=[pl.BlockSpec((M, BN), lambda n: (0, n)), pl.BlockSpec((M, 1), lambda n: (0, n))],
        out_shape=[jax.ShapeDtypeStruct((M, F), dtype), jax.ShapeDtypeStruct((M, P), jnp.float32)],
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"fp8_gemv_silu_{BN=}_{BK=}"
        + {"split": "", "paired": "_pair", "interleaved": "_il"}[layout]
        + ("" if x_mode == "row" else f"_{x_mode}"),
    )(x_args[0], *w_args, *x_args[1:])
