"""The OpenAI API's request and response bodies, as pydantic models (OpenAI's field names,
plus vLLM's sampling extras that an OpenAI client sends through `extra_body`).

Requests forbid unknown fields, as OpenAI does: a misspelt `max_token` is a 400 that names
it, not a silent default. They are strict about types, as OpenAI is: `"n": true`, `"n": "2"`
and `"max_tokens": 2.0` are errors, not 1, 2 and 2. Every value has been checked before
(request_body.py: 64-bit integers, finite numbers, UTF-8 text, the prompt's shape).
"""
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt_field: ClassVar[str] = "prompt"  # the field request_body.py checks as prompts (token ids in bulk)


class Loose(BaseModel):
    """Responses: extra keys are allowed (none are made)."""
    model_config = ConfigDict(extra="allow")


class Sparse(Loose):
    """A stream's delta: fields left None are left out (a tool call's later pieces carry its
    index and arguments only, as vLLM's and OpenAI's do)."""

    @model_serializer(mode="wrap")
    def _without_nones(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


# ---- errors ----
class ErrorInfo(Loose):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(Loose):
    error: ErrorInfo


# ---- requests ----
class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class JsonSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` extra: exactly one constraint (see StructuredOutputsParams)."""
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class SamplingRequest(Strict):
    """What completions and chat requests share. A field left None takes the model's
    default sampling param (its generation_config.json), then SamplingParams'."""
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # JSON's keys are strings: token ids in decimal
    seed: int | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_ids_as_keys(cls, value):
        if not isinstance(value, dict):
            return value  # pydantic names the type error
        bad = [key[:24] for key in value if not (key.isascii() and key.isdigit() and int(key[:20]) < 2**63)]
        if bad:
            raise ValueError(f"keys must be token ids (integers in [0, 2**63), in decimal), got {bad[:5]!r}")
        return {int(key): bias for key, bias in value.items()}


class CompletionRequest(SamplingRequest):
    # A string, a list of strings, a list of token ids or a list of token-id lists, checked by
    # request_body.py before pydantic, which would take seconds over millions of ids.
    prompt: Any
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # only best_of == n: the engine has no beam of candidates to pick from


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments' object
    strict: bool | None = None


class ChatCompletionTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class MessageFunctionCall(Strict):
    name: str
    arguments: str  # a JSON object's text


class MessageToolCall(Strict):
    """A tool call of an earlier assistant message, as a response gave it."""
    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's answer to that call
    reasoning_content: str | None = None  # an assistant's thinking (reasoning: vLLM's newer name)
    reasoning: str | None = None


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatCompletionTool] | None = None  # with messages: rendered by the chat template
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(Strict):  # vLLM's /v1/load_lora_adapter
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(Strict):  # vLLM's /v1/unload_lora_adapter
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; the name alone says which


# ---- responses ----
class UsageInfo(Loose):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(Loose):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(Loose):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(Loose):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(Loose):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Loose):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(Loose):
    name: str
    arguments: str


class ToolCallOut(Loose):
    id: str
    type: str = "function"
    function: FunctionCallOut


class AssistantMessage(Loose):
    role: str = "assistant"
    content: str | None = None
    # The thinking, with a reasoning parser: under DeepSeek's name, which most clients read,
    # and vLLM's newer one.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = []


class ChatChoice(Loose):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Loose):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Sparse):
    index: int
    id: str | None = None  # the first piece of a call: its id, type and name
    type: str | None = None
    function: DeltaFunctionCall


class DeltaMessage(Sparse):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(Loose):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Loose):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(Loose):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(Loose):
    object: str = "list"
    data: list[ModelCard]
