"""CPU checks of the issue-37 benchmark scripts: the HF peers (bench/hf_baseline.py), the long-context stages
(bench/long_context.py), the suite's summary against the strongest peer, and the schedule replay behind
bench/padding_waste.py (its buckets and steps must be the engine's)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402

HF_TINY = [
    "--shape",
    "tiny",
    "--dtype",
    "float32",
    "--batch1-input-len",
    "12",
    "--batch1-output-len",
    "5",
    "--warmup",
    "1",
    "--runs",
    "1",
    "--input-len",
    "16",
    "--output-len",
    "4",
    "--batch-size",
    "3",
    "--num-prompts",
    "4",
    "--cb-num-prompts",
    "5",
    "--cb-warmup-prompts",
    "2",
    "--cb-max-batch-tokens",
    "128",
    "--cb-num-blocks",
    "64",
    "--cb-page-size",
    "16",
    "--no-compile",
]


@pytest.mark.filterwarnings("ignore")
def test_hf_baseline_rows_degrade_and_the_strongest_is_taken(tmp_path, monkeypatch):
    """Every mode gives a row; a mode that fails records its error without stopping the others, and the
    strongest rows are picked among those that ran."""
    from bench import hf_baseline

    def broken(*a, **k):
        raise RuntimeError("no such mode on this transformers")

    monkeypatch.setattr(hf_baseline, "batched_row", broken)  # eager_batched fails, cb and static still run
    out = tmp_path / "hf.json"
    res = hf_baseline.main([*HF_TINY, "--modes", "static,eager,eager_batched,cb", "--out", str(out)])
    rows = res["rows"]
    assert list(rows) == ["static", "eager", "eager_batched", "cb"]
    assert rows["eager_batched"]["error"].startswith("RuntimeError: no such mode")
    for m in ("static", "eager"):
        r = rows[m]
        assert r["kind"] == "batch1" and len(r["e2e_s"]) == 1 and 0 < r["ttft_s"] < r["e2e_s"][0]
        assert r["decode_tok_per_s"] == pytest.approx(4 / (r["e2e_s"][0] - r["ttft_s"]))
    assert rows["static"]["cache_implementation"] == "static" and rows["static"]["compiled"] is False
    cb = rows["cb"]
    assert cb["completed"] == 5 and cb["failed"] == 0 and cb["short_outputs"] == 0 and cb["requests_per_s"] > 0
    assert cb["cb_config"]["num_blocks"] == 64 and cb["attn_implementation"]
    best = res["strongest"]
    assert best["throughput"]["mode"] == "cb"  # the only throughput row without an error
    assert best["batch1"]["decode_tok_per_s"] == max(rows[m]["decode_tok_per_s"] for m in ("static", "eager"))
    assert json.loads(out.read_text())["strongest"] == best


def test_hf_baseline_budget_skips_modes(tmp_path):
    from bench import hf_baseline

    res = hf_baseline.main([*HF_TINY, "--modes", "eager,cb", "--budget", "0", "--out", str(tmp_path / "h.json")])
    assert res["rows"] == {} and set(res["skipped"]) == {"eager", "cb"}
    assert res["strongest"] == {"batch1": None, "throughput": None}


def test_llama31_shape_has_its_rope_scaling():
    from jaxllm.rope import rope_config

    cfg = common.SHAPES["llama3.1-8b"]
    rope = rope_config(cfg)
    assert cfg["max_position_embeddings"] == 131072 and rope.rope_type == "llama3" and rope.factor == 8.0
    assert common.ModelMath.from_config(cfg) == common.ModelMath.from_config(common.SHAPES["llama3-8b"])


def test_model_math_counts():
    m = common.ModelMath.from_config(common.SHAPES["llama3-8b"])
    # q, o: 4096 x 4096; k, v: 4096 x 1024; MLP: 3 x 4096 x 14336; 32 layers
    assert m.matmul_params == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert m.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert m.weight_bytes == (m.matmul_params + 4096 * 128256) * 2
    # a 3-token prompt: the queries see 1, 2 and 3 keys
    assert m.attn_flops(3, 0) == 4 * 32 * 32 * 128 * (1 + 2 + 3)
    assert m.attn_flops(2, 5) == 4 * 32 * 32 * 128 * (6 + 7)  # a chunk at positions 5 and 6


@pytest.mark.filterwarnings("ignore")
def test_long_context_smoke(tmp_path):
    """The long-context stage end to end on a tiny rope-scaled model: ceilings measured, rooflines computed from
    the model's arithmetic."""
    from bench import long_context

    out = tmp_path / "long.json"
    res = long_context.main(
        [
            "--shape",
            "tiny-long",
            "--load-format",
            "dummy",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "128",
            "--num-gpu-blocks-override",
            "128",
            "--batch-size",
            "2",
            "--input-len",
            "300",
            "--output-len",
            "3",
            "--num-iters",
            "1",
            "--num-iters-warmup",
            "0",
            "--copy-mib",
            "2",
            "--matmul-n",
            "64",
            "--enforce-eager",
            "--compilation-cache-dir",
            "",
            "--log-level",
            "warning",
            "--profile-dir",
            str(tmp_path / "prof"),
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["workload"]["batch_size"] == 2 and saved["ceilings"]["copy_bytes_per_s"] > 0
    assert saved["profile"]["file"] and saved["profile"]["num_prompts"] == 2  # a traced batch, summed up
    roof, ceil = res["roofline"], res["ceilings"]
    m = common.ModelMath.from_config(common.SHAPES["tiny-long"], kv_itemsize=roof["kv_bytes_per_token"] // 128)
    per_prompt = m.dense_flops(300, 1) + m.attn_flops(300, 0)
    assert roof["prefill_flops_per_prompt"] == pytest.approx(per_prompt)
    kv_step = 2 * m.kv_bytes_per_token * (301 + 302) / 2  # decode contexts 301 and 302, two sequences
    assert roof["itl_roofline_s"] == pytest.approx((m.weight_bytes + kv_step) / ceil["copy_bytes_per_s"])
    assert res["itl_roofline_frac"] == pytest.approx(roof["itl_roofline_s"] / res["itl_s"]["p50"])
    # the request that started decoding last: the other one's ITL has its 300-token prefill (three 128-token steps)
    last = res["itl_last_started_s"]["p50"]
    assert 0 < last < res["itl_s"]["p50"]
    assert res["itl_last_started_roofline_frac"] == pytest.approx(roof["itl_roofline_s"] / last)
    assert res["ttft_matmul_frac"] == pytest.approx(
        2 * per_prompt / res["ttft_last_in_batch_s"]["p50"] / ceil["matmul_flops_per_s"]
    )
    assert res["engine"]["max_model_len"] == 512


def _suite_args(**kw):
    return argparse.Namespace(
        **dict(
            dict(
                shape="llama3-8b",
                dtype="bfloat16",
                max_num_seqs=512,
                max_num_batched_tokens=8192,
                max_model_len=1024,
                attention_backend="auto",
                eager=False,
                budget=560,
                input_len=462,
                output_len=256,
            ),
            **kw,
        )
    )


def test_suite_ratios_divide_by_the_strongest_hf_row():
    from bench import suite

    hf = dict(
        rows=dict(
            static=dict(kind="batch1", decode_tok_per_s=116.0, ttft_s=0.02, compiled=True),
            eager=dict(kind="batch1", decode_tok_per_s=17.0, ttft_s=0.05, compiled=False),
            cb=dict(kind="throughput", requests_per_s=2.2, output_tokens_per_s=560.0, num_prompts=100),
            eager_batched=dict(kind="throughput", requests_per_s=3.6, output_tokens_per_s=920.0, num_prompts=64),
            cb_graphs=dict(kind="throughput", error="RuntimeError: x"),
        ),
        strongest=dict(
            batch1=dict(mode="static", decode_tok_per_s=116.0),
            throughput=dict(mode="eager_batched", requests_per_s=3.6),
        ),
        skipped={"static_batched": "needs ~80 s"},
    )
    r = dict(
        latency=dict(results=[dict(batch_size=1, decode_tok_per_s_per_seq=184.0)]),
        throughput=dict(requests_per_s=39.0, output_tokens_per_s=9984.0, workload=dict(num_prompts=500)),
        sharegpt=dict(
            requests_per_s=44.0,
            output_tokens_per_s=9900.0,
            workload=dict(num_prompts=500, prompt_tokens=100_000, output_tokens=112_500),
        ),
        hf=hf,
        long32k=dict(
            ttft_s=dict(p50=1.5),
            ttft_last_in_batch_s=dict(p50=1.5),
            itl_s=dict(p50=0.007),
            roofline=dict(itl_roofline_s=0.0065),
            itl_roofline_frac=0.0065 / 0.007,
            ttft_matmul_frac=0.7,
            ceilings=dict(copy_bytes_per_s=2.6e12, matmul_flops_per_s=6.87e14),
            workload=dict(batch_size=1, input_len=32640, output_len=128, model="llama3.1-8b"),
        ),
    )
    runs = {st: dict(rc=0, compile_cache=None) for st in r}
    runs["hf"]["rc"] = "timeout"  # its finished rows still count
    s = suite.summarize(r, runs, {}, _suite_args(), 100.0)
    assert s["vs_hf_batch1"] == pytest.approx(184 / 116) and s["hf_batch1_mode"] == "static"
    assert s["vs_hf_throughput"] == pytest.approx(39 / 3.6) and s["hf_throughput_mode"] == "eager_batched"
    assert s["vs_hf_rows"]["eager"] == pytest.approx(184 / 17) and "cb_graphs" not in s["vs_hf_rows"]
    assert s["hf_rows"]["cb_graphs"]["error"] and s["hf_skipped"] == hf["skipped"] and "rc=timeout" in s["hf_note"]
    assert s["met"]["vs_hf_batch1"] and s["met"]["vs_hf_throughput"] and s["met"]["req_s"]
    assert not s["met"]["sharegpt_req_s"]  # issue 37's 45 req/s is asked of the ShareGPT-like mix
    assert s["long32k_itl_over_roofline"] == pytest.approx(0.007 / 0.0065) and s["met"]["long32k_itl_over_roofline"]
    assert s["met"]["long32k_ttft_matmul_frac"]
    table = suite.table(s)
    assert "vs strongest HF, batch-1" in table and "(static)" in table and "HF cb_graphs" in table


@pytest.mark.filterwarnings("ignore")
def test_padding_waste_replay_is_the_engines_schedule(monkeypatch):
    """The replay's steps and buckets are those the engine dispatches for the same workload (tiny model, CPU):
    chunked prefill, decodes, the async one-step lookahead and the finish of each request."""
    from bench import padding_waste
    from jaxllm import LLM, SamplingParams
    from jaxllm.engine.runner import ModelRunner

    seen = []
    prepare = ModelRunner.prepare

    def recording(self, sched):
        p = prepare(self, sched)
        seen.append(
            (
                [(s.start, s.num_tokens, s.sample) for s in sched.scheduled],
                (p.variant.num_tokens, p.variant.num_seqs, p.variant.decode_only),
            )
        )
        return p

    monkeypatch.setattr(ModelRunner, "prepare", recording)
    ins, outs = [20, 9, 33, 5, 17, 26, 12, 8, 40, 3], [5, 9, 2, 7, 4, 6, 3, 8, 5, 6]
    llm = LLM(
        common.make_model_dir("tiny"),
        load_format="dummy",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=6,
        enforce_eager=True,
        compilation_cache_dir=None,
        enable_prefix_caching=False,
    )
    prompts = [{"prompt_token_ids": p} for p in common.random_token_prompts(len(ins), 0, 512, 0, ins)]
    llm.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0) for o in outs], use_tqdm=False)
    r = llm.llm_engine.runner
    steps = padding_waste.replay(
        ins,
        outs,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        num_blocks=r.num_blocks,
        block_size=r.block_size,
    )
    assert [c for c, _ in steps] == [c for c, _ in seen] and steps[-1][1] > 0  # it preempted, as the engine did
    assert padding_waste.default_buckets(4, 32) == (r.token_buckets, r.seq_buckets)
    for chunks, variant in seen:
        n_tok, n = sum(c[1] for c in chunks), len(chunks)
        assert padding_waste.step_bucket(n_tok, n, r.token_buckets, r.seq_buckets) == variant


