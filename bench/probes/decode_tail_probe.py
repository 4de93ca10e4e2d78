"""Finding: batch 1 x 32k decode loses its last ~3 us to programs ending over a ~4 us window, not to launch
stagger; work stealing from an atomic counter is slower at every shape (KERNELS_NOTES stop 18).

Probe: where the split-K decode kernel loses time at batch 1 x long context, and whether work stealing wins it.

Two stages:
  tail   the decode kernel as the entry point builds it, each program stamping %globaltimer at its start and
         after its last store: per call, the start and end spread of the programs (launch stagger vs tail).
  steal  a prototype of the same kernel where the programs of a (sequence, kv head) take KV blocks one at a
         time from an atomic counter (kept in the block table's zero padding, so no extra memset) instead of a
         static run of pages: chain time per call against the static kernel, same inputs, same run.

  python bench/probes/decode_tail_probe.py --out OUT.json [--only tail,steal]

On CPU both run in interpret mode on small cases (the stamps are zeros there, the counter a plain
read-modify-write, since interpret mode runs the programs one after another).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from bench.kernels import chained, copy_bw, make_case, per_call, rel_err, runner  # noqa: E402
from kernels_pallas import _decode as D  # noqa: E402
from kernels_pallas import (
    _splitk,  # noqa: E402
    reference,  # noqa: E402
)
from kernels_pallas._common import mma, next_pow2, pad_block_tables, scalars, softmax_step, triton_params  # noqa: E402

INTERPRET = jax.default_backend() != "gpu"
STAMP = 16  # lanes per stamp (a Triton tensor, not a scalar); all equal


def _stamp(x, register="%globaltimer_lo"):
    """%globaltimer's low 32 bits (ns) (or another special register, e.g. %smid), read once x is available."""
    if INTERPRET:
        return jnp.zeros((STAMP,), jnp.int32) + x.astype(jnp.int32) * 0
    from jax.experimental.pallas import triton as plgpu

    [t] = plgpu.elementwise_inline_asm(
        f"mov.u32 $0, {register};",
        args=[jnp.broadcast_to(x.astype(jnp.int32), (STAMP,))],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((STAMP,), jnp.int32)],
    )
    return t


def _stamped_kernel(*refs, final, **kw):
    *inner, t0_ref, t1_ref, sm_ref = refs
    outs = inner[-1:] if final else inner[-3:]
    t0_ref[...] = _stamp(pl.program_id(1) + 7 * pl.program_id(0))  # split, kv head: the grid is (K, splits, B)
    D._decode_kernel(*inner, final=final, **kw)
    if not INTERPRET:
        from jax.experimental.pallas import triton as plgpu

        plgpu.debug_barrier()
    last = outs[0][0, 0] if final else outs[1][0]  # read back after this program's stores
    t1_ref[...] = _stamp(jax.lax.bitcast_convert_type(last.astype(jnp.float32), jnp.int32))
    sm_ref[...] = _stamp(pl.program_id(0), "%smid")


def _seqs_last(index_map):
    """index_map(b, h, s) for a grid (K, splits, B), the decode kernel's (_decode._decode)."""
    return lambda h, s, b: index_map(b, h, s)


def _specs(B, K, Gq, H, P, S, splits, bt_width, seqs_last=False):
    """The kernels' block specs, written for a grid (B, K, splits); seqs_last: for a grid (K, splits, B)."""
    spec = (lambda shape, f: pl.BlockSpec(shape, _seqs_last(f))) if seqs_last else pl.BlockSpec
    full = lambda shape: spec(shape, lambda b, h, s: (0,) * len(shape))  # noqa: E731
    pages = spec((None, P, S, H), lambda b, h, s: (h, 0, 0, 0))
    bt = spec((None, bt_width), lambda b, h, s: (b, 0))
    ins = [full((B,)), bt, full((2,)), spec((None, None, Gq, H), lambda b, h, s: (b, h, 0, 0)), pages, pages]
    SP = next_pow2(splits)
    shapes = [
        jax.ShapeDtypeStruct((B, K, SP, Gq, H), jnp.float32),
        jax.ShapeDtypeStruct((B, K, SP, Gq), jnp.float32),
        jax.ShapeDtypeStruct((B, K, SP, Gq), jnp.float32),
    ]
    outs = [
        spec((None, None, None, Gq, H), lambda b, h, s: (b, h, s, 0, 0)),
        spec((None, None, None, Gq), lambda b, h, s: (b, h, s, 0)),
        spec((None, None, None, Gq), lambda b, h, s: (b, h, s, 0)),
    ]
    return ins, shapes, outs, bt


