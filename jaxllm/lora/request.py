"""LoRARequest: which adapter a request runs with (vLLM's class, fields and checks)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass


@dataclass
class LoRARequest:
    """An adapter for a request: lora_name (the served model name), lora_int_id (> 0, the engine's key for the
    adapter: one id, one adapter folder) and lora_path (a local PEFT adapter folder)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: str | None = None  # vLLM's deprecated name for lora_path
    long_lora_max_len: int | None = None  # accepted (vLLM's field); long-context LoRA is not supported
    base_model_name: str | None = None  # the served model it adapts (/v1/models' parent)
    tensorizer_config_dict: dict | None = None  # accepted (vLLM's field); must be None

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if self.lora_local_path:
            warnings.warn(
                "The 'lora_local_path' attribute is deprecated and will be removed in a future version. "
                "Please use 'lora_path' instead.",
                DeprecationWarning,
                stacklevel=2,
            )
            if not self.lora_path:
                self.lora_path = self.lora_local_path
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")
        if self.long_lora_max_len is not None:
            raise ValueError("long_lora_max_len: long-context LoRA adapters are not supported by jaxllm.")
        if self.tensorizer_config_dict is not None:
            raise ValueError("tensorizer_config_dict: tensorized LoRA adapters are not supported by jaxllm.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        return self.lora_path

    # vLLM: two requests are the same adapter when their names are
    def __eq__(self, other) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
