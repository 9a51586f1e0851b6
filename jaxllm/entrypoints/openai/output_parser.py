"""One choice's output as the API gives it: the thinking (a reasoning parser), then the answer
as content and tool calls (a tool parser), a piece at a time for a stream or whole."""
import dataclasses

from jaxllm.entrypoints.openai.reasoning_parsers import ReasoningParser
from jaxllm.entrypoints.openai.tool_parsers import ToolCallDelta, ToolParser


@dataclasses.dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclasses.dataclass
class FunctionCall:
    id: str
    name: str
    arguments: str  # a JSON object's text


@dataclasses.dataclass
class ParsedOutput:
    reasoning: str | None  # None: the output did not think
    content: str | None
    tool_calls: list[FunctionCall]


class OutputParser:
    """`reasoning`: None unless the server has a reasoning parser. `tools`: None where the
    answer is plain content. Without parallel_tool_calls only the first call is given."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel_tool_calls: bool = True):
        self.reasoning, self.tools = reasoning, tools
        self.max_calls = None if parallel_tool_calls else 1

    @property
    def tools_called(self) -> bool:
        """Whether a stream sent a tool call (a whole output's are in parse's result)."""
        return self.tools is not None and any(call.sent_name for call in self.tools.calls[:self.max_calls])

    def feed(self, text: str, final: bool = False) -> OutputDelta:
        reasoning, answer = ("", text) if self.reasoning is None else self.reasoning.feed(text, final)
        if self.tools is None:
            return OutputDelta(reasoning, answer)
        parsed = self.tools.feed(answer)
        if final:
            end = self.tools.finish()
            parsed.content += end.content
            parsed.tool_calls += end.tool_calls
        calls = [d for d in parsed.tool_calls if self.max_calls is None or d.index < self.max_calls]
        return OutputDelta(reasoning, parsed.content, calls)

    def finish(self) -> OutputDelta:
        return self.feed("", final=True)

    def parse(self, text: str) -> ParsedOutput:
        """A whole output. One holding a tool call that cannot be read is content, all of its answer."""
        reasoning, answer = ("", text) if self.reasoning is None else self.reasoning.feed(text, final=True)
        thought = self.reasoning is not None and self.reasoning.thought
        if self.tools is None:  # the text as it is, unless a reasoning parser split it
            return ParsedOutput(reasoning if thought else None, answer if self.reasoning is None else answer or None, [])
        parsed = self.tools.feed(answer)
        end = self.tools.finish()
        if self.tools.malformed:
            return ParsedOutput(reasoning if thought else None, answer or None, [])
        calls: dict[int, FunctionCall] = {}
        for delta in parsed.tool_calls + end.tool_calls:
            if delta.id is not None:
                calls[delta.index] = FunctionCall(delta.id, delta.name, "")
            calls[delta.index].arguments += delta.arguments
        content = parsed.content + end.content
        return ParsedOutput(reasoning if thought else None, content or None, list(calls.values())[:self.max_calls])
