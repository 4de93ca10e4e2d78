"""HF checkpoint (PyTorch .bin / safetensors) -> jaxllm Orbax checkpoint. Command: `jaxllm convert` (convert/cli.py;
also `python -m jaxllm.convert`).

The name mapping is the loader's table (jaxllm.models.loader.weight_table: HF name(s) + named hook per weight);
this package only adds writing: Orbax arrays, config, tokenizer, generation config and a manifest.
"""

from convert.hf_to_orbax import ConversionError, convert_checkpoint

__all__ = ["convert_checkpoint", "ConversionError"]
