"""LLMEngine's LoRA methods (vLLM's add_lora / remove_lora / list_loras), mixed into LLMEngine: the adapters
themselves are kept by LoRASlots (slots.py, the engine's `lora`; None without enable_lora)."""

from __future__ import annotations


class EngineLoRAMethods:
    """Needs `lora` (LoRASlots or None) and `_requests` (request id -> a request with a `lora_id`)."""

    lora = None
    _requests: dict

    def add_lora(self, lora_request) -> bool:
        """Registers an adapter (read and checked now: ValueError naming the field); False if its id is known."""
        if self.lora is None:
            raise ValueError(
                f"Got lora_request {lora_request} but LoRA is not enabled! Start the engine with "
                "enable_lora=True (--enable-lora)."
            )
        return self.lora.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter; requests still running with it finish first (it is forgotten after the last)."""
        return self.lora is not None and self.lora.remove_when_unused(lora_id, self._loras_in_use())

    def list_loras(self) -> set[int]:
        return set() if self.lora is None else self.lora.listed()

    def _lora_of(self, lora_request) -> tuple[int, str | None]:
        """(lora_int_id, prefix-cache key) of a request's adapter ((0, None): the base model), registering
        (reading and checking) it when new."""
        if lora_request is None:
            return 0, None
        self.add_lora(lora_request)
        return lora_request.lora_int_id, self.lora.cache_key(lora_request.lora_int_id)

    def _loras_in_use(self) -> set[int]:
        return {req.lora_id for req in self._requests.values()}

    def _drop_removed_loras(self) -> None:
        """After each step: forgets the removed adapters no request uses any more."""
        if self.lora is not None and self.lora.removing:
            self.lora.drop_removed(self._loras_in_use())
