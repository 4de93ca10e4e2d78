"""Quantized checkpoints -> the canonical QuantizedWeight layout of jaxllm/models/quant.py.

Each format's tensors of one HF Linear are read into a plain per-linear form, output on the last axis:
    q [I, O] ints in [0, 2**bits) (or fp8 values), scales [ng, O] float32, zeros [ng, O] | None, g_idx [I] | None,
    act_scale (float | None)
then the linears fused into one of our weights (q/k/v, gate/up) are joined by the dense loader's own hooks (they
take torch-layout [O, *] arrays), and q is packed. check() reads only the files' headers: every quantized tensor
present, with the shape and dtype the config implies, so a bad checkpoint fails before any weight is read.

Tensors per Linear `m` (I input features, O outputs, ng groups, pf = 32 // bits):
    gptq                m.qweight int32 [I/pf, O] (along I, LSB first), m.qzeros int32 [ng, O/pf] (v1: zero - 1),
                        m.scales [ng, O], m.g_idx int32 [I] (optional unless desc_act)
    awq (GEMM)          m.qweight int32 [I, O/8], m.qzeros int32 [ng, O/8] (along O, nibble order 0 2 4 6 1 3 5 7),
                        m.scales [ng, O]
    compressed-tensors  pack-quantized: m.weight_packed int32 [O, I/pf] (signed values + 2**(bits-1)),
                        m.weight_scale [O, ng], m.weight_zero_point int32 [O/pf, ng] (asym), m.weight_g_idx [I]
                        (legacy actorder); int-quantized: m.weight int8 [O, I], m.weight_scale [O, 1];
                        float-quantized: m.weight fp8 [O, I], m.weight_scale [] / [1] / [O, 1], m.input_scale (static)
    fp8                 m.weight fp8 [O, I], m.weight_scale [] / [1], m.input_scale (static); or, not serialized
                        (quantization="fp8"), m.weight in 16 bits, quantized here per tensor as vLLM does
"""

from __future__ import annotations

import math
import os

import ml_dtypes
import numpy as np

from jaxllm.models.quant import EXPERT_LINEARS, FP8_MAX, QUANT_LINEARS, hf_modules, pack_int, quantized_keys
from kernels_pallas.qlayout import act_order_perm

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def linear_shape(cfg, module: str) -> tuple[int, int]:
    """(in_features, out_features) of an HF Linear of a decoder layer (an expert's, a shared expert's too)."""
    D, NH, KH, F = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    if ".experts." in module:
        F = cfg.moe.intermediate_size
    elif ".shared_expert." in module:
        F = cfg.moe.shared_intermediate_size
    leaf = module.rsplit(".", 1)[-1]
    return {
        "q_proj": (D, NH),
        "k_proj": (D, KH),
        "v_proj": (D, KH),
        "W_pack": (D, 3 * NH),
        "o_proj": (NH, D),
        "gate_proj": (D, F),
        "up_proj": (D, F),
        "down_proj": (F, D),
        "w1": (D, F),
        "w3": (D, F),
        "w2": (F, D),
    }[leaf]


