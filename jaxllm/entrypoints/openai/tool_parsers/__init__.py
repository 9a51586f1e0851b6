"""Tool parsers (`jaxllm serve --tool-call-parser NAME`, vLLM's names): each reads one model
family's tool calls out of its output, a piece at a time (base.py)."""
from jaxllm.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolParser
from jaxllm.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from jaxllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from jaxllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from jaxllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,  # also Qwen2.5's and Qwen3's format
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}

__all__ = ["TOOL_PARSERS", "ToolParser", "ParsedDelta", "ToolCallDelta", "NamedToolParser", "RequiredToolParser"]
