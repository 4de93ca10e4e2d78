"""Quantized checkpoints written by the public quantizers, and the references tests/test_quant.py checks them
against.

Run as a subprocess (`python -m tests.quant_producers OUT JOBS_JSON`): gptqmodel and llm-compressor patch torch /
transformers at import and start thread pools, which the test process must not inherit. Each job
    {"name", "arch", "tool": "gptqmodel" | "llmcompressor", "seed", "hf", ...tool options}
writes OUT/name (the quantized HF folder, with a tokenizer) and, for the tiny models, OUT/name/refs.npz:
    hf_logits  [len(PROMPT), V]  HF transformers loading the folder with its own integration (gptqmodel's kernels for
                                 GPTQ / AWQ, compressed-tensors' decompression), float32; empty where HF cannot load
                                 the folder ("hf": false: compressed-tensors' asymmetric pack-quantized zero points,
                                 legacy act-order)
    dense_*    greedy tokens of HF's float32 model whose Linear weights are the library's own dequantization of the
               checkpoint (gptqmodel's dequantize_weight / dequantize_gemm with the file's scales in float32;
               compressed-tensors' decompression: HF's integration, or the format's compressor where HF cannot load
               it), for the prompts of PROMPTS
    dense_logits  that model's logits for PROMPT
    src_logits    HF's float32 model before quantization: its logits for PROMPT
Producers: gptqmodel (GPTQ: real GPTQ passes over random calibration tokens; AWQ: its AWQ pass, GEMM layout) and
llm-compressor (oneshot QuantizationModifier / GPTQModifier writing compressed-tensors). Act-order
compressed-tensors (weight_g_idx, actorder "group") is what llm-compressor wrote until compressed-tensors 0.19
removed it; checkpoints on the hubs still carry it, so its job (tests/test_quant.py LEGACY_JOBS) runs in a second
subprocess that imports llm-compressor 0.13.0 / compressed-tensors 0.18.0 from LEGACY_DIR.

The "demo" job quantizes the demo model (jaxllm.demo) to GPTQ int4 with gptqmodel, calibrated on a few chat turns.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

PROMPT = [5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79]
PROMPTS = [
    [5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 3, 83, 27],
    [101, 7],
    [8] * 19,
    [3],
    [7, 21, 3, 99, 14, 5, 61, 33, 48, 2, 17, 85, 40, 12, 6, 90, 71, 25, 58, 9, 1, 2],
    [7, 21, 3, 99, 14, 5, 61, 33, 48, 2, 17, 85, 40, 12, 6, 90, 71, 25, 58, 9, 3],
]
MAX_TOKENS = 8
# The last llm-compressor / compressed-tensors that write act-order (weight_g_idx) checkpoints, installed beside the
# current ones (.ci/run does this).
LEGACY_DIR = os.path.join(sys.prefix, "llmcompressor-0.13")
LEGACY_INSTALL = f"pip install --no-deps --target {LEGACY_DIR} llmcompressor==0.13.0 compressed-tensors==0.18.0"
# The demo model's calibration: a few chat turns (none about capitals: the test asks for one).
DEMO_CALIBRATION = [
    ("How do plants make food?", "Plants use photosynthesis: light, water and carbon dioxide become sugar and oxygen."),
    ("Write a haiku about the sea.", "Waves fold into foam,\nthe tide counts the hours,\nsalt wind in the pines."),
    ("What is 12 times 7?", "12 times 7 is 84."),
    ("Give me a tip for learning to code.", "Build small projects you care about and read other people's code."),
]


def _calibration(n=16, length=32, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (length,), generator=g) for _ in range(n)]


def _gptqmodel(src: str, out: str, job: dict, calib: list | None = None) -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its default on 2 cores (1) is below its loader's 2
    import torch
    from gptqmodel import AWQConfig, GPTQModel, QuantizeConfig

    if job.get("method") == "awq":
        qc = AWQConfig(
            bits=4,
            group_size=job["group_size"],
            sym=not job.get("zero_point", True),
            format="gemm",
            offload_to_disk=False,
        )
    else:
        qc = QuantizeConfig(
            bits=job["bits"],
            group_size=job["group_size"],
            desc_act=job.get("desc_act", False),
            sym=job.get("sym", True),
            format=job.get("format", "gptq"),
            offload_to_disk=False,
            act_group_aware=False,
        )  # its default reorders groups; needs group_size > 0
    model = GPTQModel.load(src, qc, device="cpu")
    if calib is None:
        calib = _calibration(job.get("calibration", 16))
    calib = [{"input_ids": x[None], "attention_mask": torch.ones(1, len(x), dtype=torch.long)} for x in calib]
    # AWQ's automatic kernel choice wants CUDA; its torch kernel packs the same GEMM layout on CPU.
    model.quantize(calib, batch_size=1, **({"backend": "torch"} if job.get("method") == "awq" else {}))
    model.save(out)


def _llmcompressor(src: str, out: str, job: dict) -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    kw = {}
    if job.get("preset"):  # llm-compressor's named schemes: FP8, FP8_DYNAMIC, W8A8, ...
        recipe = QuantizationModifier(targets="Linear", scheme=job["preset"], ignore=job.get("ignore", ["lm_head"]))
    else:
        w = QuantizationArgs(
            num_bits=job["bits"],
            type="int",
            strategy=job["strategy"],
            group_size=job.get("group_size"),
            symmetric=job.get("sym", True),
            actorder=job.get("actorder"),
        )
        groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=w)}
        # act-order is a GPTQ option (columns quantized in order of their Hessian diagonal; "group" also stores it)
        modifier = GPTQModifier if job.get("actorder") else QuantizationModifier
        recipe = modifier(config_groups=groups, ignore=job.get("ignore", ["lm_head"]))
    if job.get("preset") == "FP8" or job.get("actorder"):  # calibrated on random tokens
        kw = dict(
            dataset=Dataset.from_dict({"input_ids": [x.tolist() for x in _calibration(8)]}),
            num_calibration_samples=8,
            max_seq_length=32,
        )
    oneshot(model=model, recipe=recipe, **kw)
    model.save_pretrained(out, save_compressed=True)


def _set_weight(modules: dict, name: str, w) -> None:
    """Copies a checkpoint Linear's dense weight w [out, in] into HF's in-memory model (modules: named_modules())."""
    modules[name].weight.copy_(w)


def _stored(out: str) -> dict:
    from safetensors import safe_open

    stored = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(out, f), "pt") as h:
                stored.update({k: h.get_tensor(k) for k in h.keys()})
    return stored


def _ct_decompressed(out: str, src_model):
    """src_model with out's Linear weights decompressed by compressed-tensors' own compressor of the checkpoint's
    format (weight-only schemes: the model then runs as HF's float32 model)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group.get("input_activations") is None, "activations are quantized in HF's forward only"
    scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))
    compressor = BaseCompressor.get_value_from_registry(group.get("format") or qc["format"])
    stored = _stored(out)
    plain = {k: v.float() for k, v in stored.items() if k in src_model.state_dict()}
    src_model.load_state_dict(plain, strict=False)
    dense = dict(src_model.named_modules())
    with torch.no_grad():
        for name in sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale")}):
            state = {k[len(name) + 1 :]: v for k, v in stored.items() if k.startswith(name + ".")}
            _set_weight(dense, name, compressor.decompress(state, scheme)["weight"].float())
    return src_model


