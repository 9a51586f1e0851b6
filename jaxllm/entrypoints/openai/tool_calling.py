"""Tool calling on the request's side, by vLLM's rules: which tool_choice a request makes, its
messages and tools as a chat template takes them, and the JSON schema that forces a call
through structured outputs ("required": a list of calls of the given tools; a named
function: its arguments' object)."""
import json

from jaxllm.entrypoints.openai.errors import APIError
from jaxllm.entrypoints.openai.protocol import ChatCompletionTool, ChatMessage, NamedToolChoice, ToolChoice
from jaxllm.sampling_params import StructuredOutputsParams

_NO_ARGUMENTS = {"type": "object", "properties": {}}


def resolve_tool_choice(tools: list[ChatCompletionTool] | None, choice: ToolChoice | None,
                        auto_enabled: bool) -> ToolChoice:
    """The request's tool choice: "none", "auto", "required" or a NamedToolChoice naming one of
    its tools; a 400 naming tool_choice (or tools) when the pair cannot be served."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return choice
    if tools is None:
        raise APIError(400, "tool_choice needs tools: there is no tool to call", param="tool_choice")
    for i, tool in enumerate(tools):
        if not tool.function.name:
            raise APIError(400, f"tools[{i}].function.name must not be empty", param="tools")
    if choice == "required" and not tools:
        return "none"  # vLLM's: nothing to require
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise APIError(400, f"tool_choice names the function {choice.function.name[:100]!r}, which is not in tools",
                       param="tool_choice")
    if choice == "auto" and not auto_enabled:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                       "set (jaxllm serve's flags); a request with tools and no tool_choice asks for it",
                       param="tool_choice")
    return choice


def forced_call_schema(tools: list[ChatCompletionTool], choice: ToolChoice, parallel_tool_calls: bool) -> dict | None:
    """The JSON schema of the output when tool_choice forces a call (None otherwise); each
    tool's parameters checked as a schema first, so that a 400 names the bad one."""
    if choice in ("none", "auto"):
        return None
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    chosen = [(i, t) for i, t in enumerate(tools) if named is None or t.function.name == named]
    for i, tool in chosen:
        if tool.function.parameters:
            try:
                StructuredOutputsParams(json=tool.function.parameters)
            except (ValueError, TypeError) as e:
                field = f"tools[{i}].function.parameters"
                raise APIError(400, f"{field} is not a JSON schema structured outputs can follow: "
                               f"{str(e).removeprefix('structured_outputs.json: ')}", param="tools") from e
    if named is not None:
        return chosen[0][1].function.parameters or _NO_ARGUMENTS
    defs: dict[str, dict] = {}
    calls = []
    for i, tool in chosen:
        parameters = dict(tool.function.parameters or _NO_ARGUMENTS)
        # "$ref": "#/$defs/X" points at the root: each tool's $defs move up to the list's schema.
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise APIError(400, f"tools[{i}].function.parameters: $defs.{name} differs from another tool's, "
                               "and tool_choice \"required\" puts them in one schema", param="tools")
        # vLLM's schema, closed: a call holds its name and parameters, nothing else.
        calls.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as chat templates read them: every content a string, an earlier call's
    arguments an object (Qwen's and Llama's templates write them with tojson), the thinking
    under reasoning_content."""
    out = []
    for message in messages:
        m = message.model_dump(exclude_none=True)
        m.setdefault("content", "")
        if "reasoning" in m:
            m.setdefault("reasoning_content", m.pop("reasoning"))
        for call in m.get("tool_calls", ()):
            try:
                arguments = json.loads(call["function"]["arguments"])
            except ValueError:
                continue  # the template gets the text
            if isinstance(arguments, dict):
                call["function"]["arguments"] = arguments
        out.append(m)
    return out


def template_tools(tools: list[ChatCompletionTool] | None) -> list[dict] | None:
    return None if tools is None else [tool.model_dump(exclude_none=True) for tool in tools]
