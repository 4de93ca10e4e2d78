"""Lazy, name -> numpy access to the tensors of an HF checkpoint directory: safetensors (single or sharded, read at
the header's offsets, fp8 and bfloat16 as ml_dtypes') and pytorch_model.bin (memory-mapped through torch, which is
only imported for them). jaxllm/models/loader.py maps the names onto the params pytree."""

from __future__ import annotations

import glob
import json
import os

import ml_dtypes
import numpy as np

from jaxllm.config import ModelConfig

LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy", "gguf")  # gguf: a .gguf file's converted folder
# A directory holding this file is a jaxllm (Orbax) checkpoint written by `python -m jaxllm.convert`.
MANIFEST = "jaxllm_manifest.json"


def is_jaxllm_checkpoint(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, MANIFEST))


class CheckpointReader:
    """Lazy name -> numpy access over the tensors of an HF checkpoint directory."""

    def __init__(self, model_dir: str | None, load_format: str = "auto", files: list[str] | None = None):
        self.files = _weight_files(model_dir, load_format) if files is None else files
        self._index: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        self._stored: dict[str, str] = {}  # a name the tables use -> the file's own (use_names_of)
        for path in self.files:
            try:
                names = list(self._open(path).keys())
            except Exception as e:  # noqa: BLE001 - truncated / corrupt files: name the file, not the parser
                raise ValueError(f"Cannot read weights from {path}: {type(e).__name__}: {e}") from None
            for name in names:
                self._index[name] = path

    @classmethod
    def for_files(cls, files: list[str]) -> CheckpointReader:
        """A reader of these files (e.g. a LoRA adapter's adapter_model.safetensors)."""
        return cls(None, files=files)

    def use_names_of(self, cfg: ModelConfig) -> None:
        """Renames the tensors that cfg's architecture also spells otherwise (CHECKPOINT_ALIASES) to the names
        the weight tables use; get / shape / dtype then read them under either name's file entry."""
        from jaxllm.models.moe import CHECKPOINT_ALIASES

        rules = CHECKPOINT_ALIASES.get(cfg.architecture, ())
        for name in list(self._index) if rules else ():
            alias = name
            for pattern, repl in rules:
                alias = pattern.sub(repl, alias)
            if alias != name and alias not in self._index:
                self._index[alias] = self._index.pop(name)
                self._stored[alias] = self._stored.pop(name, name)

    def _name(self, name: str) -> str:
        return self._stored.get(name, name)

    def _open(self, path: str):
        if path not in self._handles:
            if path.endswith(".safetensors"):
                self._handles[path] = _SafetensorsFile(path)
            else:
                self._handles[path] = _TorchFile(path)
        return self._handles[path]

    def keys(self) -> list[str]:
        return list(self._index)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def get(self, name: str) -> np.ndarray:
        return self._open(self._index[name]).get_tensor(self._name(name))

    def file_of(self, name: str) -> str:
        return self._index[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the file's header (safetensors) or its lazy storage (torch): no data read."""
        return tuple(self._open(self._index[name]).get_shape(self._name(name)))

    def dtype(self, name: str) -> str:
        """The tensor's dtype as numpy / ml_dtypes names it (int32, float16, bfloat16, float8_e4m3fn, ...)."""
        return self._open(self._index[name]).get_dtype(self._name(name))


class _SafetensorsFile:
    # safetensors' header dtype names -> numpy's (ml_dtypes' for bfloat16 and fp8)
    _DTYPES = {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U8": "uint8",
        "BOOL": "bool",
    }

    def __init__(self, path: str):
        from safetensors import safe_open

        self._path, self._file, self._header = path, safe_open(path, framework="numpy"), None

    def keys(self):
        return self._file.keys()

    def get_tensor(self, name: str) -> np.ndarray:
        dtype = self.get_dtype(name)
        if not dtype.startswith("float8"):
            return self._file.get_tensor(name)
        # safetensors' numpy backend has no fp8 dtypes: read the bytes at the header's offsets, view them as ml_dtypes'
        if self._header is None:
            with open(self._path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._header = (json.loads(f.read(n)), 8 + n)
        header, base = self._header
        lo, hi = header[name]["data_offsets"]
        raw = np.fromfile(self._path, np.uint8, count=hi - lo, offset=base + lo)
        return raw.view(getattr(ml_dtypes, dtype)).reshape(self.get_shape(name))

    def get_shape(self, name: str):
        return self._file.get_slice(name).get_shape()

    def get_dtype(self, name: str) -> str:
        d = self._file.get_slice(name).get_dtype()
        return self._DTYPES.get(d, d.lower())


class _TorchFile:
    def __init__(self, path: str):
        try:
            import torch
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError(
                f"Reading {path} needs PyTorch: pip install 'jaxllm[torch]' (or torch==2.13.0 for the CPU build)."
            ) from e
        self._torch = torch
        try:
            self._state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            # Files written by torch < 1.6 (or with _use_new_zipfile_serialization=False) cannot be mapped.
            self._state = torch.load(path, map_location="cpu", weights_only=True)

    def keys(self):
        return self._state.keys()

    def get_tensor(self, name: str) -> np.ndarray:
        t = self._state[name]
        if t.dtype == self._torch.bfloat16:
            return t.view(self._torch.int16).numpy().view(ml_dtypes.bfloat16)
        if t.dtype == self._torch.float8_e4m3fn:
            return t.view(self._torch.int8).numpy().view(ml_dtypes.float8_e4m3fn)
        return t.numpy()

    def get_shape(self, name: str):
        return tuple(self._state[name].shape)

    def get_dtype(self, name: str) -> str:
        return str(self._state[name].dtype).replace("torch.", "")


def _weight_files(model_dir: str, load_format: str) -> list[str]:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not one of {LOAD_FORMATS}.")
    if not os.path.isdir(model_dir):
        raise ValueError(f"Model directory {model_dir!r} does not exist.")
    patterns = {"safetensors": ["*.safetensors"], "pt": ["*.bin", "*.pt"]}
    order = (
        ["safetensors", "pt"] if load_format == "auto" else ["safetensors"] if load_format == "gguf" else [load_format]
    )
    for fmt in order:
        index = os.path.join(
            model_dir, "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
        )
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map.")
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not os.path.exists(os.path.join(model_dir, n))]
            if missing:
                raise ValueError(f"{index} lists shard files that are missing: {missing}.")
            return [os.path.join(model_dir, n) for n in names]
        files = sorted(
            f
            for p in patterns[fmt]
            for f in glob.glob(os.path.join(model_dir, p))
            if not os.path.basename(f).startswith("training_args")
        )
        if files:
            return files
    if is_jaxllm_checkpoint(model_dir):  # converted by `python -m jaxllm.convert`: Orbax, read by "auto" only
        raise ValueError(
            f"{model_dir} is a jaxllm (Orbax) checkpoint, not {load_format} weights; load it with "
            "load_format='auto' (--load-format auto, the default)."
        )
    raise ValueError(f"No weights (load_format={load_format!r}) found in {model_dir}.")