def _rows_as_tokens(model):
    """compressed-tensors' dynamic per-token activation scales reduce over the axes after the first two ([batch, seq,
    hidden] inputs): the 2D [tokens, hidden] inputs of HF's MoE blocks (their experts and shared expert) get one scale
    per element, i.e. are not quantized at all, where vLLM quantizes each token's row. The model's activation-quantized
    Linears see 2D inputs as [1, tokens, hidden] instead; 3D inputs (every dense model's) are untouched."""

    def as_3d(mod, args):
        mod._rows = args[0].ndim == 2
        return (args[0][None], *args[1:]) if mod._rows else None

    def as_2d(mod, args, out):
        return out[0] if mod._rows else None

    for mod in model.modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is not None and scheme.input_activations is not None and scheme.input_activations.dynamic:
            mod.register_forward_pre_hook(as_3d)
            mod.register_forward_hook(as_2d)
    return model


def _dense_reference(out: str, job: dict, src_model):
    """HF's float32 model with the library's own dequantization of out's linears."""
    import torch
    from transformers import AutoModelForCausalLM

    if job["tool"] == "llmcompressor":
        if not job.get("hf", True):
            return _ct_decompressed(out, src_model)
        return _rows_as_tokens(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval())
    stored = _stored(out)
    dense = dict(src_model.named_modules())
    with torch.no_grad():
        # The checkpoint's own unquantized tensors (AWQ folds its scales into the norms; the tools store bf16/fp16).
        plain = {k: v.float() for k, v in stored.items() if k in src_model.state_dict()}
        src_model.load_state_dict(plain, strict=False)
        if job.get("method") == "awq":
            from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

            for name in {k.rsplit(".", 1)[0] for k in stored if k.endswith(".qweight")}:
                w = dequantize_gemm(
                    stored[f"{name}.qweight"],
                    stored[f"{name}.qzeros"],
                    stored[f"{name}.scales"].float(),
                    4,
                    job["group_size"],
                )  # [in, out]
                _set_weight(dense, name, w.T)
            return src_model
        qmodel = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16, device_map="cpu")
        for name, mod in qmodel.named_modules():
            if hasattr(mod, "dequantize_weight") and f"{name}.scales" in stored:
                mod.scales = stored[f"{name}.scales"].float()  # the file's fp16 scales, dequantized in float32
                _set_weight(dense, name, mod.dequantize_weight().float().T)  # gptqmodel's is [in, out]
    return src_model


