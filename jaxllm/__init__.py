"""jaxllm: vLLM's v1 inference engine on JAX/XLA."""
import os

# jaxllm uses transformers for tokenizers only; its "PyTorch was not found" advice is noise here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxllm.config import EngineArgs  # noqa: E402
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.engine.exceptions import EngineDeadError
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.entrypoints.llm import LLM
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "AsyncLLM", "EngineDeadError", "EngineArgs", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
