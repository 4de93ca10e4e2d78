"""Multi-LoRA serving: PEFT adapters applied per token inside the compiled step (vLLM's --enable-lora).

request.py   LoRARequest (vLLM's class: from jaxllm.lora.request import LoRARequest)
config.py    LoRAConfig, the engine's LoRA options, validated when the engine arguments are read
peft.py      a PEFT adapter folder -> LoRAAdapter (host arrays in the decoder's layout), refusals naming the field
ops.py       the batched LoRA matmul (every token its own adapter) and its pure-jnp per-token reference
slots.py     device slots (max_loras) with LRU swapping from host memory (max_cpu_loras)
"""
