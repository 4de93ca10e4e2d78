"""PNG plots of the JSON in bench/results/ (any missing input skips its plot and says so).

  python bench/plot_results.py [--results-dir bench/results] [--out-dir DIR] [--kernels FILE] [--suite FILE]

  kernels_decode.png   our paged decode kernel (default config) vs JAX's shipped one, per shape: time and
                       fraction of the copy bandwidth measured in the same run
  engine_vs_goals.png  each issue-7 figure as a fraction of its goal (goal/value where lower is better), with
                       HF transformers (measured) and vLLM (README's reference figures) beside it
  parallel.png         tp/pp output tok/s (2x H200) and pipeline step time vs the GPipe ideal
  serve.png            TTFT / TPOT / ITL / E2E percentiles of the suite's serve stage (when one ran)

Inputs, newest first where there are several: the suite's combined JSON (a file with "summary" and "stages",
as bench/suite.py writes to suite.json), else h100_summary.json; kernels_*.json runs with every goal row
(the newest by the date of the commit they record); parallel_throughput_*.json; pipeline_overlap_*.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DPI = 90
# vLLM's figures for the same workloads, as the README quotes them (not measured by these scripts).
VLLM_REF = dict(batch1_tok_s=155.0, req_s=31.0)
GOALS = dict(
    batch1_tok_s=180,
    req_s=38,
    hf_throughput_ratio=10,
    hf_batch1_ratio=15,
    ready_cold_s=60,
    ready_warm_s=15,
    host_ms=1.0,
    decode_frac_copy=0.85,
    prefill_frac_matmul=0.5,
)


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError, TypeError):
        return None


def commit_time(sha) -> int:
    try:
        out = subprocess.run(
            ["git", "show", "-s", "--format=%ct", str(sha)], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return int(out.stdout.strip()) if out.returncode == 0 else 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def pick_kernels(results_dir, explicit=None):
    if explicit:
        return explicit, load(explicit)
    files = [f for f in glob.glob(os.path.join(results_dir, "kernels_*.json")) if "BADCOPY" not in f]
    runs = [(f, load(f)) for f in sorted(files)]
    # full runs only: every goal row present (tune/trace-only files and sweeps are partial views)
    goals = {"goal_b64_ctx2k", "goal_b1_ctx32k", "goal_chunk4k"}
    runs = [
        (f, d)
        for f, d in runs
        if isinstance(d, dict)
        and "info" in d
        and "--sweep" not in d["info"].get("command", "")
        and goals <= {r.get("label") for r in d.get("results", [])}
    ]
    if not runs:
        return None, None
    return max(runs, key=lambda fd: commit_time(fd[1]["info"].get("git_commit")))


def newest_host_overhead(results_dir):
    """(schedule + prepare p50 in ms, 'file, 2-core VM') of the newest bench/host_overhead.py run on the dev VM
    (files host_overhead_cpu_vm_*.json; an A/B file gives its 'after' median), or None."""
    runs = []
    for f in glob.glob(os.path.join(results_dir, "host_overhead_cpu_vm_*.json")):
        d = load(f) or {}
        ms = (d.get("median_of_run_p50s_ms") or {}).get("after", {}).get("schedule_plus_prepare_ms")
        if ms is None:
            ms = (d.get("schedule_plus_prepare_ms") or {}).get("p50")
        if ms is not None:
            runs.append(((d.get("env") or {}).get("time", ""), ms, os.path.basename(f)))
    if not runs:
        return None
    _, ms, name = max(runs)
    return ms, f"{name}, 2-core VM"


def pick_suite(results_dir, explicit=None):
    """(file, summary dict, stage dict) of the newest suite run, else h100_summary.json turned into the same
    keys; (None, None, None) when neither is there."""
    if explicit:
        d = load(explicit)
        return explicit, d["summary"], d.get("stages", {})
    suites = []
    for f in glob.glob(os.path.join(results_dir, "*.json")):
        d = load(f)
        if isinstance(d, dict) and "summary" in d and "stages" in d:
            suites.append((d["summary"].get("time", ""), f, d))
    f = os.path.join(results_dir, "h100_summary.json")
    h = load(f)
    if suites:
        _, sf, d = max(suites)
        s = dict(d["summary"])
        host = (h or {}).get("host_overhead_ms") or {}
        vm = newest_host_overhead(results_dir)
        if s.get("host_ms") is None and vm:
            s["host_ms"], s["host_ms_file"] = vm
        elif s.get("host_ms") is None and host.get("schedule_plus_prepare_p50") is not None:
            s["host_ms"], s["host_ms_file"] = host["schedule_plus_prepare_p50"], os.path.basename(f)
        return sf, s, d["stages"]
    if not h:
        return None, None, None
    v = lambda k, sub="value": (h.get(k) or {}).get(sub) if isinstance(h.get(k), dict) else h.get(k)  # noqa: E731
    s = dict(
        batch1_tok_s=v("batch1_decode_tok_s"),
        req_s=v("throughput_req_s"),
        hf_batch1_tok_s=h.get("hf_batch1_tok_s"),
        hf_req_s=h.get("hf_req_s"),
        hf_throughput_ratio=v("throughput_vs_hf"),
        hf_batch1_ratio=v("batch1_vs_hf"),
        ready_cold_s=v("ready_cold_s", "since_script_start"),
        ready_warm_s=v("ready_warm_s", "since_script_start"),
        host_ms=v("host_overhead_ms", "schedule_plus_prepare_p50"),
        note=h.get("note"),
        hf_note="HF baseline from an earlier device call of the same session, not the same run",
    )
    return f, s, {}


def note(ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="gray")


def shape_label(r) -> str:
    """'B64 x 2k' plus what differs from the goal shape (32 q / 8 kv heads, D128, page 16, bf16 KV), one per line."""
    ctx = f"{r['ctx'] // 1024}k" if r["ctx"] >= 1024 else str(r["ctx"])
    lines = [
        f"B{r['B']} x {ctx}",
        "(goal)" if r["label"].startswith("goal") else "",
        f"page {r['S']}" if r.get("S") != 16 else "",
        "fp8 KV" if "float8" in r.get("kv_dtype", "") else "",
        f"{r['N']}q/{r['K']}kv\nD{r['H']}" if (r.get("K"), r.get("H")) != (8, 128) else "",
    ]
    return "\n".join(x for x in lines if x)


def plot_kernels(kfile, k, out):
    rows = [r for r in k["results"] if r.get("kind") == "decode"]
    # uniform shapes only (the engine-shaped batch of live and padding sequences has its own row format)
    ours = {
        r["label"]: r
        for r in rows
        if r["impl"] == "pallas_triton" and not r.get("cfg") and not r["label"].startswith("engine_like")
    }
    ship = {}
    for r in rows:  # the shipped kernel's best config per shape, if it was swept
        if r["impl"] == "jax_shipped_paged_attention" and (
            r["label"] not in ship or r["time_us"] < ship[r["label"]]["time_us"]
        ):
            ship[r["label"]] = r
    labels = list(ours)
    if not labels:
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4), dpi=DPI)
    x = range(len(labels))
    w = 0.38
    for ax, key, scale, ylabel in (
        (a1, "time_us", 1, "time (us, lower is better)"),
        (a2, "frac_copy", 100, "% of copy bandwidth (higher is better)"),
    ):
        yo = [ours[lb].get(key, 0) * scale for lb in labels]
        ys = [ship[lb].get(key, 0) * scale if lb in ship else 0 for lb in labels]
        b1 = ax.bar([i - w / 2 for i in x], yo, w, label="jaxllm Pallas (default config)", color="#1f77b4")
        b2 = ax.bar([i + w / 2 for i in x], ys, w, label="JAX shipped paged_attention", color="#999999")
        ax.bar_label(b1, fmt="%.0f", fontsize=7)
        ax.bar_label(b2, labels=[f"{v:.0f}" if v else "n/a" for v in ys], fontsize=7)
        ax.set_xticks(list(x), [shape_label(ours[lb]) for lb in labels], fontsize=7)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    a2.axhline(85, color="green", ls="--", lw=1)
    a2.text(len(labels) - 0.5, 86, "goal 85%", color="green", fontsize=7, ha="right")
    a1.legend(fontsize=7)
    info = k.get("info", {})
    fig.suptitle(
        f"Paged decode attention, {info.get('device')}, jax {info.get('jax')}, commit "
        f"{info.get('git_commit')} ({os.path.basename(kfile)})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


# The Mosaic GPU prefill kernel's defaults (kernels_pallas/_prefill_mgpu.ragged_prefill_mgpu; a test checks): the
# configuration the entry point runs on Hopper.
MGPU_PREFILL_DEFAULTS = {"block_kv": 128, "steps_in_flight": 2}


def pick_mgpu_prefill(results_dir):
    """(file, (row, the Triton kernel's row of the same run or None)) of the newest run with the Mosaic GPU
    prefill kernel's goal-shape row at its defaults (the kernel the engine uses on H100 since stop 14; full
    kernel runs before it measured only the Triton one)."""
    best = None
    for f in sorted(glob.glob(os.path.join(results_dir, "kernels_*.json"))):
        d = load(f)
        if not isinstance(d, dict) or "info" not in d:
            continue
        row = next(
            (
                r
                for r in d.get("results", [])
                if r.get("kind") == "prefill"
                and r.get("label") == "goal_chunk4k"
                and r.get("impl") == "mosaic_gpu"
                and r.get("cfg") == MGPU_PREFILL_DEFAULTS
                and r.get("frac_matmul")
            ),
            None,
        )
        if row is not None:
            triton = next(
                (
                    r
                    for r in d["results"]
                    if r.get("kind") == "prefill"
                    and r.get("label") == "goal_chunk4k"
                    and r.get("impl") == "pallas_triton"
                    and not r.get("cfg")
                    and r.get("frac_matmul")
                ),
                None,
            )
            t = commit_time(d["info"].get("git_commit"))
            if best is None or t > best[0]:
                best = (t, f, (row, triton))
    return (best[1], best[2]) if best else (None, None)


def kernel_figures(k, mgpu_prefill=None) -> dict:
    if not k:
        return {}
    res = k["results"]
    ours = lambda kind, lb: next(
        (
            r
            for r in res
            if r.get("kind") == kind
            and r.get("label") == lb  # noqa: E731
            and r["impl"] == "pallas_triton"
            and not r.get("cfg")
        ),
        None,
    )
    ship = lambda lb: min(
        (r for r in res if r.get("label") == lb and r["impl"] == "jax_shipped_paged_attention"),  # noqa: E731
        key=lambda r: r["time_us"],
        default=None,
    )
    out = {}
    for lb, name in (
        ("goal_b64_ctx2k", "decode B64 x 2k, % copy bw"),
        ("goal_b1_ctx32k", "decode B1 x 32k, % copy bw"),
    ):
        r, s = ours("decode", lb), ship(lb)
        if r:
            out[name] = (
                r["frac_copy"] * 100,
                GOALS["decode_frac_copy"] * 100,
                "%",
                {"JAX shipped kernel": s["frac_copy"] * 100} if s and "frac_copy" in s else {},
            )
    r, tri = mgpu_prefill or (ours("prefill", "goal_chunk4k"), None)
    if r:
        refs = {"our Triton kernel (same run)": tri["frac_matmul"] * 100} if tri else {}
        out["prefill 4k chunk, % matmul"] = (r["frac_matmul"] * 100, GOALS["prefill_frac_matmul"] * 100, "%", refs)
    return out


def plot_goals(sfile, s, k, kfile, out, mgpu=(None, None)):
    """One row per figure: value / goal (goal / value for times), so 1.0 is the goal for every row."""
    rows = []  # (name, value, goal, unit, lower_is_better, {reference name: value})
    if s:
        is_8b = s.get("shape", "llama3-8b") == "llama3-8b"  # vLLM's figures are for that shape only
        refs = lambda hf, vllm: {
            n: v
            for n, v in (
                ("HF transformers", hf),  # noqa: E731
                ("vLLM (README ref.)", vllm if is_8b else None),
            )
            if v
        }
        for key, name, unit, low, rf in (
            (
                "batch1_tok_s",
                "batch-1 decode",
                " tok/s",
                False,
                refs(s.get("hf_batch1_tok_s"), VLLM_REF["batch1_tok_s"]),
            ),
            (
                "req_s",
                f"throughput {s.get('throughput_workload', '500 x 462 / 256')}",
                " req/s",
                False,
                refs(s.get("hf_req_s"), VLLM_REF["req_s"]),
            ),
            ("hf_throughput_ratio", "throughput vs HF", "x", False, {}),
            ("hf_batch1_ratio", "batch-1 vs HF", "x", False, {}),
            ("ready_cold_s", "time to ready, cold", " s", True, {}),
            ("ready_warm_s", "time to ready, warm cache", " s", True, {}),
            (
                "host_ms",
                "host path / step @256 seqs" + (f"\n({s['host_ms_file']})" if s.get("host_ms_file") else ""),
                " ms",
                True,
                {},
            ),
        ):
            if s.get(key) is not None:
                rows.append((name, s[key], GOALS[key], unit, low, rf))
    for name, (v, g, unit, rf) in kernel_figures(k, mgpu[1]).items():
        rows.append((name, v, g, unit, False, rf))
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.6), dpi=DPI)
    colors = {
        "HF transformers": "#bbbbbb",
        "vLLM (README ref.)": "#ff7f0e",
        "JAX shipped kernel": "#9467bd",
        "our Triton kernel (same run)": "#8c564b",
    }
    seen = set()
    for i, (_name, v, g, unit, low, rf) in enumerate(rows):
        y = len(rows) - 1 - i
        frac = g / v if low else v / g
        yj = y + (0.18 if rf else 0)
        ax.barh(
            yj,
            frac,
            0.32,
            color="#2ca02c" if frac >= 1 else "#1f77b4",
            label=None if "jaxllm" in seen else "jaxllm (green: goal met)",
        )
        seen.add("jaxllm")
        ax.text(frac + 0.01, yj, f"{v:,.3g}{unit} (goal {'<=' if low else '>='} {g:g}{unit})", va="center", fontsize=7)
        h = 0.36 / max(len(rf), 1)
        for j, (rn, rv) in enumerate(rf.items()):
            rfrac = g / rv if low else rv / g
            yr = y - 0.02 - h * (j + 0.5)
            ax.barh(yr, rfrac, h * 0.9, color=colors.get(rn, "#999999"), label=None if rn in seen else rn)
            seen.add(rn)
            ax.text(rfrac + 0.01, yr, f"{rn}: {rv:,.3g}{unit}", va="center", fontsize=6, color="#444444")
    ax.axvline(1.0, color="green", ls="--", lw=1)
    ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=8)
    ax.set_xlabel("fraction of the goal (value / goal; goal / value for times) - 1.0 = goal met", fontsize=8)
    ax.set_xlim(0, max(1.45, max((r[2] / r[1] if r[4] else r[1] / r[2]) for r in rows) + 0.45))
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="lower right")
    src = [os.path.basename(f) for f in (sfile, kfile, mgpu[0]) if f]
    where = f"{s.get('device') or 'H100'}, commit {s.get('commit') or 'see files'}" if s else ""
    hf = (
        "HF and jaxllm from the same suite run"
        if "same suite run" in (s or {}).get("hf_note", "")
        else (s or {}).get("hf_note") or ""
    )
    ax.set_title(f"Issue-7 figures vs goals ({where}; {', '.join(src)})" + (f"\n{hf}" if hf else ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def plot_parallel(results_dir, out):
    pt = sorted(glob.glob(os.path.join(results_dir, "parallel_throughput_*.json")))
    po = sorted(glob.glob(os.path.join(results_dir, "pipeline_overlap_*.json")))
    pt, po = (load(pt[-1]) if pt else None), (load(po[-1]) if po else None)
    if not pt and not po:
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=DPI)
    if pt:
        names, vals = [], []
        for lay, v in pt["layouts"].items():
            if v.get("throughput"):
                names.append(lay.replace("_", " "))
                vals.append(v["throughput"]["output_tok_s"])
        b = a1.bar(names, vals, color=["#1f77b4", "#2ca02c", "#ff7f0e"][: len(vals)])
        a1.bar_label(b, fmt="%.0f", fontsize=8)
        w = pt["workload"]
        a1.set_title(
            f"output tok/s, {w.get('num_prompts')} prompts x {w.get('input_len')} in / "
            f"{w.get('output_len')} out\n{pt['env'].get('num_devices')}x {pt['env'].get('device')}, "
            f"commit {str(pt['env'].get('commit'))[:8]}",
            fontsize=8,
        )
        a1.tick_params(labelsize=8)
    else:
        note(a1, "no parallel_throughput_*.json")
    if po:
        m = sorted(po["ratio_to_1"], key=int)
        x = range(len(m))
        a2.bar([i - 0.2 for i in x], [po["ratio_to_1"][k] for k in m], 0.4, label="measured", color="#1f77b4")
        a2.bar(
            [i + 0.2 for i in x],
            [po["ideal_ratio_with_overlap"][k] for k in m],
            0.4,
            label="GPipe ideal",
            color="#bbbbbb",
        )
        a2.set_xticks(list(x), [f"{k} micro-batch{'es' if k != '1' else ''}" for k in m], fontsize=8)
        a2.set_ylabel("step time / 1 micro-batch", fontsize=8)
        a2.legend(fontsize=7)
        a2.set_title(
            f"pp={po['workload'].get('pp')} step of {po['workload'].get('tokens')} tokens, {po['env'].get('device')}",
            fontsize=8,
        )
        a2.tick_params(labelsize=8)
    else:
        note(a2, "no pipeline_overlap_*.json")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def plot_serve(sfile, stages, out):
    sv = (stages or {}).get("serve")
    if not sv:
        return False
    keys = [k for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") if sv.get(k) and sv[k].get("p50") is not None]
    fig, axes = plt.subplots(1, len(keys), figsize=(2.6 * len(keys), 3.4), dpi=DPI)
    axes = axes if len(keys) > 1 else [axes]
    for ax, k in zip(axes, keys):
        vals = [sv[k][q] for q in ("p50", "p90", "p99")]
        b = ax.bar(["p50", "p90", "p99"], vals, color=["#1f77b4", "#6baed6", "#c6dbef"])
        ax.bar_label(b, fmt="%.1f", fontsize=7)
        ax.set_title(k.replace("_ms", "").upper() + " (ms)", fontsize=9)
        ax.tick_params(labelsize=7)
    w = sv.get("workload", {})
    start = (sv.get("server") or {}).get("startup_s")
    fig.suptitle(
        f"serve: {w.get('num_prompts')} x {w.get('input_len')}/{w.get('output_len')}, concurrency "
        f"{w.get('max_concurrency')}: {sv['output_tokens_per_s']:,.0f} output tok/s, "
        f"{sv['requests_per_s']:.2f} req/s"
        + (f", server up in {start:.0f} s" if start else "")
        + f" ({os.path.basename(sfile)})",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--out-dir", default=None, help="default: --results-dir")
    p.add_argument("--kernels", default=None, help="kernels JSON to plot (default: the newest *_default.json)")
    p.add_argument("--suite", default=None, help="suite JSON (default: the newest, else h100_summary.json)")
    a = p.parse_args(argv)
    out = a.out_dir or a.results_dir
    os.makedirs(out, exist_ok=True)
    kfile, k = pick_kernels(a.results_dir, a.kernels)
    sfile, s, stages = pick_suite(a.results_dir, a.suite)
    jobs = (
        ("kernels_decode.png", lambda f: k is not None and plot_kernels(kfile, k, f), "no kernels_*_default.json"),
        (
            "engine_vs_goals.png",
            lambda f: plot_goals(sfile, s, k, kfile, f, pick_mgpu_prefill(a.results_dir)),
            "no suite, summary or kernels JSON",
        ),
        ("parallel.png", lambda f: plot_parallel(a.results_dir, f), "no parallel/pipeline JSON"),
        ("serve.png", lambda f: plot_serve(sfile, stages, f), "no suite JSON with a serve stage"),
    )
    for name, fn, why in jobs:
        path = os.path.join(out, name)
        if fn(path):
            print(f"wrote {path} ({os.path.getsize(path) // 1024} KB)")
        else:
            print(f"skipped {name}: {why}")


if __name__ == "__main__":
    main()
