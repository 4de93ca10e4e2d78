"""jaxllm: vLLM's serving engine on JAX/XLA.

    from jaxllm import LLM, SamplingParams

Heavy modules (jax, the engine) load on first use, so `import jaxllm` stays cheap.
"""

from jaxllm.inputs import PromptType, TextPrompt, TokensPrompt
from jaxllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "AsyncEngineArgs",
    "SamplingParams",
    "BeamSearchParams",
    "PoolingParams",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "TextPrompt",
    "TokensPrompt",
    "PromptType",
    "__version__",
]


def __getattr__(name):
    if name == "LLM":
        from jaxllm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxllm.engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from jaxllm.engine import arg_utils

        return getattr(arg_utils, name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
