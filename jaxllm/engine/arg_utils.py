"""vLLM's vllm.engine.arg_utils names: EngineArgs, and AsyncEngineArgs (the same arguments: jaxllm's async engine
takes EngineArgs)."""

from jaxllm.engine.args import EngineArgs

AsyncEngineArgs = EngineArgs

__all__ = ["EngineArgs", "AsyncEngineArgs"]
