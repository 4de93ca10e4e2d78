"""Tiny quantized checkpoints written by the public quantizers, and HF transformers' answers on them.

Run as a subprocess (`python -m tests.quant_producers OUT JOBS_JSON`): gptqmodel and llm-compressor patch torch /
transformers at import and start thread pools, which the test process must not inherit. Each job
    {"name", "arch", "tool": "gptqmodel" | "llmcompressor", "seed", ...tool options}
writes OUT/name (the quantized HF folder, with the tiny tokenizer) and OUT/name/refs.npz:
    hf_logits  [len(PROMPT), V]  HF transformers loading the folder with its own integration (gptqmodel's kernels for
                                 GPTQ / AWQ, compressed-tensors' decompression), float32
    dense_*    greedy tokens of HF's float32 model whose Linear weights are the library's own dequantization of the
               checkpoint (gptqmodel's dequantize_weight with the file's scales in float32; compressed-tensors'
               decompression), for the prompts of PROMPTS
Producers used: gptqmodel (GPTQ: real GPTQ passes over random calibration tokens; AWQ: its AWQ pass, GEMM
layout) and llm-compressor (its oneshot QuantizationModifier / GPTQModifier writing compressed-tensors).
"""

from __future__ import annotations

import json
import os
import sys

PROMPT = [5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79]
PROMPTS = [[5, 9, 2, 77, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 3, 83, 27], [101, 7], [8] * 19, [3],
           [7, 21, 3, 99, 14, 5, 61, 33, 48, 2, 17, 85, 40, 12, 6, 90, 71, 25, 58, 9, 1, 2],
           [7, 21, 3, 99, 14, 5, 61, 33, 48, 2, 17, 85, 40, 12, 6, 90, 71, 25, 58, 9, 3]]
MAX_TOKENS = 8


def _calibration(n=16, length=32, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (length,), generator=g) for _ in range(n)]


def _gptqmodel(src: str, out: str, job: dict) -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its default on 2 cores (1) is below its loader's 2
    import torch
    from gptqmodel import AWQConfig, GPTQModel, QuantizeConfig

    if job.get("method") == "awq":
        qc = AWQConfig(bits=4, group_size=job["group_size"], sym=not job.get("zero_point", True), format="gemm",
                       offload_to_disk=False)
    else:
        qc = QuantizeConfig(bits=job["bits"], group_size=job["group_size"], desc_act=job.get("desc_act", False),
                            sym=job.get("sym", True), format=job.get("format", "gptq"), offload_to_disk=False,
                            act_group_aware=False)  # its default reorders groups; needs group_size > 0
    model = GPTQModel.load(src, qc, device="cpu")
    calib = [{"input_ids": x[None], "attention_mask": torch.ones(1, len(x), dtype=torch.long)}
             for x in _calibration(job.get("calibration", 16))]
    # AWQ's automatic kernel choice wants CUDA; its torch kernel packs the same GEMM layout on CPU.
    model.quantize(calib, batch_size=1, **({"backend": "torch"} if job.get("method") == "awq" else {}))
    model.save(out)


def _llmcompressor(src: str, out: str, job: dict) -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    kw = {}
    if job.get("preset"):  # llm-compressor's named schemes: FP8, FP8_DYNAMIC, W8A8, ...
        recipe = QuantizationModifier(targets="Linear", scheme=job["preset"], ignore=["lm_head"])
    else:
        w = QuantizationArgs(num_bits=job["bits"], type="int", strategy=job["strategy"],
                             group_size=job.get("group_size"), symmetric=job.get("sym", True))
        recipe = QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=w)},
                                      ignore=["lm_head"])
    if job.get("preset") == "FP8":  # static activation scales: calibrated on random tokens
        from datasets import Dataset

        kw = dict(dataset=Dataset.from_dict({"input_ids": [x.tolist() for x in _calibration(8)]}),
                  num_calibration_samples=8, max_seq_length=32)
    oneshot(model=model, recipe=recipe, **kw)
    model.save_pretrained(out, save_compressed=True)


