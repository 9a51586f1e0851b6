"""`mistral`: calls after the [TOOL_CALLS] token, which may follow text. Before Mistral's v11
tokenizer, one JSON list of objects; from v11 on, each call its name then its arguments:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}

Call ids are 9 letters and digits: Mistral's chat templates refuse any other.
"""
import random
import string

from jaxllm.entrypoints.openai.tool_parsers.base import ToolParser, held_back
from jaxllm.entrypoints.openai.tool_parsers.json_calls import JsonCallList, JsonObjectScanner

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


class MistralToolParser(ToolParser):
    keeps_special_tokens = True  # [TOOL_CALLS] is one

    def __init__(self):
        super().__init__()
        self._form: str | None = None  # after [TOOL_CALLS]: "?" until the next character tells, "list" or "named"
        self._list = JsonCallList(self, "[", ",", "]")
        # The v11 form: the name being read, until its arguments start; then the arguments' object.
        self._name = ""
        self._scanner: JsonObjectScanner | None = None
        self._call = None
        self._raw = ""  # the call's text, to give back if it cannot be read
        self._between = False  # a call's arguments ended: another [TOOL_CALLS] may follow
        self._done = False

    def new_call(self, call_id: str | None = None):
        return super().new_call(call_id or mistral_call_id())

    def _read(self, text: str, final: bool) -> str:
        if self._form is None:
            at = text.find(TOOL_CALLS)
            if at < 0:
                keep = 0 if final else held_back(text, TOOL_CALLS)
                self._content(text[:len(text) - keep])
                return text[len(text) - keep:]
            self._content(text[:at])
            self._form, text = "?", text[at + len(TOOL_CALLS):]
        if self._form == "?":
            if not text.strip() and not final:
                return text  # which form: the next character tells
            self._form = "list" if text.lstrip().startswith("[") else "named"
        if self._done:
            self._trailing(text)
        elif self._form == "list":
            rest = self._list.read(text)
            if self._list.ended:
                self._done = True
                self._trailing(rest)
            elif final:
                self._list.finish()
        else:
            return self._read_named(text, final)
        return ""

    def _read_named(self, text: str, final: bool) -> str:
        """The v11 form: name{arguments}, each after [TOOL_CALLS]."""
        while text or final:
            if self._between:  # after a call's arguments: another [TOOL_CALLS], or the end
                stripped = text.lstrip()
                if stripped.startswith(TOOL_CALLS):
                    text, self._between = stripped[len(TOOL_CALLS):], False
                    continue
                if not final and TOOL_CALLS.startswith(stripped):
                    return text
                self._end("", text)
                return ""
            if self._scanner is None:
                at = text.find("{")
                self._name += text if at < 0 else text[:at]
                if at < 0:
                    if final:
                        self._end(TOOL_CALLS + self._name, "")
                    return ""
                text = text[at:]
                self._call = self.new_call()
                self._call.name = self._name.replace(ARGS, "").strip() or None
                self._raw, self._scanner = TOOL_CALLS + self._name, JsonObjectScanner()
            used = self._scanner.feed(text)
            self._raw += text[:used]
            self._call.arguments += text[:used]
            self._call.arguments_done = self._scanner.done
            self.update(self._call)
            text = text[used:]
            if self._call.name is None or self._scanner.error or (final and not self._scanner.done):
                self.give_back(self._call, self._raw)
                self._end("", text)
                return ""
            if not self._scanner.done:
                return ""
            self._scanner, self._name, self._between = None, "", True
        return ""

    def _end(self, unread: str, rest: str) -> None:
        """No more calls: what could not be read, and the text after, are content."""
        self._done = True
        if unread:
            self.malformed = True
            self._content(unread)
        self._trailing(rest)

    def _trailing(self, text: str) -> None:
        if text.strip():
            self.malformed = True
        self._content(text)
