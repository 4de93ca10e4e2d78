"""Every `vllm serve` flag of vLLM 0.8-0.11 (jaxllm/engine/vllm_options.py's table) parses in `python -m jaxllm.serve`:
honoured, accepted silently, accepted with one warning saying what jaxllm does instead, or refused naming what is
not supported; never argparse's "unrecognized arguments". The same for LLM() keyword arguments. The docs table
(server/VLLM_FLAGS.md) is the parser's."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re

import pytest

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.vllm_options import BY_FLAG, HONOURED, IGNORED, REFUSED, SAME, VLLM_OPTIONS
from server.args import engine_kwargs, make_parser, parse_args
from server.vllm_flags import flags_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Flags that need a companion to parse (as in vLLM).
COMPANIONS = {
    "--ssl-keyfile": ["--ssl-certfile", "c.pem"],
    "--ssl-certfile": ["--ssl-keyfile", "k.pem"],
    "--enable-auto-tool-choice": ["--tool-call-parser", "hermes"],
    "--enable-log-outputs": ["--enable-log-requests"],
    "--lora-modules": ["--enable-lora"],
    "--headless": ["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "1"],
    "--data-parallel-size-local": ["--data-parallel-size", "2"],
    "--speculative-model": ["--num-speculative-tokens", "3"],
    "--num-speculative-tokens": ["--speculative-model", "[ngram]"],
    **{
        f: ["--speculative-model", "d", "--num-speculative-tokens", "3"]
        for f in (
            "--ngram-prompt-lookup-max",
            "--ngram-prompt-lookup-min",
            "--speculative-draft-tensor-parallel-size",
            "--speculative-disable-by-batch-size",
        )
    },
}


# `vllm serve --help`'s flags (without --) in vLLM 0.8.0, 0.8.5, 0.9.0, 0.9.2, 0.10.0, 0.10.2, 0.11.0 and 0.11.2,
# collected from those releases' arg_utils.py / cli_args.py / cli/serve.py: the table must cover each.
VLLM_SERVE_FLAGS = (
    "additional-config aggregate-engine-logging all2all-backend allow-credentials allowed-headers "
    "allowed-local-media-path allowed-media-domains allowed-methods allowed-origins api-key api-server-count "
    "async-scheduling block-size calculate-kv-scales chat-template chat-template-content-format code-revision "
    "collect-detailed-traces compilation-config config config-format convert cpu-offload-gb cuda-graph-sizes "
    "cudagraph-capture-sizes data-parallel-address data-parallel-backend data-parallel-external-lb "
    "data-parallel-hybrid-lb data-parallel-rank data-parallel-rpc-port data-parallel-size "
    "data-parallel-size-local data-parallel-start-rank dbo-decode-token-threshold dbo-prefill-token-threshold "
    "dcp-kv-cache-interleave-size decode-context-parallel-size default-mm-loras device disable-async-output-proc "
    "disable-cascade-attn disable-chunked-mm-input disable-custom-all-reduce disable-fastapi-docs "
    "disable-frontend-multiprocessing disable-hybrid-kv-cache-manager disable-log-requests disable-log-stats "
    "disable-logprobs-during-spec-decoding disable-mm-preprocessor-cache disable-nccl-for-dp-synchronization "
    "disable-sliding-window disable-uvicorn-access-log distributed-executor-backend download-dir dtype "
    "ec-transfer-config enable-auto-tool-choice enable-chunked-prefill enable-dbo enable-eplb "
    "enable-expert-parallel enable-force-include-usage enable-log-outputs enable-log-requests enable-lora "
    "enable-lora-bias enable-mm-embeds enable-multimodal-encoder-data-parallel enable-prefix-caching "
    "enable-prompt-adapter enable-prompt-embeds enable-prompt-tokens-details enable-reasoning "
    "enable-request-id-headers enable-server-load-tracking enable-sleep-mode enable-ssl-refresh "
    "enable-tokenizer-info-endpoint enforce-eager eplb-config eplb-log-balancedness eplb-step-interval "
    "eplb-window-size exclude-tools-when-tool-choice-none expand-tools-even-if-tool-choice-none "
    "expert-placement-strategy fully-sharded-loras generation-config gpu-memory-utilization "
    "guided-decoding-backend guided-decoding-disable-additional-properties "
    "guided-decoding-disable-any-whitespace guided-decoding-disable-fallback h11-max-header-count "
    "h11-max-incomplete-event-size headless hf-config-path hf-overrides hf-token host ignore-patterns "
    "interleave-mm-strings io-processor-plugin kv-cache-dtype kv-cache-memory-bytes kv-events-config "
    "kv-offloading-backend kv-offloading-size kv-sharing-fast-prefill kv-transfer-config limit-mm-per-prompt "
    "load-format log-config-file log-error-stack logits-processor-pattern logits-processors logprobs-mode "
    "long-lora-scaling-factors long-prefill-token-threshold lora-dtype lora-extra-vocab-size lora-modules "
    "mamba-block-size mamba-cache-dtype mamba-ssm-cache-dtype master-addr master-port max-cpu-loras "
    "max-cudagraph-capture-size max-log-len max-logprobs max-long-partial-prefills max-lora-rank max-loras "
    "max-model-len max-num-batched-tokens max-num-partial-prefills max-num-seqs max-parallel-loading-workers "
    "max-prompt-adapter-token max-prompt-adapters max-seq-len-to-capture media-io-kwargs middleware "
    "mm-encoder-attn-backend mm-encoder-tp-mode mm-processor-cache-gb mm-processor-cache-type "
    "mm-processor-kwargs mm-shm-cache-max-object-size-mb model model-impl model-loader-extra-config "
    "multi-step-stream-outputs ngram-prompt-lookup-max ngram-prompt-lookup-min nnodes node-rank "
    "num-gpu-blocks-override num-lookahead-slots num-redundant-experts num-scheduler-steps "
    "num-speculative-tokens otlp-traces-endpoint override-attention-dtype override-generation-config "
    "override-neuron-config override-pooler-config pipeline-parallel-size pooler-config port preemption-mode "
    "prefix-caching-hash-algo prompt-adapters pt-load-map-location qlora-adapter-name-or-path quantization "
    "ray-workers-use-nsight reasoning-parser reasoning-parser-plugin response-role return-tokens-as-token-ids "
    "revision root-path rope-scaling rope-theta runner safetensors-load-strategy scheduler-cls "
    "scheduler-delay-factor scheduling-policy seed served-model-name show-hidden-metrics-for-version "
    "skip-mm-profiling skip-tokenizer-init spec-decoding-acceptance-method speculative-config "
    "speculative-disable-by-batch-size speculative-disable-mqa-scorer speculative-draft-tensor-parallel-size "
    "speculative-max-model-len speculative-model speculative-model-quantization ssl-ca-certs ssl-cert-reqs "
    "ssl-certfile ssl-keyfile stream-interval structured-outputs-config swap-space task tensor-parallel-size "
    "tokenizer tokenizer-mode tokenizer-pool-extra-config tokenizer-pool-size tokenizer-pool-type "
    "tokenizer-revision tokens-only tool-call-parser tool-parser-plugin tool-server trust-remote-code "
    "trust-request-chat-template typical-acceptance-sampler-posterior-alpha "
    "typical-acceptance-sampler-posterior-threshold uds use-tqdm-on-load use-v2-block-manager uvicorn-log-level "
    "video-pruning-rate worker-cls worker-extension-cls"
).split()


def test_the_table_covers_every_flag_of_vllm_0_8_to_0_11():
    assert len(VLLM_SERVE_FLAGS) == 236
    assert sorted(o.flag[2:] for o in VLLM_OPTIONS) == sorted(VLLM_SERVE_FLAGS)


def _sample(parser: argparse.ArgumentParser, flag: str, option) -> list[str]:
    """A value the flag takes: for a flag jaxllm does not implement, one that is not an accepted value."""
    if option.kind != HONOURED:
        return {"bool": [], "values": ["a", "b"]}.get(option.arity, ["7"])
    action = parser._option_string_actions[flag]
    if action.nargs == 0 or action.nargs == "?":
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    if flag == "--chat-template":
        return ["{% for m in messages %}{{ m['content'] }}{% endfor %}"]
    if flag == "--speculative-config":
        return ['{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}']
    name = getattr(action.type, "__name__", "")
    value = {
        "int": "2",
        "float": "0.5",
        "human_readable_int": "2k",
        "max_model_len": "1k",
        "loads": '["*"]',
        "json_object": "{}",
        "parse_lora_module": "a=/adapters/a",
    }.get(name, "x")
    return [value] * (2 if action.nargs == "+" else 1)


def _parse(argv, caplog, capsys):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        try:
            args = parse_args(argv, environ={})
        except SystemExit as e:
            return None, e.code, capsys.readouterr().err
    return args, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING], capsys.readouterr().err


@pytest.mark.parametrize("option", VLLM_OPTIONS, ids=lambda o: o.flag)
def test_every_vllm_flag_parses_as_the_table_says(option, caplog, capsys, tmp_path):
    parser = make_parser()
    for name in (option.flag, *option.aliases):
        if option.flag == "--config":
            (tmp_path / "c.yaml").write_text("max-model-len: 64\n")
            value = [str(tmp_path / "c.yaml")]
        else:
            value = _sample(parser, option.flag, option)
        argv = ([] if option.flag == "--model" else ["m"]) + [name, *value] + COMPANIONS.get(option.flag, [])
        args, warnings, err = _parse(argv, caplog, capsys)
        assert "unrecognized" not in err, (argv, err)
        if option.kind in (HONOURED, SAME):
            assert args is not None and warnings == [], (argv, warnings, err)
        elif option.kind == IGNORED:
            assert args is not None and len(warnings) == 1, (argv, warnings, err)
            assert warnings[0].startswith(option.flag) and option.message in warnings[0]
            assert not hasattr(args, option.dest)  # nothing of it reaches the engine
        else:
            assert args is None and warnings == 2, (argv, err)  # argparse's exit status for a usage error
            assert f"error: {option.flag}" in err and option.message in err
        if option.arity == "bool" or isinstance(parser._option_string_actions[name], argparse._StoreTrueAction):
            args, warnings, err = _parse(
                argv[:1] + ["--no-" + option.flag[2:]] + COMPANIONS.get(option.flag, []), caplog, capsys
            )
            assert args is not None and warnings == [], (option.flag, err)


def test_accepted_values_are_silent_and_the_tutorial_command_lines_run(caplog, capsys):
    args, warnings, _ = _parse(
        [
            "m",
            "--data-parallel-size",
            "1",
            "--cpu-offload-gb",
            "0",
            "--task",
            "generate",
            "--preemption-mode",
            "recompute",
            "--tokenizer-pool-size",
            "0",
            "--device",
            "cuda",
        ],
        caplog,
        capsys,
    )
    assert args is not None and warnings == []
    # the tutorial: --num-scheduler-steps 8 --tokenizer-pool-size 2 (one warning each)
    args, warnings, _ = _parse(
        [
            "Qwen/Qwen2.5-7B-Instruct",
            "--num-scheduler-steps",
            "8",
            "--tokenizer-pool-size",
            "2",
            "--swap-space",
            "16",
            "--max-model-len",
            "4096",
        ],
        caplog,
        capsys,
    )
    assert [w.split(" has no effect")[0] for w in warnings] == [
        "--num-scheduler-steps 8",
        "--swap-space 16",
        "--tokenizer-pool-size 2",
    ]
    assert args.max_model_len == 4096 and "swap_space" not in vars(args)
    for argv, what in (
        (["--data-parallel-size", "2", "--data-parallel-size-local", "1"], "replicas on other hosts"),
        (["-dp", "2", "--data-parallel-rank", "1"], "data parallelism across hosts"),
        (["--headless"], "--headless is for the processes other than 0"),
        (["--task", "classify"], "invalid choice: 'classify'"),
        (["--runner", "draft"], "invalid choice: 'draft'"),
        (["--tokenizer-mode", "mistral"], "only auto and slow tokenizer modes"),
    ):
        args, code, err = _parse(["m", *argv], caplog, capsys)
        assert args is None and code == 2 and what in err, err
    # one host's data parallelism as vLLM users write it, and vLLM's multi-node names for a headless process
    args, warnings, _ = _parse(["m", "-dp", "2", "-dpl", "2", "--data-parallel-backend", "mp"], caplog, capsys)
    assert args is not None and warnings == [] and engine_kwargs(args)["data_parallel_size"] == 2
    args, warnings, _ = _parse(
        ["m", "--headless", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h"], caplog, capsys
    )
    assert args is not None and warnings == [] and (args.num_processes, args.process_id) == (2, 1)


def test_where_vllm_fails_before_loading_so_does_jaxllm(caplog, capsys, tmp_path):
    """vLLM's validate_parsed_serve_args: a --chat-template path that does not exist, --enable-log-outputs without
    --enable-log-requests, --enable-auto-tool-choice without --tool-call-parser: errors before the model loads."""
    for argv, what in (
        (["--chat-template", str(tmp_path / "template_baichuan.jinja")], "looks like a file path"),
        (["--enable-log-outputs"], "--enable-log-outputs requires --enable-log-requests"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    ):
        args, code, err = _parse(["m", *argv], caplog, capsys)
        assert args is None and code == 2 and what in err, err
    args, warnings, _ = _parse(["m", "--enable-log-requests", "--enable-log-outputs"], caplog, capsys)
    assert args is not None and len(warnings) == 1


def test_table_and_parser_agree():
    parser = make_parser()
    unimplemented = {o.flag for o in parser.vllm_unimplemented}
    fields = set(EngineArgs.__dataclass_fields__)
    for option in VLLM_OPTIONS:
        assert option.flag in parser._option_string_actions, option.flag
        if option.kind == HONOURED:
            assert option.flag not in unimplemented
            if option.scope == "engine" and option.dest not in (
                "disable_log_stats",
                "nnodes",
                "node_rank",
                "master_addr",
                "master_port",
                "data_parallel_size_local",
            ):
                assert option.dest in fields, f"{option.flag} is honoured, so LLM({option.dest}=...) must be too"
        else:  # defined by add_vllm_flags, not by the parser itself (else this row is stale: it is honoured now)
            assert option.flag in unimplemented, f"{option.flag} is defined in server/args.py: mark it HONOURED"
    for flag in (
        "--num-scheduler-steps",
        "--tokenizer-pool-size",
        "--override-generation-config",
        "--swap-space",
        "--enable-lora",
        "--speculative-config",
        "--trust-remote-code",
        "--download-dir",
        "--revision",
        "--tokenizer-revision",
    ):
        assert flag in BY_FLAG


def test_docs_table_is_generated_from_the_parser():
    with open(os.path.join(ROOT, "server", "VLLM_FLAGS.md")) as f:
        assert f.read() == flags_markdown(make_parser()), "run: python -m server.vllm_flags > server/VLLM_FLAGS.md"


def _keyword_sample(option):
    return {"bool": True, "values": ["a"]}.get(option.arity, 7)


@pytest.mark.parametrize(
    "option", [o for o in VLLM_OPTIONS if o.scope == "engine" and o.kind != HONOURED], ids=lambda o: o.dest
)
def test_llm_keywords(option, caplog):
    from jaxllm.engine import vllm_options

    vllm_options._warned.discard(option.dest)
    caplog.clear()
    kwargs = {option.dest: _keyword_sample(option)}
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        if option.kind == REFUSED:
            with pytest.raises(ValueError, match=re.escape(option.describe(_keyword_sample(option), keyword=True))):
                EngineArgs.from_kwargs(**kwargs)
            return
        args = EngineArgs.from_kwargs(model="m", **kwargs)
    assert args.model == "m" and not hasattr(args, option.dest)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ([] if option.kind == SAME else [option.describe(_keyword_sample(option), keyword=True)])


def test_llm_accepts_vllms_keywords(monkeypatch, caplog):
    """LLM(swap_space=4) must not raise TypeError (vLLM 0.8-0.10 tutorials pass it); unknown keywords still do."""
    from jaxllm.entrypoints import llm as llm_module

    monkeypatch.setattr(llm_module, "LLMEngine", lambda args: args)
    llm = llm_module.LLM(
        "m",
        swap_space=4,
        max_seq_len_to_capture=8192,
        disable_log_stats=True,
        revision="v1",
        download_dir="/d",
        tokenizer_mode="slow",
        data_parallel_size=1,
    )
    assert llm.engine_args.revision == "v1" and llm.engine_args.tokenizer_mode == "slow"
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        llm_module.LLM("m", no_such_option=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'port'"):  # a server flag, not an LLM() one
        llm_module.LLM("m", port=8000)
    llm = llm_module.LLM("m", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert llm.engine_args.speculative_config["num_speculative_tokens"] == 3  # honoured since issue 33


def test_config_file_then_command_line(tmp_path, caplog, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "model: org/tiny\nmax-model-len: 2048\nenable_prefix_caching: false\nserved-model-name: [a, b]\n"
        "hf-overrides: {rope_theta: 1000000.0}\nswap-space: 8\nport: 9000\n"
    )
    args, warnings, _ = _parse(["--config", str(cfg), "--port", "9001"], caplog, capsys)
    assert args.model == "org/tiny" and args.max_model_len == 2048 and args.enable_prefix_caching is False
    assert args.served_model_name == ["a", "b"] and args.port == 9001  # the command line wins
    assert engine_kwargs(args)["hf_overrides"] == {"rope_theta": 1e6}
    assert len(warnings) == 1 and warnings[0].startswith("--swap-space 8")
    args, _, _ = _parse(["other/model", "--config", str(cfg)], caplog, capsys)
    assert args.model == "other/model"


def test_model_source_flags_reach_the_engine(caplog, capsys):
    args, _, _ = _parse(
        [
            "org/m",
            "--revision",
            "v2",
            "--tokenizer",
            "org/t",
            "--tokenizer-revision",
            "t1",
            "--download-dir",
            "/dl",
            "--hf-token",
            "--ignore-patterns",
            "*.pt",
            "original/*",
            "--tokenizer-mode",
            "slow",
            "--override-generation-config",
            '{"temperature": 0.5}',
            "--rope-scaling",
            '{"rope_type": "linear", "factor": 2.0}',
            "--rope-theta",
            "5e5",
            "--code-revision",
            "c1",
            "--trust-remote-code",
        ],
        caplog,
        capsys,
    )
    kw = engine_kwargs(args)
    engine_args = EngineArgs.from_kwargs(**kw)
    assert (engine_args.revision, engine_args.tokenizer_revision, engine_args.download_dir) == ("v2", "t1", "/dl")
    assert engine_args.hf_token is True and engine_args.ignore_patterns == ["*.pt", "original/*"]
    assert engine_args.tokenizer_mode == "slow" and engine_args.trust_remote_code and engine_args.code_revision == "c1"
    assert engine_args.override_generation_config == {"temperature": 0.5}
    assert engine_args.config_overrides() == {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 5e5}
    args, code, err = _parse(["m", "--hf-overrides", "[1]"], caplog, capsys)
    assert args is None and "expected a JSON object" in err


def test_override_generation_config_merges_as_vllm():
    from jaxllm.engine.tokenizer_setup import generation_config

    class Tok:
        eos_token_id = 2

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "generation_config.json"), "w") as f:
            json.dump({"temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7]}, f)
        eos, defaults = generation_config("auto", d, Tok(), {"temperature": 0.3, "max_new_tokens": 64})
        assert eos == {2, 7} and defaults == {"temperature": 0.3, "top_p": 0.9, "max_tokens": 64}
        _, defaults = generation_config("vllm", d, Tok(), {"top_k": 5})
        assert defaults == {"top_k": 5}


def test_vllm_0_8_speculative_flags_give_the_speculative_config(caplog, capsys):
    """--speculative-model / --num-speculative-tokens / --ngram-prompt-lookup-* / -spec-draft-tp /
    --speculative-disable-by-batch-size (vLLM 0.8.0, "[ngram]" meaning n-gram lookup) are --speculative-config."""

    def spec(argv):
        args, warnings, err = _parse(["m", *argv], caplog, capsys)
        assert args is not None and warnings == [], err
        return EngineArgs.from_kwargs(**engine_kwargs(args)).speculative()

    def config(value):
        return EngineArgs(model="m", speculative_config=value).speculative()

    old = spec(
        [
            "--speculative-model",
            "[ngram]",
            "--num-speculative-tokens",
            "4",
            "--ngram-prompt-lookup-max",
            "4",
            "--ngram-prompt-lookup-min",
            "2",
        ]
    )
    assert old == config(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    )
    assert old.method == "ngram" and old.model is None
    assert spec(["--speculative-model", "[ngram]", "--num-speculative-tokens", "3"]) == config(
        '{"method": "ngram", "num_speculative_tokens": 3}'
    )
    assert spec(
        [
            "--speculative-model",
            "/draft",
            "--num-speculative-tokens",
            "3",
            "-spec-draft-tp",
            "1",
            "--speculative-disable-by-batch-size",
            "8",
        ]
    ) == config(
        {"model": "/draft", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1, "disable_by_batch_size": 8}
    )
    # --speculative-config wins, as in vLLM 0.8.0; the lookup flags alone configure nothing
    assert spec(
        [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}',
            "--speculative-model",
            "/draft",
            "--num-speculative-tokens",
            "5",
        ]
    ) == config({"method": "ngram", "num_speculative_tokens": 2})
    assert spec(["--ngram-prompt-lookup-max", "4"]) is None
    assert EngineArgs.from_kwargs(
        model="m", speculative_model="[ngram]", num_speculative_tokens=3
    ).speculative() == config({"method": "ngram", "num_speculative_tokens": 3})
    args, code, err = _parse(["m", "--num-speculative-tokens", "3"], caplog, capsys)
    assert args is None and code == 2 and "num_speculative_tokens was provided without speculative model" in err