def _dense_reference(out: str, job: dict, src_model):
    """HF's float32 model with the library's own dequantization of out's linears."""
    import torch
    from safetensors import safe_open

    if job["tool"] == "llmcompressor":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    files = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".safetensors")]
    stored = {}
    for f in files:
        with safe_open(f, "pt") as h:
            stored.update({k: h.get_tensor(k) for k in h.keys()})
    dense = dict(src_model.named_modules())
    with torch.no_grad():
        # The checkpoint's own unquantized tensors (AWQ folds its scales into the norms; the tools store bf16/fp16).
        plain = {k: v.float() for k, v in stored.items() if k in src_model.state_dict()}
        src_model.load_state_dict(plain, strict=False)
        if job.get("method") == "awq":
            from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

            for name in {k.rsplit(".", 1)[0] for k in stored if k.endswith(".qweight")}:
                w = dequantize_gemm(stored[f"{name}.qweight"], stored[f"{name}.qzeros"],
                                    stored[f"{name}.scales"].float(), 4, job["group_size"])  # [in, out]
                dense[name].weight.copy_(w.T)
            return src_model
        from transformers import AutoModelForCausalLM

        qmodel = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16, device_map="cpu")
        for name, mod in qmodel.named_modules():
            if hasattr(mod, "dequantize_weight") and f"{name}.scales" in stored:
                mod.scales = stored[f"{name}.scales"].float()  # the file's fp16 scales, dequantized in float32
                dense[name].weight.copy_(mod.dequantize_weight().float().T)  # gptqmodel's is [in, out]
    return src_model


def run(out_root: str, jobs: list[dict]) -> None:
    import numpy as np
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests import tiny_models
    from tests.tiny_models import save_tiny_tokenizer

    common = dict(tiny_models._COMMON)
    for job in jobs:
        tiny_models._COMMON.clear()  # AWQ's clip search wants output dims that are multiples of 64: "overrides"
        tiny_models._COMMON.update(common, **job.get("overrides", {}))
        out = os.path.join(out_root, job["name"])
        src = os.path.join(out_root, f".src-{job['name']}")
        # Baichuan's stand-in is a Llama (tests/tiny_models.py): the tools quantize it in Llama's layout
        src_model = tiny_models.make_hf_model(job["arch"], seed=job.get("seed", 0))
        tiny_models.save_checkpoint(src_model, "llama" if job["arch"].startswith("baichuan") else job["arch"], src)
        save_tiny_tokenizer(src, src_model.config.vocab_size)
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(src, "config.json"), "w") as f:  # gptqmodel's default pad id for Qwen2 (151643) is
            json.dump(dict(cfg, pad_token_id=0), f)  # outside the tiny vocabulary
        {"gptqmodel": _gptqmodel, "llmcompressor": _llmcompressor}[job["tool"]](src, out, job)
        save_tiny_tokenizer(out, src_model.config.vocab_size)
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, device_map="cpu").eval()
        with torch.no_grad():
            hf_logits = hf(torch.tensor([PROMPT])).logits[0].float().numpy()
        ref = _dense_reference(out, job, src_model)
        ref.generation_config.eos_token_id = None
        greedy = {}
        with torch.no_grad():
            for i, p in enumerate(PROMPTS):
                y = ref.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
                greedy[f"dense_{i}"] = y[0, len(p):].numpy()
            dense_logits = ref(torch.tensor([PROMPT])).logits[0].float().numpy()
        if job["arch"].startswith("baichuan"):  # the tools quantize the Llama stand-in; ship Baichuan's layout
            _to_baichuan(out, job["arch"])
        np.savez(os.path.join(out, "refs.npz"), hf_logits=hf_logits, dense_logits=dense_logits, **greedy)


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
    bc = dict(architectures=["BaiChuanForCausalLM"], model_type="baichuan", vocab_size=cfg["vocab_size"],
              hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
              num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
              rms_norm_eps=cfg["rms_norm_eps"], hidden_act="silu", torch_dtype="float16",
              max_position_embeddings=cfg["max_position_embeddings"], quantization_config=cfg["quantization_config"])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(bc, f)


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        run(sys.argv[1], json.load(f))