def test_padding_waste_totals_and_variants(tmp_path):
    from bench import padding_waste

    res = padding_waste.main(
        [
            "--num-prompts",
            "40",
            "--input-len",
            "100",
            "--output-len",
            "20",
            "--max-num-seqs",
            "32",
            "--max-num-batched-tokens",
            "512",
            "--max-model-len",
            "256",
            "--num-blocks",
            "400",
            "--measured-s",
            "2.0",
            "--variant",
            "fine:seq_buckets=2/4/8/16/24/32",
            "--out",
            str(tmp_path / "pw.json"),
        ]
    )
    e = res["engine"]
    buckets = e["per_bucket"]
    assert sum(b["steps"] for b in buckets.values()) == e["num_steps"] == e["total"]["steps"]
    assert e["total"]["tokens"] == 40 * 100 + 40 * 19  # each request's last token is sampled, never fed back
    for key, b in buckets.items():
        B, T = (int(x) for x in key.rstrip("d").split("x"))
        assert b["padded_tokens"] == b["steps"] * T - b["tokens"] and b["padded_seqs"] == b["steps"] * B - b["seqs"]
    v = res["variants"]
    assert v["fine"]["settings"]["seq_buckets"] == [2, 4, 8, 16, 24, 32]
    assert v["fine"]["padded_seqs"] < v["engine"]["padded_seqs"] and v["fine"]["steps"] == v["engine"]["steps"]
    assert res["measured"]["model_over_measured"] == pytest.approx(e["total"]["model_s"] / 2.0)
    with pytest.raises(ValueError, match="unknown key"):
        padding_waste.main(["--num-prompts", "2", "--variant", "x:max_seqs=4"])


def test_bucket_ab_arms():
    from bench.bucket_ab import arm_buckets

    assert arm_buckets("pow2", 512) == ("pow2", None)
    assert arm_buckets("by64:2/4/256/320/512", 512) == ("by64", (2, 4, 256, 320, 512))
    for bad in ("x:2/4/256", "x:4/2/512", "x:"):
        with pytest.raises(ValueError, match="rising, ending at"):
            arm_buckets(bad, 512)