def _unpack(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their 32 // bits values (LSB first), unpacked along axis."""
    pf = 32 // bits
    w = np.moveaxis(x.view(np.uint32), axis, -1)
    q = (w[..., None] >> (np.arange(pf, dtype=np.uint32) * bits)) & ((1 << bits) - 1)
    return np.moveaxis(q.reshape(*w.shape[:-1], w.shape[-1] * pf), -1, axis).astype(np.int32)


class QuantLoader:
    """Reads the quantized linears of a checkpoint (a checkpoint_files.CheckpointReader) for cfg (a ModelConfig)."""

    def __init__(self, reader, cfg, dense_table: dict):
        self.reader, self.cfg, self.q = reader, cfg, cfg.quantization
        self.dense_table = dense_table
        self.keys = {(i, k) for i in range(cfg.num_layers) for k in quantized_keys(cfg, i)}
        self._fused: dict = {}

    # --- names and checks ---------------------------------------------------------------------------------------
    def tensors(self, module: str) -> dict[str, tuple[tuple[int, ...] | None, tuple[str, ...]]]:
        """name -> (expected shape or None (any), allowed dtypes) of module's tensors; optional ones end in '?'."""
        q, (I, O) = self.q, linear_shape(self.cfg, module)
        pf, ng = q.pack_factor, 1 if q.group_size == -1 else I // q.group_size
        scale_dtypes = ("float16", "bfloat16", "float32")
        if not q.serialized:
            return {"weight": ((O, I), scale_dtypes)}
        if q.method == "gptq":
            t = {
                "qweight": ((I // pf, O), ("int32",)),
                "scales": ((ng, O), scale_dtypes),
                "qzeros": ((ng, O // pf), ("int32",)),
                "g_idx" + ("" if q.act_order else "?"): ((I,), ("int32",)),
            }
            return t
        if q.method == "awq":
            return {
                "qweight": ((I, O // pf), ("int32",)),
                "scales": ((ng, O), scale_dtypes),
                "qzeros" + ("?" if q.symmetric else ""): ((ng, O // pf), ("int32",)),
            }
        if q.weight_type == "float":
            t = {"weight": ((O, I), ("float8_e4m3fn",)), "weight_scale": (None, ("float32", *scale_dtypes))}
            if q.activations == "static":
                t["input_scale"] = (None, ("float32", *scale_dtypes))
            return t
        if q.method == "compressed-tensors" and q.activations is None:  # pack-quantized W4A16 / W8A16
            t = {
                "weight_packed": ((O, I // pf), ("int32",)),
                "weight_scale": ((O, ng), scale_dtypes),
                "weight_shape?": ((2,), ("int64", "int32")),
            }
            if not q.symmetric:
                t["weight_zero_point"] = ((O // pf, ng), ("int32",))
            if q.act_order:
                t["weight_g_idx?"] = ((I,), ("int32",))
            return t
        return {"weight": ((O, I), ("int8",)), "weight_scale": ((O, 1), scale_dtypes)}  # int-quantized W8A8

    def module_names(self):
        for i, key in sorted(self.keys):
            for m in hf_modules(self.cfg, key):
                yield f"model.layers.{i}.{m}"

    def tensor_names(self) -> set[str]:
        """Every checkpoint tensor the quantized linears read (for the loader's unused-tensor check)."""
        return {f"{m}.{n.rstrip('?')}" for m in self.module_names() for n in self.tensors(m)}

    def check(self) -> None:
        """ValueError naming the config field and the file when a quantized linear's tensors are missing or do not
        have the shape / dtype the config implies; reads headers only."""
        q, r = self.q, self.reader
        for module in self.module_names():
            for name, (shape, dtypes) in self.tensors(module).items():
                full = f"{module}.{name.rstrip('?')}"
                if full not in r:
                    if name.endswith("?"):
                        continue
                    dense = f"{module}.weight" in r and full != f"{module}.weight"
                    raise ValueError(
                        f"Checkpoint is missing tensor {full!r}, which {q.describe()} ({q.source} in "
                        f"{self._config_file()}) needs"
                        + (
                            f"; {module}.weight is there unquantized, so the config does not belong to these weights."
                            if dense
                            else "."
                        )
                    )
                got, dtype = tuple(r.shape(full)), r.dtype(full)
                if shape is not None and got != shape:
                    raise ValueError(
                        f"Tensor {full!r} in {r.file_of(full)} has shape {got}, but {q.source} in "
                        f"{self._config_file()} ({self._fields()}) implies {shape}; the config does not "
                        "describe these weights."
                    )
                if dtype not in dtypes:
                    raise ValueError(
                        f"Tensor {full!r} in {r.file_of(full)} has dtype {dtype}, but {q.describe()} "
                        f"({q.source}) stores it as {' or '.join(dtypes)}."
                    )
                if (
                    name.startswith("weight_scale")
                    and q.weight_type == "float"
                    and math.prod(got) not in (1, linear_shape(self.cfg, module)[1])
                ):
                    raise ValueError(
                        f"Tensor {full!r} in {r.file_of(full)} has shape {got}: fp8 weight scales must be "
                        "per tensor or per output channel."
                    )

    def _config_file(self) -> str:
        folder = os.path.dirname(self.reader.files[0]) if self.reader.files else "."
        return os.path.join(folder, "config.json" if self.q.source.startswith("config.json") else self.q.source)

    def _fields(self) -> str:
        q = self.q
        if q.weight_type == "float":
            return f"fp8, activations={q.activations}"
        return f"bits={q.bits}, group_size={q.group_size}"

    # --- reading --------------------------------------------------------------------------------------------------
    def owns(self, key: tuple) -> bool:
        return len(key) == 4 and key[0] == "layers" and (key[1], key[2]) in self.keys

    def get(self, key: tuple) -> np.ndarray:
        """Host array of one leaf (("layers", i, name, field)) in the checkpoint layout (kv heads not repeated)."""
        parent = key[:3]
        if parent not in self._fused:  # one fused weight in memory at a time
            read = self._read_experts if key[2] in EXPERT_LINEARS else self._read_fused
            self._fused = {parent: read(key[1], key[2])}
        return self._fused[parent][key[3]]

    def _read_experts(self, layer: int, key: str) -> dict:
        """A MoE layer's experts (moe_quant.py's layout): each expert's linears read, fused and packed on their own
        (one expert's integers unpacked at a time), then stacked on E; rows stay in the checkpoint's order."""
        q, E = self.q, self.cfg.moe.num_experts
        modules = [f"model.layers.{layer}.{m}" for m in hf_modules(self.cfg, key)]
        per_expert = [modules[e::E] for e in range(E)]  # gate_up: (gate, up) of expert e; down: (down,)

        def join(parts, field):  # [rows, O_m] per linear -> [rows, 2, F] (gate, up) or [rows, D]
            xs = [p[field] for p in parts]
            return np.stack(xs, axis=1) if len(xs) > 1 else xs[0]

        experts = []
        for names in per_expert:
            parts = [self._read_linear(m) for m in names]
            out = {"scales": join(parts, "scales")}
            if q.weight_type == "float":
                out["packed"] = join(parts, "q").astype(_FP8)
                if q.activations == "static":
                    out["act_scale"] = max(p["act_scale"] for p in parts)
            else:
                out["packed"] = pack_int(join(parts, "q"), q.bits)
                if not q.symmetric:
                    out["zeros"] = join(parts, "zeros")
                if q.act_order:
                    ng = parts[0]["scales"].shape[0]
                    for m, p in zip(names, parts, strict=True):
                        if p["g_idx"].min(initial=0) < 0 or p["g_idx"].max(initial=0) >= ng:
                            raise ValueError(f"{m}: g_idx names groups outside [0, {ng}).")
                    out["g_idx"] = join(parts, "g_idx").astype(np.int32)
            experts.append(out)
        fused = {f: np.stack([x[f] for x in experts]) for f in experts[0] if f != "act_scale"}
        if "zeros" in fused:
            fused["zeros"] = fused["zeros"].astype(np.uint8)
        if q.activations == "static" and q.weight_type == "float":  # one scale for all experts (vLLM: the max)
            fused["act_scale"] = np.asarray(max(x["act_scale"] for x in experts), np.float32)
        return fused

    def _read_fused(self, layer: int, key: str) -> dict:
        modules = [f"model.layers.{layer}.{m}" for m in hf_modules(self.cfg, key)]
        parts = [self._read_linear(m) for m in modules]
        hook = self.dense_table[("layers", layer, key)][1]
        if key == "wo":  # the dense hook splits heads; the quantized weight keeps its input flat: [N * H, D]
            hook = _transpose

        def fuse(field):  # [rows, O_m] per linear -> [rows, *O] through the dense hook (torch layout: [O_m, rows])
            return hook(*[p[field].T for p in parts], self.cfg)

        out = {"scales": fuse("scales")}
        q = self.q
        if q.weight_type == "float":
            out["packed"] = fuse("q").astype(_FP8)
            if q.activations == "static":
                out["act_scale"] = np.asarray(max(p["act_scale"] for p in parts), np.float32)
            return out
        values = fuse("q")
        if not q.symmetric:
            out["zeros"] = fuse("zeros").astype(np.uint8)
        if q.act_order:
            g = [p["g_idx"] for p in parts]
            if any(not np.array_equal(g[0], x) for x in g[1:]):
                raise ValueError(
                    f"{', '.join(modules)} have different g_idx; jaxllm fuses them into one weight and "
                    "needs one act-order permutation for them."
                )
            values, out["perm"] = _sort_by_group(values, g[0], q.group_size, modules)
        out["packed"] = pack_int(values, q.bits)
        return out

    def _read_linear(self, module: str) -> dict:
        q, get = self.q, lambda n: self.reader.get(f"{module}.{n}")
        I, O = linear_shape(self.cfg, module)
        ng = 1 if q.group_size == -1 else I // q.group_size
        if not q.serialized:  # vLLM's dynamic fp8: one scale per tensor
            w = get("weight").astype(np.float32)
            scale = max(float(np.abs(w).max()), 1e-12) / FP8_MAX
            return {
                "q": np.clip(w.T / scale, -FP8_MAX, FP8_MAX).astype(_FP8),
                "scales": np.full((1, O), scale, np.float32),
            }
        if q.weight_type == "float":
            s = get("weight_scale").astype(np.float32).reshape(-1)
            out = {"q": get("weight").T, "scales": np.broadcast_to(s.reshape(1, -1), (1, O)).copy()}
            if q.activations == "static":
                out["act_scale"] = float(np.max(get("input_scale").astype(np.float32)))
            return out
        half = 1 << (q.bits - 1)
        if q.method == "gptq":
            out = {"q": _unpack(get("qweight"), q.bits, 0), "scales": get("scales").astype(np.float32)}
            if not q.symmetric:
                out["zeros"] = _unpack(get("qzeros"), q.bits, 1) + q.zero_offset
            g_name = f"{module}.g_idx"
            if q.act_order:
                out["g_idx"] = get("g_idx")
            elif g_name in self.reader and not np.array_equal(self.reader.get(g_name), np.arange(I) // (I // ng)):
                raise ValueError(
                    f"Tensor {g_name!r} in {self.reader.file_of(g_name)} orders the input rows "
                    f"(act-order), but {q.source} has desc_act=false."
                )
            return out
        if q.method == "awq":
            out = {
                "q": _unpack(get("qweight"), 4, 1).reshape(I, O // 8, 8)[..., np.argsort(AWQ_ORDER)].reshape(I, O),
                "scales": get("scales").astype(np.float32),
            }
            if not q.symmetric:
                z = _unpack(get("qzeros"), 4, 1).reshape(ng, O // 8, 8)[..., np.argsort(AWQ_ORDER)]
                out["zeros"] = z.reshape(ng, O)
            return out
        if q.activations is None:  # compressed-tensors pack-quantized: signed values stored + 2**(bits - 1)
            out = {"q": _unpack(get("weight_packed"), q.bits, 1).T, "scales": get("weight_scale").astype(np.float32).T}
            if not q.symmetric:  # packed the same way, along the output dim
                out["zeros"] = _unpack(get("weight_zero_point"), q.bits, 0).T
            if q.act_order:
                out["g_idx"] = (
                    get("weight_g_idx") if f"{module}.weight_g_idx" in self.reader else np.arange(I) // (I // ng)
                )
            return out
        # compressed-tensors int-quantized (INT8 W8A8): signed int8, zero 0 -> unsigned with zero 128
        return {"q": get("weight").astype(np.int32).T + half, "scales": get("weight_scale").astype(np.float32).T}


def _sort_by_group(values: np.ndarray, g_idx: np.ndarray, group_size: int, modules) -> tuple[np.ndarray, np.ndarray]:
    """Act-order rows sorted by their group once (quant.py: stored row i is checkpoint row perm[i])."""
    try:
        perm = act_order_perm(g_idx, group_size)
    except ValueError as e:
        raise ValueError(f"{', '.join(modules)}: {e}.") from None
    perm = np.arange(len(g_idx), dtype=np.int32) if perm is None else perm
    return values[perm], perm


def _transpose(x, cfg):
    return x.T


__all__ = ["QuantLoader", "QUANT_LINEARS", "linear_shape"]