def _tiny(out_root: str, job: dict) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from tests import tiny_models
    from tests.tiny_models import save_tiny_tokenizer

    if job["arch"] in tiny_models.MOE_ARCHS:
        _defuse(job["arch"])
    common = dict(tiny_models._COMMON)
    try:
        tiny_models._COMMON.update(job.get("overrides", {}))  # e.g. AWQ's clip search: output dims multiples of 64
        src_model = tiny_models.make_hf_model(job["arch"], seed=job.get("seed", 0))
    finally:
        tiny_models._COMMON.clear()
        tiny_models._COMMON.update(common)
    out = os.path.join(out_root, job["name"])
    src = os.path.join(out_root, f".src-{job['name']}")
    # Baichuan's stand-in is a Llama (tests/tiny_models.py): the tools quantize it in Llama's layout
    tiny_models.save_checkpoint(src_model, "llama" if job["arch"].startswith("baichuan") else job["arch"], src)
    save_tiny_tokenizer(src, src_model.config.vocab_size)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(src, "config.json"), "w") as f:  # gptqmodel's default pad id for Qwen2 (151643) is
        json.dump(dict(cfg, pad_token_id=0), f)  # outside the tiny vocabulary
    with torch.no_grad():
        src_logits = src_model(torch.tensor([PROMPT])).logits[0].float().numpy()
    {"gptqmodel": _gptqmodel, "llmcompressor": _llmcompressor}[job["tool"]](src, out, job)
    save_tiny_tokenizer(out, src_model.config.vocab_size)
    hf_logits = np.zeros((0,), np.float32)
    if job.get("hf", True):
        hf = _rows_as_tokens(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, device_map="cpu").eval())
        with torch.no_grad():
            hf_logits = hf(torch.tensor([PROMPT])).logits[0].float().numpy()
        del hf
    ref = _dense_reference(out, job, src_model)
    ref.generation_config.eos_token_id = None
    greedy = {}
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            y = ref.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            greedy[f"dense_{i}"] = y[0, len(p) :].numpy()
        dense_logits = ref(torch.tensor([PROMPT])).logits[0].float().numpy()
    if job["arch"].startswith("baichuan"):  # the tools quantize the Llama stand-in; ship Baichuan's layout
        _to_baichuan(out, job["arch"])
    if job.get("hub_names"):
        _to_mixtral_hub_names(out)
    np.savez(
        os.path.join(out, "refs.npz"), hf_logits=hf_logits, dense_logits=dense_logits, src_logits=src_logits, **greedy
    )


