"""The Responses API's request, its input items as chat messages, and its output items
(OpenAI's shapes: the official client reads them).

Input: a string (one user message) or a list of items: messages ({"role", "content"}, the
content a string or input_text / output_text parts), the model's earlier function_call items,
function_call_output items (a tool's answer) and reasoning items (kept as the next
assistant turn's reasoning_content). Output: a reasoning item (with a reasoning parser), a
message item with one output_text part, and a function_call item per call.
"""
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from jaxllm.entrypoints.openai.errors import APIError
from jaxllm.entrypoints.openai.protocol import Loose, Strict


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    input: str | list[Any]  # items, checked by input_messages
    model: str | None = None
    instructions: str | None = None  # a system message first (not carried to the next turn)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(items: str | list) -> list[dict]:
    """The input as chat messages; a 400 naming input[i] for an item it cannot take."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages, reasoning = [], None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object (an input item)", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, got {role!r:.50}",
                               param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":  # a turn's calls follow its message
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _string(item, "output", where)})
        elif kind == "reasoning":
            reasoning = "".join(part.get("text", "") for part in item.get("content") or () if isinstance(part, dict))
            continue
        else:
            raise APIError(400, f"{where}.type {kind!r:.50} is not supported: message, function_call, "
                           "function_call_output and reasoning items are", param="input")
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], reasoning = reasoning, None
    return messages


def _string(item: dict, key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise APIError(400, f"{where}.{key} must be a string", param="input")
    return item[key]


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param="input")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{k}] must be a text part ({{\"type\": \"input_text\", \"text\": ...}}); "
                           "only text is supported", param="input")
        texts.append(part["text"])
    return "".join(texts)


# ---- output ----
def message_item(id_: str, text: str, status: str) -> dict:
    return {"id": id_, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)] if status != "in_progress" else []}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(id_: str, text: str, status: str) -> dict:
    return {"id": id_, "type": "reasoning", "summary": [], "status": status,
            "content": [reasoning_text(text)] if status != "in_progress" else []}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def function_call_item(id_: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": id_, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class Usage(Loose):
    input_tokens: int
    input_tokens_details: dict
    output_tokens: int
    output_tokens_details: dict
    total_tokens: int


class ResponseObject(Loose):
    """A response as the API gives it (status "in_progress" while it streams)."""
    id: str
    object: str = "response"
    created_at: int
    status: str
    model: str
    output: list[dict]
    incomplete_details: dict | None = None
    error: dict | None = None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict]
    tool_choice: Any
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    text: dict
    truncation: str = "disabled"
    metadata: dict | None
    user: str | None
    usage: Usage | None = None

    @classmethod
    def started(cls, request: ResponsesRequest, id_: str, model: str) -> "ResponseObject":
        """The response as it begins: in progress, no output yet; the request's settings echoed."""
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
        choice = request.tool_choice.model_dump() if isinstance(request.tool_choice, BaseModel) else \
            request.tool_choice or "auto"
        text = request.text.model_dump(exclude_none=True, by_alias=True) if request.text and request.text.format \
            else {"format": {"type": "text"}}
        return cls(id=id_, created_at=int(time.time()), status="in_progress", model=model, output=[],
                   instructions=request.instructions, max_output_tokens=request.max_output_tokens,
                   temperature=request.temperature, top_p=request.top_p, tools=tools, tool_choice=choice,
                   parallel_tool_calls=request.parallel_tool_calls, previous_response_id=request.previous_response_id,
                   store=request.store, text=text, metadata=request.metadata, user=request.user)

    def finished(self, status: str, output: list[dict], usage: Usage) -> "ResponseObject":
        """The response once its output is whole: status "completed", or "incomplete" (cut at max_output_tokens)."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return self.model_copy(update={"status": status, "output": output, "usage": usage,
                                       "incomplete_details": incomplete})
