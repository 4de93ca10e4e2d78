"""A Baichuan-7B-layout model folder whose tokenizer is remote code: a sentencepiece BPE model with byte fallback
(tokenizer.model) read by a slow tokenizer class in the folder (tokenization_baichuan.py, named by auto_map in
tokenizer_config.json), and config.json naming its configuration class the same way (configuration_baichuan.py),
as baichuan-inc/Baichuan-7B ships. The classes here are written for the tests, with the shape of the real ones.
"""

from __future__ import annotations

import io
import json
import os

TOKENIZER_CODE = '''
"""BaiChuanTokenizer: a slow tokenizer over a sentencepiece model (test copy of the Baichuan-7B layout)."""
import os
from shutil import copyfile

import sentencepiece as spm
from transformers.tokenization_utils import AddedToken, PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tokenizer.model"}


class BaiChuanTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token=None,
                 sp_model_kwargs=None, add_bos_token=True, add_eos_token=False,
                 clean_up_tokenization_spaces=False, **kwargs):
        self.sp_model_kwargs = sp_model_kwargs or {}
        self.vocab_file = vocab_file
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.sp_model = spm.SentencePieceProcessor(**self.sp_model_kwargs)
        self.sp_model.Load(vocab_file)

        def added(t):
            return AddedToken(t, lstrip=False, rstrip=False) if isinstance(t, str) else t

        super().__init__(bos_token=added(bos_token), eos_token=added(eos_token), unk_token=added(unk_token),
                         pad_token=added(pad_token), add_bos_token=add_bos_token, add_eos_token=add_eos_token,
                         sp_model_kwargs=self.sp_model_kwargs,
                         clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["sp_model"] = None
        return state

    def __setstate__(self, d):
        self.__dict__ = d
        self.sp_model = spm.SentencePieceProcessor(**self.sp_model_kwargs)
        self.sp_model.Load(self.vocab_file)

    @property
    def vocab_size(self):
        return self.sp_model.get_piece_size()

    def get_vocab(self):
        vocab = {self.sp_model.IdToPiece(i): i for i in range(self.vocab_size)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text):
        return self.sp_model.encode(text, out_type=str)

    def _convert_token_to_id(self, token):
        return self.sp_model.piece_to_id(token)

    def _convert_id_to_token(self, index):
        return self.sp_model.IdToPiece(index)

    def convert_tokens_to_string(self, tokens):
        # special tokens are not sentencepiece pieces: decode the runs between them
        out, run, prev_special = "", [], False
        for i, token in enumerate(tokens):
            if token in self.all_special_tokens:
                if not prev_special and i != 0:
                    out += " "
                out += self.sp_model.decode(run) + token
                run, prev_special = [], True
            else:
                run.append(token)
                prev_special = False
        return out + self.sp_model.decode(run)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tokenizer.model")
        if os.path.abspath(self.vocab_file) != os.path.abspath(out) and os.path.isfile(self.vocab_file):
            copyfile(self.vocab_file, out)
        elif not os.path.isfile(self.vocab_file):
            with open(out, "wb") as f:
                f.write(self.sp_model.serialized_model_proto())
        return (out,)

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        bos = [self.bos_token_id] if self.add_bos_token else []
        eos = [self.eos_token_id] if self.add_eos_token else []
        out = bos + token_ids_0 + eos
        if token_ids_1 is not None:
            out = out + bos + token_ids_1 + eos
        return out
'''

CONFIG_CODE = """
from transformers.configuration_utils import PretrainedConfig


class BaiChuanConfig(PretrainedConfig):
    model_type = "baichuan"

    def __init__(self, vocab_size=64000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.hidden_act, self.rms_norm_eps = hidden_act, rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
"""

# English and Chinese, so that the tokenizer has multi-byte pieces and byte-fallback pieces (<0xE9>) for the rarer
# characters: the cases incremental detokenization must get right.
_TEXT = """In the beginning was the engine, and the engine was paged. Blocks were counted and hashed,
and every request that came was given its pages, and when it finished they returned. The scheduler saw
the waiting and the running, and it chose by the budget of tokens. Then the sampler drew from the logits,
greedy or with a seed, and the detokenizer spoke the words aloud, one delta at a time.
北京是中国的首都。上海是一个大城市。我们今天去公园散步，天气很好。""".splitlines()

# A Baichuan-style chat template (the models ship none; vLLM's examples/template_baichuan.jinja has this shape).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{{- '<s>user:' + "
    "message['content'] -}}{%- elif message['role'] == 'assistant' -%}{{- '<s>assistant:' + "
    "message['content'] -}}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{- '<s>assistant:' -}}{%- endif -%}"
)


def _added(content: str) -> dict:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": True,
    }


def write_sentencepiece_model(path: str, vocab_size: int = 384) -> int:
    """Trains a BPE sentencepiece model with byte fallback (Baichuan's kind) on the text above; returns its size."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_TEXT * 8),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.98,
        hard_vocab_limit=False,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return spm.SentencePieceProcessor(model_proto=buf.getvalue()).get_piece_size()


def write_remote_code_tokenizer(out_dir: str) -> int:
    """tokenizer.model + tokenization_baichuan.py + tokenizer_config.json (auto_map) + special_tokens_map.json;
    returns the vocabulary size."""
    os.makedirs(out_dir, exist_ok=True)
    size = write_sentencepiece_model(os.path.join(out_dir, "tokenizer.model"))
    with open(os.path.join(out_dir, "tokenization_baichuan.py"), "w") as f:
        f.write(TOKENIZER_CODE)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaiChuanTokenizer", None]},
                "add_bos_token": False,
                "add_eos_token": False,
                "bos_token": _added("<s>"),
                "eos_token": _added("</s>"),
                "unk_token": _added("<unk>"),
                "clean_up_tokenization_spaces": False,
                "model_max_length": 4096,
                "sp_model_kwargs": {},
                "tokenizer_class": "BaiChuanTokenizer",
            },
            f,
        )
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": _added("<s>"), "eos_token": _added("</s>"), "unk_token": _added("<unk>")}, f)
    return size


def make_baichuan7b_remote_code_dir(out_dir: str, seed: int = 0):
    """A tiny Baichuan-7B folder (W_pack weights) with the remote-code tokenizer and config; returns (dir, HF
    model): the equivalent Llama, as tests/tiny_models builds for baichuan7b."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import hf_config, save_checkpoint

    vocab = write_remote_code_tokenizer(out_dir)
    cfg = hf_config("baichuan7b")
    cfg.vocab_size = vocab
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    save_checkpoint(model, "baichuan7b", out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config.update(
        auto_map={
            "AutoConfig": "configuration_baichuan.BaiChuanConfig",
            "AutoModelForCausalLM": "modeling_baichuan.BaiChuanForCausalLM",
        },
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(out_dir, "configuration_baichuan.py"), "w") as f:
        f.write(CONFIG_CODE)
    return out_dir, model
