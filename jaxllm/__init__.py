"""jaxllm: vLLM's v1 inference engine on JAX/XLA."""
from jaxllm.config import EngineArgs
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.entrypoints.llm import LLM
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
