"""Tool calls written as JSON objects, `{"name": "f", "arguments": {...}}` (or "parameters",
Llama's key), read a piece at a time, so that a call's name is sent once it is whole and its
arguments as they are written.

JsonObjectScanner follows one object's structure (strings, nesting, key : value , ...) and
keeps each top-level member's raw value text; json.loads checks the finished values. Its
arguments are the model's own text, not a re-serialization: what a stream sends is what the
whole output gives.
"""
import json

from jaxllm.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser

_SPACE = " \t\r\n"
# Where the scanner is, between the values of the object's own members.
_BEFORE, _KEY, _IN_KEY, _COLON, _VALUE, _IN_VALUE, _AFTER = range(7)


class JsonObjectScanner:
    def __init__(self):
        self.members: dict[str, str] = {}  # key -> its value's text so far
        self.complete: set[str] = set()  # keys whose value has ended
        self.done = False  # the closing brace was read
        self.error = False  # the text is no JSON object
        self._state = _BEFORE
        self._key = ""  # the key being read (raw, escapes undone at its end)
        self._depth = 0  # nesting inside a member's value
        self._in_string = self._escape = False
        self._literal = False  # the value is a number, true, false or null

    def feed(self, text: str) -> int:
        """Reads `text`; returns how much of it belongs to the object (all of it until it closes)."""
        i, start = 0, None  # start: where the current value's text begins in `text`
        if self._state == _IN_VALUE:
            start = 0
        n = len(text)
        while i < n and not self.done and not self.error:
            c = text[i]
            state = self._state
            if state == _IN_VALUE:
                end = self._value_char(c)
                if end is None:
                    i += 1
                    continue
                self.members[self._key] += text[start:i + end]
                self.complete.add(self._key)
                start, self._state = None, _AFTER
                i += end
                continue
            if state == _IN_KEY:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    try:
                        self._key = json.loads(f'"{self._key}"')
                    except ValueError:
                        self.error = True
                        break
                    self._state = _COLON
                    i += 1
                    continue
                self._key += c
            elif c in _SPACE:
                pass
            elif state == _BEFORE:
                self._expect(c == "{", _KEY)
            elif state == _KEY:
                if c == '"':
                    self._key, self._state = "", _IN_KEY
                else:
                    self._close_or_fail(c)
            elif state == _COLON:
                self._expect(c == ":", _VALUE)
            elif state == _VALUE:
                self.members[self._key] = ""
                self._start_value(c)
                start, self._state = i, _IN_VALUE
                continue  # the first character is the value's too
            elif c == ",":
                self._state = _KEY
            else:
                self._close_or_fail(c)
            i += 1
        if start is not None:
            self.members[self._key] += text[start:i]
        return i

    def _expect(self, ok: bool, next_state: int) -> None:
        if ok:
            self._state = next_state
        else:
            self.error = True

    def _close_or_fail(self, c: str) -> None:
        if c == "}":
            self.done = True
        else:
            self.error = True

    def _start_value(self, c: str) -> None:
        self._depth, self._in_string, self._escape = 0, False, False
        self._literal = c not in '{["'

    def _value_char(self, c: str) -> int | None:
        """Takes one character of a member's value: None if the value goes on, else how many
        characters of it (0 or 1: a literal's end is the next character) end the value."""
        if self._literal:
            return 0 if c in _SPACE or c in ",}" else None
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                return 1 if self._depth == 0 else None
            return None
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            return 1 if self._depth == 0 else None
        return None


class JsonCall:
    """One call as a JSON object, and its ToolCall's name and arguments as they are read."""

    def __init__(self, call: ToolCall):
        self.call = call
        self.scanner = JsonObjectScanner()
        self.text = ""  # what the object's text was, to give back if it cannot be read

    def feed(self, text: str) -> int:
        used = self.scanner.feed(text)
        self.text += text[:used]
        members, call = self.scanner.members, self.call
        if call.name is None and "name" in self.scanner.complete:
            try:
                name = json.loads(members["name"])
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                call.name = name
            else:
                call.failed = True
        key = "arguments" if "arguments" in members else "parameters"
        if key in members:
            call.arguments = members[key]
            call.arguments_done = key in self.scanner.complete
        return used

    @property
    def failed(self) -> bool:
        return self.scanner.error or self.call.failed


class JsonCallList:
    """Calls as JSON objects one after another, read by a parser: `[{...}, {...}]` (open "[",
    separator ",", close "]"; Mistral's and tool_choice "required"'s) or `{...}; {...}`
    (separator ";", Llama's). What follows the list is given back unread."""

    def __init__(self, parser: ToolParser, open_: str | None, separator: str, close: str | None):
        self.parser = parser
        self.open, self.separator, self.close = open_, separator, close
        self.started = open_ is None
        self.ended = False
        self.current: JsonCall | None = None

    def read(self, text: str) -> str:
        """Reads `text`; returns the text after the list once it has ended ("" while it goes on)."""
        i = 0
        while i < len(text) and not self.ended:
            if self.current is not None:
                i += self.current.feed(text[i:])
                self.parser.update(self.current.call)
                if self.current.failed or (self.current.scanner.done and self.current.call.name is None):
                    self.parser.give_back(self.current.call, self.current.text)
                    self.ended = True
                    return text[i:]
                if not self.current.scanner.done:
                    return ""
                self.current = None
                continue
            c = text[i]
            if c in _SPACE:
                i += 1
            elif not self.started:
                if c != self.open:
                    self.ended = True
                    return text[i:]
                self.started = True
                i += 1
            elif c == "{":
                self.current = JsonCall(self.parser.new_call())
            elif c == self.separator and self.parser.calls:
                i += 1
            else:
                self.ended = True
                if c == self.close:
                    i += 1
                return text[i:]
        return text[i:]

    def finish(self) -> None:
        """The output ended: a call cut short cannot be read."""
        if self.current is not None:
            self.parser.give_back(self.current.call, self.current.text)
