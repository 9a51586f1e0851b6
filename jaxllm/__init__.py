"""jaxllm: vLLM's v1 inference engine on JAX/XLA.

The names below load on first use, so `import jaxllm` costs next to nothing and a front end
loads only what it touches (the engine's model and kernel code run in the engine core's process).
"""
import importlib
import os

# jaxllm uses transformers for tokenizers only; its "PyTorch was not found" advice is noise here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

_EXPORTS = {
    "LLM": "jaxllm.entrypoints.llm", "LLMEngine": "jaxllm.engine.llm_engine", "AsyncLLM": "jaxllm.engine.async_llm",
    "EngineDeadError": "jaxllm.engine.exceptions", "EngineArgs": "jaxllm.config",
    "SamplingParams": "jaxllm.sampling_params", "RequestOutputKind": "jaxllm.sampling_params",
    "RequestOutput": "jaxllm.outputs", "CompletionOutput": "jaxllm.outputs",
    "PoolingParams": "jaxllm.pooling_params", "PoolingRequestOutput": "jaxllm.outputs",
    "EmbeddingRequestOutput": "jaxllm.outputs", "ScoringRequestOutput": "jaxllm.outputs",
    "LoRARequest": "jaxllm.lora.request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__():
    return sorted([*globals(), *__all__])