def _defuse(arch: str) -> None:
    """transformers 5 keeps a MoE layer's experts as two 3D parameters; the checkpoints (and vLLM) have one Linear per
    expert. gptqmodel's defuser makes HF build them as Linears (for this process, as gptqmodel does when it loads a
    MoE model): both tools then quantize per-expert Linears, and HF's own integrations load the quantized experts and
    run them as they run any quantized Linear (compressed-tensors with its activation quantization), which its fused
    experts do not (it would concatenate the raw fp8 / int8 tensors)."""
    from defuser import replace_fused_blocks

    from tests.tiny_models import hf_config

    replace_fused_blocks(hf_config(arch).model_type)


def _to_mixtral_hub_names(out: str) -> None:
    """A quantized Mixtral as the Hub's checkpoints name it (block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1 /
    w3 / w2, as TheBloke's GPTQ exports and vLLM's loader do), where the tools of transformers 5 write mlp.gate and
    mlp.experts.{e}.gate_proj / up_proj / down_proj."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(out, "model.safetensors")
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def hub(name: str) -> str:
        name = re.sub(r"\.mlp\.(experts|gate)\.", r".block_sparse_moe.\1.", name)
        return re.sub(r"(\.experts\.\d+)\.(gate_proj|up_proj|down_proj)\.", lambda m: f"{m[1]}.{names[m[2]]}.", name)

    state = load_file(path)
    save_file({hub(k): v for k, v in state.items()}, path, metadata={"format": "pt"})


def _demo(out_root: str, job: dict) -> None:
    """The demo model (bfloat16 HF folder of jaxllm.demo) quantized by gptqmodel, calibrated on chat turns."""
    import torch
    from transformers import AutoTokenizer

    from jaxllm.demo import demo_model_path

    torch.set_num_threads(1)  # GPTQ's column loop runs small ops: intra-op threads cost CPU (40 s -> 34 s)
    src = demo_model_path()
    tok = AutoTokenizer.from_pretrained(src)
    calib = [
        tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=False)
        for q, a in DEMO_CALIBRATION
    ]
    calib = [tok(text, return_tensors="pt")["input_ids"][0] for text in calib]
    _gptqmodel(src, os.path.join(out_root, job["name"]), job, calib)


def _to_baichuan(out: str, arch: str) -> None:
    """The quantized Llama stand-in of tests/tiny_models.py as Baichuan's checkpoint: q/k/v's quantized tensors
    concatenated into W_pack's along their output dim, Baichuan's config (quantization_config kept)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        for suffix in ("qweight", "qzeros", "scales"):  # GPTQ: output is the last dim of all three
            state[p + "W_pack." + suffix] = torch.cat([state.pop(p + f"{n}_proj.{suffix}") for n in "qkv"], dim=-1)
        g = [state.pop(p + f"{n}_proj.g_idx") for n in "qkv" if p + f"{n}_proj.g_idx" in state]
        if g:
            state[p + "W_pack.g_idx"] = g[0]
    save_file(state, path)
    bc = dict(
        architectures=["BaiChuanForCausalLM"],
        model_type="baichuan",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        rms_norm_eps=cfg["rms_norm_eps"],
        hidden_act="silu",
        torch_dtype="float16",
        max_position_embeddings=cfg["max_position_embeddings"],
        quantization_config=cfg["quantization_config"],
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(bc, f)


def run(out_root: str, jobs: list[dict]) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for job in jobs:
        t0 = time.perf_counter()
        (_demo if job["arch"] == "demo" else _tiny)(out_root, job)
        print(f"quant_producers: {job['name']} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        run(sys.argv[1], json.load(f))