@functools.partial(jax.jit, static_argnames=("num_splits",))
def stamped_decode(q, k, v, lens, block_tables, num_splits=None):
    """The entry point's decode kernel (default tiles, G a power of two) with per-program stamps: -> (start,
    end, SM id), each [B, K, splits]; times in ns (mod 2^32)."""
    B, N, H = q.shape
    K, P, S, _ = k.shape
    G = N // K
    R = max(1, 16 // G)
    ppb = max(1, _splitk.default_block_k(B, K) // S)
    splits, pps = _splitk.choose_splits(B, K, block_tables.shape[1], ppb, S, num_splits)
    final = splits == 1
    bt = pad_block_tables(block_tables, pps + ppb)
    ins, shapes, outs, _ = _specs(B, K, G, H, P, S, splits, bt.shape[1], seqs_last=True)
    if final:
        shapes = [jax.ShapeDtypeStruct((B, K, G, H), q.dtype)]
        outs = [pl.BlockSpec((None, None, G, H), _seqs_last(lambda b, h, s: (b, h, 0, 0)))]
    shapes += [jax.ShapeDtypeStruct((B, K, splits, STAMP), jnp.int32)] * 3
    outs += [pl.BlockSpec((None, None, None, STAMP), _seqs_last(lambda b, h, s: (b, h, s, 0)))] * 3
    kernel = functools.partial(
        _stamped_kernel,
        page_size=S,
        pages_per_block=ppb,
        sliding_window=None,
        has_alibi=False,
        final=final,
        prefetch=2,
        replicas=R,
        tail_mask=not INTERPRET,
    )
    res = pl.pallas_call(
        kernel,
        grid=(K, splits, B),
        in_specs=ins,
        out_specs=outs,
        out_shape=shapes,
        interpret=INTERPRET,
        compiler_params=triton_params(4, 1),
        name="paged_decode_stamped",
    )(lens.astype(jnp.int32), bt, scalars(H**-0.5, 1.0, 1.0), q.reshape(B, K, G, H), k, v)
    return tuple(x[..., 0] for x in res[-3:])


def spread(t0, t1, sm) -> dict:
    """Start / end percentiles over the programs, and how full the SMs were: the time-averaged number of
    resident programs per SM over the call's span, over the most any SM held at once."""
    t0 = np.asarray(t0, np.int64).ravel()
    t1 = np.asarray(t1, np.int64).ravel()
    sm = np.asarray(sm).ravel()
    base = t0.min()
    start = (t0 - base) % 2**32 / 1e3
    end = (t1 - base) % 2**32 / 1e3
    span = float(end.max())
    pct = lambda x: [round(float(np.percentile(x, p)), 2) for p in (0, 10, 50, 90, 100)]  # noqa: E731
    peak, resident = 0, 0.0
    for i in np.unique(sm):
        ev = sorted([(t, 1) for t in start[sm == i]] + [(t, -1) for t in end[sm == i]])
        n, last = 0, 0.0
        for t, d in ev:
            resident += n * (t - last)
            n, last = n + d, t
            peak = max(peak, n)
    n_sm = len(np.unique(sm))
    fill = resident / (span * n_sm * peak) if span > 0 and peak else 0.0
    return dict(
        programs=int(t0.size),
        sms=n_sm,
        peak_per_sm=peak,
        span_us=round(span, 2),
        start_us_p0_10_50_90_100=pct(start),
        end_us_p0_10_50_90_100=pct(end),
        mean_end_us=round(float(end.mean()), 2),
        mean_program_us=round(float((end - start).mean()), 2),
        sm_fill=round(float(fill), 3),
    )


# ----------------------------------------------------------------------------------------- work stealing


def _next_block(ref, col):
    """The counter's old value, incremented (atomically on the GPU)."""
    if INTERPRET:
        old = ref[col]
        ref[col] = old + 1
        return old
    from jax.experimental.pallas import triton as plgpu

    return plgpu.atomic_add(ref, (col,), jnp.int32(1))


def _steal_kernel(
    lens_ref,
    bt_ref,
    scal_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    bt_out,
    *,
    page_size,
    pages_per_block,
    replicas,
    counter_col,
    mask_all,
    lookahead,
):
    b, h = pl.program_id(0), pl.program_id(1)
    S, ppb = page_size, pages_per_block
    BK = S * ppb
    P = k_ref.shape[0]
    Gq, H = q_ref.shape
    R = replicas
    Gp = R * Gq
    seq_len = lens_ref[b]
    n_pages = pl.cdiv(seq_len, S)
    n_blocks = pl.cdiv(n_pages, ppb)
    qk_mult, v_scale = scal_ref[0], scal_ref[1]
    cdt = q_ref.dtype
    q = q_ref[...]
    q = jnp.broadcast_to(q[None], (R, Gq, H)).reshape(Gp, H) if R > 1 else q
    col = counter_col + h

    def ids(c):  # block c's page ids; -1 past the sequence (those loads are masked off)
        first = c * ppb
        live = (first + jnp.arange(ppb, dtype=jnp.int32) < n_pages) & (c < n_blocks)
        return jnp.where(live, jnp.clip(bt_ref[pl.ds(jnp.minimum(first, n_blocks * ppb), ppb)], 0, P - 1), -1)

    def fetch(pids):
        if INTERPRET:
            pids = jnp.maximum(pids, 0)
            return k_ref[pids].reshape(BK, H), v_ref[pids].reshape(BK, H)
        from jax.experimental.pallas import triton as plgpu

        live = jnp.broadcast_to((pids >= 0)[:, None, None], (ppb, S, H))
        pids = jnp.maximum(pids, 0)
        return (
            plgpu.load(k_ref.at[pids], mask=live).reshape(BK, H),
            plgpu.load(v_ref.at[pids], mask=live).reshape(BK, H),
        )

    def step(c, state, k, v):
        k, v = k.astype(cdt), v.astype(cdt)
        kv_pos = c * BK + jnp.arange(BK, dtype=jnp.int32)
        s = mma(q, k, trans_b=True) * qk_mult
        if mask_all:
            valid = kv_pos < seq_len
            s = jnp.where(valid[None, :], s, -jnp.inf)
            v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        return softmax_step(state, s, v, cdt)

    init = (jnp.full((Gp,), -jnp.inf, jnp.float32), jnp.zeros((Gp,), jnp.float32), jnp.zeros((Gp, H), jnp.float32))
    # in flight at the top of an iteration: block c0's KV, block c1's page ids, the next `lookahead` block numbers
    cs = [_next_block(bt_out, col) for _ in range(2 + lookahead)]

    def body(carry):
        state, c0, kv0, c1, ids1, *ahead = carry
        c_new = _next_block(bt_out, col)
        ids2 = ids(ahead[0])
        kv1 = fetch(ids1)
        state = step(c0, state, *kv0)
        return (state, c1, kv1, ahead[0], ids2, *ahead[1:], c_new)

    carry = (init, cs[0], fetch(ids(cs[0])), cs[1], ids(cs[1]), *cs[2:])
    m, l, acc = jax.lax.while_loop(lambda c: c[1] < n_blocks, body, carry)[0]
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    if R > 1:
        out, m, l = out.reshape(R, Gq, H).max(0), m.reshape(R, Gq).max(0), l.reshape(R, Gq).max(0)
    o_ref[...] = out * v_scale
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("scale", "splits", "block_k", "mask_all", "lookahead"))
def steal_decode(q, k, v, lens, block_tables, *, scale, splits, block_k=32, mask_all=True, lookahead=1):
    """Decode with `splits` programs per (sequence, kv head) taking blocks from a shared counter, then the
    entry point's combine. G a power of two, no window / ALiBi / fp8 (a prototype). mask_all=False skips the
    length mask: right only when every block is full (it times what the mask costs)."""
    B, N, H = q.shape
    K, P, S, _ = k.shape
    G = N // K
    M = block_tables.shape[1]
    ppb = max(1, block_k // S)
    width = M + ppb  # ids() may read one block past the sequence's last
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, width - M + K)))  # then K zeroed counters
    ins, shapes, outs, bt_spec = _specs(B, K, G, H, P, S, splits, bt.shape[1])
    shapes.append(jax.ShapeDtypeStruct(bt.shape, jnp.int32))
    outs.append(bt_spec)
    kernel = functools.partial(
        _steal_kernel,
        page_size=S,
        pages_per_block=ppb,
        replicas=max(1, 16 // G),
        counter_col=width,
        mask_all=mask_all,
        lookahead=lookahead,
    )
    o, m, l, _ = pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=ins,
        out_specs=outs,
        out_shape=shapes,
        input_output_aliases={1: 3},
        interpret=INTERPRET,
        compiler_params=triton_params(4, 1),
        name=f"paged_decode_steal_{splits=}",
    )(lens.astype(jnp.int32), bt, scalars(scale, 1.0, 1.0), q.reshape(B, K, G, H), k, v)
    return _splitk.combine_splits(o, m, l, splits, q.dtype, interpret=INTERPRET)[:, :, :G].reshape(B, N, H)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="tail,steal")
    a = ap.parse_args()
    only = set(a.only.split(","))
    info = dict(
        device=str(jax.devices()[0].device_kind),
        platform=platform.platform(),
        jax=jax.__version__,
        git_commit=os.environ.get("GIT_COMMIT", "unknown"),
        command=" ".join(sys.argv),
    )
    results = []
    if "tail" in only:
        # (B, ctx, splits, live): the last is the throughput run's decode batch (500 live of 512, 580-600 tokens)
        cases = [
            (1, 32768, None, None),
            (1, 32768, 47, None),
            (1, 32768, 98, None),
            (1, 32768, 147, None),
            (16, 16384, None, None),
            (64, 2048, None, None),
            (512, 600, None, 500),
        ]
        for B, ctx, splits, live in cases if not INTERPRET else [(1, 1024, None, None), (8, 100, None, 6)]:
            q, k, v, lens, _, bt = make_case(B, ctx, max_len=1024 if live else None)
            if live is not None:
                rng = np.random.default_rng(4)
                lens = np.zeros(B, np.int32)
                lens[:live] = ctx - rng.integers(0, 21, live)
                lens = jnp.asarray(lens)
            runs = []
            for i in range(11):
                stamps = jax.block_until_ready(stamped_decode(q, k, v, lens, bt, num_splits=splits))
                if i >= 6:  # the first calls warm up
                    runs.append(spread(*stamps))
            results.append(dict(stage="tail", B=B, ctx=ctx, live=live, num_splits=splits, runs=runs))
            print(json.dumps(results[-1])[:600], flush=True)
    if "steal" in only:
        info["copy_bytes_per_s"] = copy = copy_bw() if not INTERPRET else None
        cases = [(1, 32768, 49), (4, 8192, 12), (2, 131072, 24), (1, 4000, 49)]
        cfgs = [dict(lookahead=1), dict(lookahead=2), dict(lookahead=1, mask_all=False)]
        for B, ctx, splits in cases if not INTERPRET else [(1, 1000, 5), (2, 333, 3)]:
            q, k, v, lens, _, bt = make_case(B, ctx)
            scale = q.shape[-1] ** -0.5
            ref = (
                reference.paged_decode_attention_ref(q, k, v, lens, bt, scale=scale, pages_per_step=64)
                if ctx <= 32768
                else None
            )
            nbytes = B * ctx * k.shape[0] * k.shape[-1] * 2 * k.dtype.itemsize + 2 * q.size * q.dtype.itemsize
            static = (
                "static (entry point defaults)",
                lambda q, k, v, lens, bt, scale=scale: D.paged_decode_attention_kernel(
                    q, k, v, lens, bt, scale=scale, interpret=INTERPRET
                ),
            )
            variants = (
                [static]
                + [
                    (
                        f"steal {cfg}",
                        lambda q, k, v, lens, bt, cfg=cfg, scale=scale, splits=splits: steal_decode(
                            q, k, v, lens, bt, scale=scale, splits=splits, **cfg
                        ),
                    )
                    for cfg in cfgs
                ]
                + [static]
            )
            for name, fn in variants:
                row = dict(stage="steal", B=B, ctx=ctx, splits=splits, impl=name)
                out = jax.block_until_ready(fn(q, k, v, lens, bt))
                row["rel_err"] = rel_err(out, ref) if ref is not None else None
                if not INTERPRET:
                    t, tmin, tmax, wall = per_call(runner(chained(fn), q, k, v, lens, bt))
                    row.update(
                        time_us=t * 1e6, time_min_us=tmin * 1e6, time_max_us=tmax * 1e6, frac_copy=nbytes / t / copy
                    )
                results.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(info=info, results=results), f, indent=1)


if __name__ == "__main__":
    main()
