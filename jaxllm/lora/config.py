"""LoRAConfig: the engine's LoRA options (vLLM's names, defaults and accepted values), made once from EngineArgs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")
EXTRA_VOCAB_SIZES = (256, 512)


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    max_loras: int = 1  # adapters one step can run (device slots); the base model needs none
    max_lora_rank: int = 16  # slots are this wide; an adapter of a larger rank is refused
    max_cpu_loras: int | None = None  # adapters kept in host memory (LRU); None: max_loras
    lora_dtype: str = "auto"  # the slots' dtype; auto: the model's
    fully_sharded_loras: bool = False  # tp: also split the side of A / B that vLLM's default layout replicates
    lora_extra_vocab_size: int = 256  # deprecated in vLLM: adapters that add tokens are refused

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}, got {self.max_lora_rank}."
            )
        cpu = self.max_cpu_loras
        if cpu is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif isinstance(cpu, bool) or not isinstance(cpu, int):
            raise ValueError(f"max_cpu_loras must be an integer, got {cpu!r}.")
        elif cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({self.max_loras})")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}.")
        if self.lora_extra_vocab_size not in EXTRA_VOCAB_SIZES:
            raise ValueError(f"lora_extra_vocab_size must be 256 or 512, got {self.lora_extra_vocab_size!r}.")

    @classmethod
    def from_engine_args(cls, args) -> LoRAConfig | None:
        """None unless args.enable_lora. Only the options a user gave are passed on (vLLM warns about the
        deprecated lora_extra_vocab_size the same way)."""
        if not args.enable_lora:
            return None
        if args.lora_extra_vocab_size != 256:
            logger.warning(
                "lora_extra_vocab_size is deprecated (as in vLLM): adapters that add tokens to the "
                "vocabulary are refused whatever its value."
            )
        return cls(
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            lora_dtype=args.lora_dtype,
            fully_sharded_loras=args.fully_sharded_loras,
            lora_extra_vocab_size=args.lora_extra_vocab_size,
        )

    def dtype(self, model_dtype: str) -> str:
        return model_dtype if self.lora_dtype == "auto" else self.lora_dtype
