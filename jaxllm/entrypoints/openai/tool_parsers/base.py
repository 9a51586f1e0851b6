"""What every tool parser shares: the deltas it streams, the text it holds back, and a call's
deltas as its name and arguments grow.

A parser reads a model's output a piece at a time (`feed`, then `finish` at the end) and
turns it into content and tool calls. A whole output is read by the same code (`feed(text)`
then `finish()`), so a stream's deltas reassemble to exactly the calls of the whole output.
The one difference: a whole output that holds a call the parser cannot read (not JSON, no
name) comes back as content, all of it (`malformed`); a stream has sent its start by then.
"""
import dataclasses
import json
import uuid


@dataclasses.dataclass
class ToolCallDelta:
    """A piece of tool call `index`: its first carries the call's id and name."""
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclasses.dataclass
class ParsedDelta:
    """What a piece of output was: content, and pieces of tool calls."""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (and must wait
    for the next piece): "ab<tool" holds 5 back for "<tool_call>"."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ToolCall:
    """One call's deltas as it is read: the first (id, name) once its name is known, then its
    arguments' text as it grows. Arguments written as a JSON string holding the JSON (some
    models do) are held until the string ends, then sent decoded."""

    def __init__(self, index: int, call_id: str):
        self.index, self.id = index, call_id
        self.name: str | None = None
        self.arguments = ""  # the arguments' text as the model wrote it, so far
        self.arguments_done = False
        self.sent_name = False
        self.sent = ""  # the arguments' text sent so far
        self.failed = False  # the call cannot be read: nothing more is sent

    def deltas(self) -> list[ToolCallDelta]:
        if self.name is None or self.failed:
            return []
        out = []
        if not self.sent_name:
            self.sent_name = True
            out.append(ToolCallDelta(self.index, "", self.id, self.name))
        text = self.arguments
        if text.startswith('"'):  # arguments as a JSON string: only whole
            if not self.arguments_done or self.sent:
                return out
            try:
                text = json.loads(text)
            except ValueError:
                text = None
            if not isinstance(text, str):
                self.failed = True
                return out
        if len(text) > len(self.sent):
            out.append(ToolCallDelta(self.index, text[len(self.sent):]))
            self.sent = text
        return out

    def end(self) -> list[ToolCallDelta]:
        """The last deltas: a named call whose arguments never came gets "{}"."""
        out = self.deltas()
        if self.sent_name and not self.failed and not self.arguments:
            self.arguments, self.arguments_done = "{}", True
            out += self.deltas()
        return out

    @property
    def readable(self) -> bool:
        """A name, and arguments sent whole that are a JSON object."""
        if self.failed or not self.sent_name:
            return False
        try:
            return isinstance(json.loads(self.sent), dict)
        except ValueError:
            return False


class ToolParser:
    """Reads one output. Subclasses implement `_read(text, final)`, which takes the text not yet
    read, reports content and calls (`_content`, `new_call`, `update`) and returns the text
    it leaves for the next piece. Whitespace next to a call (the newlines around and between
    calls) is not content: whitespace is sent once text follows it, or at the end of an output
    without calls."""

    # Its tags are special tokens: the text must keep them (SamplingParams.skip_special_tokens=False).
    keeps_special_tokens = False

    def __init__(self):
        self.calls: list[ToolCall] = []
        self.malformed = False
        self._pending = ""  # text left by the last read
        self._spaces = ""  # whitespace held: sent once text follows it
        self._spaces_before_call = ""  # what was held when the last call began
        self._out = ParsedDelta()

    def feed(self, text: str) -> ParsedDelta:
        self._pending = self._read(self._pending + text, final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        rest = self._read(self._pending, final=True)
        self._pending = ""
        if rest:
            self._content(rest)
        if not self.calls:  # an answer without calls is its text, as it is
            self._out.content += self._spaces
        for call in self.calls:
            self._out.tool_calls += call.end()
            self.malformed |= not call.readable
        return self._take()

    def _read(self, text: str, final: bool) -> str:
        raise NotImplementedError

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out

    def _content(self, text: str) -> None:
        body = text.rstrip()
        if body:
            self._out.content += self._spaces + body
            self._spaces = text[len(body):]
        else:
            self._spaces += text

    def new_call(self, call_id: str | None = None) -> ToolCall:
        call = ToolCall(len(self.calls), call_id or tool_call_id())
        self.calls.append(call)
        self._spaces_before_call, self._spaces = self._spaces, ""
        return call

    def update(self, call: ToolCall) -> None:
        self._out.tool_calls += call.deltas()

    def give_back(self, call: ToolCall, text: str) -> None:
        """A call that cannot be read: its text is content, unless its start was sent."""
        self.malformed = True
        call.failed = True
        if call.sent_name:
            return
        self.calls.remove(call)
        self._spaces = self._spaces_before_call  # not next to a call after all
        self._content(text)
