"""Reads an XProf trace (*.xplane.pb from jax.profiler.trace) and sums up what a miss needs explained:
GPU busy time vs the traced wall time (host gaps), the kernels that take the time, the XLA module runs
(one per engine step), any compilation inside the trace (recompiles) and the host threads' events by name (count
and total time: where a host-bound step's time goes, e.g. the executable call's argument handling, command-buffer
update and graph launch). With sequence=N, also N consecutive kernels
from the middle of the trace in launch order (name, microseconds, the HLO op XProf names): which kernels one
layer runs, for telling apart kernels of the same name; and "layer": the sequence's repeating unit (one decoder
layer of a decode step) with each position's median time and the unit's median total.

  python bench/profile_summary.py TRACE_DIR_OR_FILE   -> prints the JSON summary
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys


def find_xplane(path: str) -> str | None:
    if os.path.isfile(path):
        return path
    hits = sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    return hits[-1] if hits else None


def _union(intervals):
    total, end = 0.0, None
    gaps = []
    for s, e in sorted(intervals):
        if end is None:
            total, end = e - s, e
            continue
        if s > end:
            gaps.append(s - end)
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total, gaps


def kernel_category(name: str) -> str:
    """The part of a step a GPU kernel belongs to, from its name (our Pallas kernels are named after their
    function; XLA's GEMMs are cuBLAS nvjet / cutlass kernels or Triton gemm fusions)."""
    n = name.lower()
    if "paged_decode" in n:
        return "decode_attention"
    if "qmatmul" in n or "gemv" in n:  # the quantized GEMMs' Pallas kernels (Triton, Mosaic GPU: qmatmul_nk*)
        return "gemm"
    if "ragged" in n or "prefill" in n or "mosaic" in n:  # entry_mosaic_gpu_kernel: any Mosaic GPU kernel until stop 58
        return "prefill_attention"
    if "qkv_write" in n or "write_kv" in n:
        return "kv_write"
    if any(k in n for k in ("nvjet", "gemm", "cutlass", "xmma", "sm90_")):
        return "gemm"
    if "memcpy" in n or "memset" in n:
        return "memcpy"
    return "other"


_GAP_SIZES = (("under_2us", 0, 2e3), ("2_10us", 2e3, 1e4), ("10_100us", 1e4, 1e5), ("over_100us", 1e5, float("inf")))


def repeating_unit(names: list[str]) -> tuple[int, int] | None:
    """(p, start): the shortest period p whose longest streak of names[i] == names[i + p] spans at least three units,
    and where that streak starts: the kernels of one decoder layer in a decode step's launch sequence (a step's own
    first and last kernels, or another step's, end the streak)."""
    n = len(names)
    for p in range(2, n // 3 + 1):
        best, start, run = 0, 0, 0
        for i in range(n - p):
            run = run + 1 if names[i] == names[i + p] else 0
            if run > best:
                best, start = run, i - run + 1
        if best >= 2 * p:
            return p, start
    return None


def layer_summary(seq: list) -> dict | None:
    """One repeating unit of a sequence of [name, us, op] (repeating_unit): its kernels in launch order, each
    position's median us over the whole units of the streak, and their median total."""
    found = repeating_unit([k[0] for k in seq])
    if found is None:
        return None
    p, start = found
    names = [k[0] for k in seq[start : start + p]]
    units = []
    for i in range(start, len(seq) - p + 1, p):
        if [k[0] for k in seq[i : i + p]] != names:
            break
        units.append(seq[i : i + p])
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {
        "kernels": p,
        "us": med([sum(k[1] for k in u) for u in units]),
        "units": len(units),
        "sequence": [[units[0][j][0], med([u[j][1] for u in units])] for j in range(p)],
    }


_HOST_EVENT_MAX_NS = 1_000_000_000  # host events longer than this (compiles, the trace's own span) are left out


def summarize(path: str, top: int = 40, sequence: int = 0) -> dict:
    from jax.profiler import ProfileData

    f = find_xplane(path)
    if f is None:
        return {"error": f"no .xplane.pb under {path}"}
    pd = ProfileData.from_file(f)
    out: dict = {"file": f, "devices": []}
    compiles = collections.Counter()
    compile_ns = collections.Counter()
    host_runs, host_ns = collections.Counter(), collections.Counter()  # (thread, event name) off the compiles
    for plane in pd.planes:
        if plane.name.startswith("/device:"):
            dev = {"plane": plane.name}
            kernels, kernel_time, kernel_runs = [], collections.Counter(), collections.Counter()
            events = []  # (start, name, duration, hlo op) of every kernel, for the sequence
            modules = collections.Counter()
            module_time = collections.Counter()
            for line in plane.lines:
                evs = list(line.events)
                if line.name == "XLA Modules":
                    for e in evs:
                        modules[e.name] += 1
                        module_time[e.name] += e.duration_ns
                elif line.name.startswith("Stream") or "stream" in line.name.lower():
                    for e in evs:
                        kernels.append((e.start_ns, e.start_ns + e.duration_ns))
                        if sequence:
                            events.append((e.start_ns, e.name, e.duration_ns, _stat(e, "hlo_op")))
                        kernel_time[e.name] += e.duration_ns
                        kernel_runs[e.name] += 1
            if kernels:
                busy, gaps = _union(kernels)
                span = max(e for _, e in kernels) - min(s for s, _ in kernels)
                big = [g for g in gaps if g > 50_000]
                dev.update(
                    span_ms=span / 1e6,
                    busy_ms=busy / 1e6,
                    busy_fraction=busy / span if span else None,
                    idle_ms=(span - busy) / 1e6,
                    gaps_over_50us=len(big),
                    gaps_over_50us_ms=sum(big) / 1e6,
                    largest_gaps_ms=[g / 1e6 for g in sorted(gaps, reverse=True)[:8]],
                    gaps_ms_by_size={k: sum(g for g in gaps if lo <= g < hi) / 1e6 for k, lo, hi in _GAP_SIZES},
                    by_category_ms=_by_category(kernel_time),
                    top_kernels=[
                        {
                            "name": k[:120],
                            "ms": v / 1e6,
                            "share": v / max(busy, 1),
                            "runs": kernel_runs[k],
                            "us_per_run": v / 1e3 / kernel_runs[k],
                        }
                        for k, v in kernel_time.most_common(top)
                    ],
                )
            if sequence and events:
                events.sort()
                mid = max(0, len(events) // 2 - sequence // 2)
                dev["sequence"] = [[n[:80], d / 1e3, op] for _, n, d, op in events[mid : mid + sequence]]
                dev["layer"] = layer_summary(dev["sequence"])
            if modules:
                dev["xla_modules"] = [
                    {"name": k[:120], "runs": modules[k], "ms": module_time[k] / 1e6}
                    for k, _ in module_time.most_common(top)
                ]
            out["devices"].append(dev)
        else:
            for line in plane.lines:
                for e in line.events:
                    n = e.name.lower()
                    if "compile" in n and "cache" not in n:
                        compiles[e.name] += 1
                        compile_ns[e.name] += e.duration_ns
                    elif e.duration_ns < _HOST_EVENT_MAX_NS:
                        key = (line.name[:60], e.name.split("#")[0][:120])
                        host_runs[key] += 1
                        host_ns[key] += e.duration_ns
    out["host_compile_events"] = [
        {"name": k[:120], "count": c, "ms": compile_ns[k] / 1e6} for k, c in compiles.most_common(top)
    ]
    out["host_events"] = [
        {"thread": t, "name": n, "count": host_runs[t, n], "ms": ns / 1e6, "us_per_call": ns / 1e3 / host_runs[t, n]}
        for (t, n), ns in host_ns.most_common(2 * top)
    ]
    return out


def _stat(event, name: str):
    """An event's stat `name` (XProf's GPU kernels carry hlo_op, hlo_module, ...), or None."""
    for k, v in event.stats:
        if k == name:
            return v if isinstance(v, (int, float, str)) else str(v)
    return None


def _by_category(kernel_time) -> dict:
    cats = collections.Counter()
    for name, ns in kernel_time.items():
        cats[kernel_category(name)] += ns
    return {k: v / 1e6 for k, v in cats.most_common()}


if __name__ == "__main__":
    print(json.dumps(summarize(sys.argv[1]), indent=1))
