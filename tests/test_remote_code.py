"""trust_remote_code: a Baichuan-7B-layout folder whose tokenizer is a sentencepiece class in the folder
(tokenization_baichuan.py via auto_map, tests/remote_code_models.py) runs offline and on the server with the flag,
and without it fails as vLLM does, before any weight loads or step compiles."""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.engine.tokenizer_load import RemoteCodeError
from tests.remote_code_models import CHAT_TEMPLATE, make_baichuan7b_remote_code_dir

ENGINE = dict(
    dtype="float32",
    num_gpu_blocks_override=64,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    block_size=8,
    enforce_eager=True,
    max_model_len=128,
)
PROMPTS = ["北京是中国的", "The engine was paged and", "我们今天去公园"]


@pytest.fixture(scope="module")
def baichuan(tmp_path_factory):
    return make_baichuan7b_remote_code_dir(str(tmp_path_factory.mktemp("baichuan-7B")))


@pytest.fixture(scope="module")
def llm(baichuan):
    return LLM(baichuan[0], trust_remote_code=True, **ENGINE)


def _no_weights_or_compiles(monkeypatch):
    """Makes loading weights or building the runner (which compiles the steps) an error."""
    from jaxllm.engine import runner
    from jaxllm.models import loader

    def touched(*a, **k):
        raise AssertionError("weights or compiles were reached before the remote-code check")

    for mod, name in ((loader, "load_params"), (loader, "abstract_weights"), (runner.ModelRunner, "__init__")):
        monkeypatch.setattr(mod, name, touched)


def test_without_the_flag_the_config_fails_first_with_vllms_message(baichuan, monkeypatch):
    _no_weights_or_compiles(monkeypatch)
    with pytest.raises(
        RuntimeError,
        match=r"Failed to load the model config\. If the model is a custom model .* "
        r"`trust_remote_code=True` in LLM or using the `--trust-remote-code`",
    ):
        LLM(baichuan[0], **ENGINE)
    with pytest.raises(ValueError, match="configuration_baichuan.BaiChuanConfig"):  # ValueError too: names the class
        LLM(baichuan[0], **ENGINE)


def test_without_the_flag_a_remote_code_tokenizer_fails_before_the_weights(baichuan, tmp_path, monkeypatch):
    """A model type transformers knows (no config code needed) with a tokenizer that is the folder's code."""
    d = str(tmp_path / "llama-with-remote-tokenizer")
    shutil.copytree(baichuan[0], d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("auto_map")
    cfg["model_type"] = "llama"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    _no_weights_or_compiles(monkeypatch)
    with pytest.raises(
        RemoteCodeError,
        match=r"Failed to load the tokenizer\. If the tokenizer is a custom "
        r"tokenizer .*tokenization_baichuan\.BaiChuanTokenizer",
    ):
        LLM(d, **ENGINE)
    with pytest.raises(AssertionError, match="weights or compiles"):  # with the flag it gets that far
        LLM(d, trust_remote_code=True, **ENGINE)


def test_offline_greedy_matches_hf_with_the_remote_code_tokenizer(llm, baichuan):
    tok = llm.get_tokenizer()
    assert type(tok).__name__ == "BaiChuanTokenizer" and not tok.is_fast
    _, hf = baichuan
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)  # the slow class's encoding (no BOS: add_bos_token false, as Baichuan-7B's)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None
            )[0, len(ids) :].tolist()
        c = out.outputs[0]
        assert c.token_ids == want
        # the incremental text is the continuation of the prompt's text (sentencepiece keeps the first piece's
        # space; byte-fallback pieces join into characters), but for a last character max_tokens cut short
        # (vLLM's text never ends in U+FFFD)
        assert c.text == tok.decode(ids + c.token_ids)[len(tok.decode(ids)) :].rstrip("\ufffd")


def test_served_with_trust_remote_code_and_a_chat_template(baichuan, tmp_path):
    """`python -m jaxllm.serve ./baichuan-7B/ --served-model-name baichuan-7b --chat-template template_baichuan.jinja
    --trust-remote-code`, with streaming through the slow tokenizer's incremental detokenization."""
    from server.args import parse_args
    from server.serve import build_engine
    from server.server_thread import ServerThread

    template = tmp_path / "template_baichuan.jinja"
    template.write_text(CHAT_TEMPLATE)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items() if k != "enforce_eager"]
    args = parse_args(
        [
            baichuan[0],
            "--served-model-name",
            "baichuan-7b",
            "--chat-template",
            str(template),
            "--trust-remote-code",
            "--enforce-eager",
            "--disable-access-log",
            *flags,
        ]
    )
    engine = build_engine(args)
    tok = engine.get_tokenizer()
    with ServerThread(engine, args=args) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "北京是中国的首都吗？"}]
        body = dict(
            model="baichuan-7b",
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        whole = client.chat.completions.create(**body)
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(**body, stream=True)
            if chunk.choices
        )
        text = whole.choices[0].message.content
        assert streamed == text and whole.usage.completion_tokens == 12
        # the template's rendering, tokenized by the remote-code class
        prompt = tok.encode("<s>user:北京是中国的首都吗？<s>assistant:", add_special_tokens=False)
        assert whole.usage.prompt_tokens == len(prompt)
        r = client.completions.create(
            model="baichuan-7b", prompt="The engine was", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text and r.usage.completion_tokens == 8


def test_a_converted_checkpoint_keeps_the_remote_code(llm, baichuan, tmp_path):
    """jaxllm convert copies the model folder's *.py (config.json's / tokenizer_config.json's auto_map names them):
    the converted Baichuan-7B loads with trust_remote_code and decodes as the source does."""
    from convert import convert_checkpoint

    out = convert_checkpoint(baichuan[0], str(tmp_path / "conv"), progress=False)
    assert {n for n in os.listdir(baichuan[0]) if n.endswith(".py")} <= set(os.listdir(out))
    converted = LLM(out, trust_remote_code=True, **ENGINE)
    assert type(converted.get_tokenizer()).__name__ == "BaiChuanTokenizer"
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in converted.generate(PROMPTS, sp, use_tqdm=False)] == want
