"""The outputs of a forced tool_choice, which structured outputs shape: "required" writes a
JSON list of {"name": ..., "parameters": {...}} (one or more calls, vLLM's schema); a named
function writes its arguments' object alone."""
from jaxllm.entrypoints.openai.tool_parsers.base import ToolParser
from jaxllm.entrypoints.openai.tool_parsers.json_calls import JsonCallList


class RequiredToolParser(ToolParser):
    def __init__(self):
        super().__init__()
        self._list = JsonCallList(self, "[", ",", "]")

    def _read(self, text: str, final: bool) -> str:
        rest = text if self._list.ended else self._list.read(text)
        if self._list.ended:
            if rest.strip() or not self.calls:
                self.malformed = True
            self._content(rest)
        elif final:
            self._list.finish()
            self.malformed = True
        return ""


class NamedToolParser(ToolParser):
    def __init__(self, name: str):
        super().__init__()
        self._call = self.new_call()
        self._call.name = name

    def _read(self, text: str, final: bool) -> str:
        self._call.arguments += text
        self._call.arguments_done = final
        self.update(self._call)
        return ""
