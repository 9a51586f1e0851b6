"""`pythonic`: the output is a Python list of calls with keyword arguments (Llama 3.2, ToolACE):

    [get_weather(city='San Francisco', metric='celsius'), get_time()]

An output that does not start with such a list is content. Each call's name is sent once
its "(" is read, its arguments (as JSON) once its ")" is.
"""
import ast
import json
import re

from jaxllm.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser

_CALL_START = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_LIST_START = re.compile(r"\s*\[")
_MAYBE_LIST_START = re.compile(r"\s*(\[\s*([A-Za-z_][\w.]*\s*)?)?")  # what could still become one


class PythonicToolParser(ToolParser):
    def __init__(self):
        super().__init__()
        self._mode = "start"  # "start": not yet known, "calls", "content" (for good)
        self._call: ToolCall | None = None
        self._args = ""  # the open call's argument text
        self._depth = 0  # brackets open inside its arguments
        self._quote = ""  # the string its arguments are in, if any
        self._escape = False
        self._expect_more = False  # a "," was read: another call must follow

    def _read(self, text: str, final: bool) -> str:
        if self._mode == "start":
            list_start = _LIST_START.match(text)
            first = list_start and _CALL_START.match(text, list_start.end())
            if first:
                self._mode = "calls"
                text = text[list_start.end():]
            elif not final and _MAYBE_LIST_START.fullmatch(text):
                return text
            else:
                self._mode = "content"
        if self._mode == "content":
            self._content(text)
            return ""
        return self._read_calls(text, final)

    def _read_calls(self, text: str, final: bool) -> str:
        i = 0
        while i < len(text):
            if self._call is not None:
                i = self._read_arguments(text, i)
                continue
            c = text[i]
            if c.isspace():
                i += 1
            elif c == "," and self.calls and not self._expect_more:
                self._expect_more, i = True, i + 1
            elif c == "]" and not self._expect_more:
                self._mode = "content"  # the list ended: what follows is text
                if text[i + 1:].strip():
                    self.malformed = True
                self._content(text[i + 1:])
                return ""
            elif match := _CALL_START.match(text, i):
                self._call = self.new_call()
                self._call.name = match.group(1)
                self._args, self._depth, self._expect_more = "", 0, False
                self.update(self._call)
                i = match.end()
            elif not final and _MAYBE_LIST_START.fullmatch("[" + text[i:]):
                return text[i:]  # a name, still being written
            else:
                self._fail(text[i:])
                return ""
        if final and (self._call is not None or self._mode == "calls"):
            self._fail("")
        return ""

    def _read_arguments(self, text: str, i: int) -> int:
        """Reads the open call's arguments up to its ")"; returns where it stopped."""
        start = i
        while i < len(text):
            c = text[i]
            if self._quote:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == self._quote:
                    self._quote = ""
            elif c in "'\"":
                self._quote = c
            elif c in "([{":
                self._depth += 1
            elif c in ")]}":
                if self._depth == 0:
                    self._args += text[start:i]
                    self._end_call()
                    return i + 1
                self._depth -= 1
            i += 1
        self._args += text[start:]
        return i

    def _end_call(self) -> None:
        call, self._call = self._call, None
        try:
            node = ast.parse(f"f({self._args})", mode="eval").body
            if node.args or any(k.arg is None for k in node.keywords):
                raise ValueError("positional arguments")
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            call.arguments = json.dumps(arguments, ensure_ascii=False)
        except (SyntaxError, ValueError, TypeError):
            call.failed = True
            self.malformed = True
            return
        call.arguments_done = True
        self.update(call)

    def _fail(self, rest: str) -> None:
        """The list does not go on as one of calls: the rest is content."""
        if self._call is not None:
            self._call.failed = True
            self._call = None
        self.malformed = True
        self._mode = "content"
        self._content(rest)
