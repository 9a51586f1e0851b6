"""`llama3_json` (and `llama4_json`): Llama 3.1+'s JSON tool calls. A call is an object with
"name" and "parameters" (or "arguments"); several are joined by "; ". They start the output,
or follow the <|python_tag|> token, after any text:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}
"""
from jaxllm.entrypoints.openai.tool_parsers.base import ToolParser, held_back
from jaxllm.entrypoints.openai.tool_parsers.json_calls import JsonCallList

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    keeps_special_tokens = True  # <|python_tag|> is one

    def __init__(self):
        super().__init__()
        self._list: JsonCallList | None = None
        self._started = False  # the output's first non-whitespace text was read

    def _read(self, text: str, final: bool) -> str:
        if self._list is None:
            if not self._started:
                if not text.strip() and not final:
                    return text  # only whitespace yet: wait for what starts the output
                if text.lstrip().startswith("{"):
                    text = PYTHON_TAG + text.lstrip()  # the calls start the output
                self._started = True
            at = text.find(PYTHON_TAG)
            if at < 0:
                keep = 0 if final else held_back(text, PYTHON_TAG)
                self._content(text[:len(text) - keep])
                return text[len(text) - keep:]
            self._content(text[:at])
            self._list = JsonCallList(self, None, ";", None)
            text = text[at + len(PYTHON_TAG):]
        rest = text if self._list.ended else self._list.read(text)
        if self._list.ended:
            self._trailing(rest)
        elif final:
            self._list.finish()
        return ""

    def _trailing(self, text: str) -> None:
        """Text after the calls: content, and a whole output that is not only calls."""
        if text.strip():
            self.malformed = True
        self._content(text)
