"""PoolingParams: vLLM's per-request settings of a pooling (embedding) request, and the pooler a model runs with.

jaxllm pools decoder models' last token (vLLM's LAST pooling, what decoder embedding models such as
Qwen3-Embedding, gte-Qwen2 and e5-mistral use): the final-normed hidden state of the prompt's last token, then
optionally truncated to `dimensions` (Matryoshka models) and L2-normalized.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from jaxllm.sampling_params import ParameterError


@dataclass
class PoolingParams:
    """dimensions: keep the first k values (models trained for it: config's is_matryoshka /
    matryoshka_dimensions); normalize: L2-normalize (default: the model's pooler, normally True);
    truncate_prompt_tokens: keep the prompt's last k tokens (-1: the context's length)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None  # "embed" (the only pooling task jaxllm runs)

    def verify(self, hidden_size: int, matryoshka: list[int] | bool | None) -> None:
        if self.task not in (None, "embed"):
            raise ParameterError(f"Pooling task {self.task!r} is not supported: jaxllm runs 'embed'.", parameter="task")
        if self.dimensions is None:
            return
        if not matryoshka:
            raise ParameterError(
                f"Model does not support matryoshka representation, changing output dimensions will lead to poor "
                f"results (dimensions={self.dimensions}).",
                parameter="dimensions",
            )
        if isinstance(matryoshka, list) and self.dimensions not in matryoshka:
            raise ParameterError(
                f"Model only supports {matryoshka} matryoshka dimensions, use other output dimensions will lead to "
                "poor results.",
                parameter="dimensions",
            )
        if not 1 <= self.dimensions <= hidden_size:
            raise ParameterError(
                f"Dimensions must be greater than 0 and less than or equal to {hidden_size}, got {self.dimensions}.",
                parameter="dimensions",
            )


@dataclass
class PoolerConfig:
    """How a pooling model turns its hidden states into an embedding (vLLM's pooler_config): LAST pooling,
    normalized unless the model's sentence-transformers config or pooler_config says otherwise."""

    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka: list[int] | bool | None = None  # config.json's matryoshka_dimensions / is_matryoshka

    @classmethod
    def resolve(cls, model_dir: str | None, override: dict | str | None, hf: dict | None = None) -> PoolerConfig:
        """The model folder's sentence-transformers modules (modules.json: its Pooling module's mode and whether a
        Normalize module follows), then pooler_config's keys over them. Only LAST pooling runs here."""
        hf = hf or {}
        fields: dict[str, Any] = {"matryoshka": hf.get("matryoshka_dimensions") or hf.get("is_matryoshka")}
        if model_dir and os.path.isfile(os.path.join(model_dir, "modules.json")):
            with open(os.path.join(model_dir, "modules.json")) as f:
                modules = json.load(f)
            types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
            fields["normalize"] = any(t.endswith("Normalize") for t in types)
            pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
            path = os.path.join(model_dir, str(pooling.get("path", "")), "config.json") if pooling else ""
            if path and os.path.isfile(path):
                with open(path) as f:
                    st = json.load(f)
                modes = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN"}
                modes |= {"pooling_mode_cls_token": "CLS", "pooling_mode_max_tokens": "MAX"}
                on = [v for k, v in modes.items() if st.get(k)]
                if on:
                    fields["pooling_type"] = on[0]
        if isinstance(override, str):
            override = json.loads(override)
        for key, value in (override or {}).items():
            if key not in ("pooling_type", "normalize"):
                raise ValueError(f"pooler_config.{key} is not supported (pooling_type and normalize are).")
            fields[key] = value.upper() if key == "pooling_type" and isinstance(value, str) else value
        config = cls(**fields)
        if config.pooling_type != "LAST":
            raise ValueError(
                f"Pooling type {config.pooling_type} is not supported: jaxllm pools a decoder model's last token "
                "(LAST, as decoder embedding models do)."
            )
        return config
