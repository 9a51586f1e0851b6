"""`hermes`: calls in tags, any number, with text around them (Hermes 2 Pro and later, and
Qwen2.5 and Qwen3, whose templates ask for this format; vLLM serves them with `hermes` too):

    Let me look.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from jaxllm.entrypoints.openai.tool_parsers.base import ToolParser, held_back
from jaxllm.entrypoints.openai.tool_parsers.json_calls import JsonCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    keeps_special_tokens = True  # some tokenizers mark <tool_call> special

    def __init__(self):
        super().__init__()
        self._call: JsonCall | None = None  # the call whose tags are open

    def _read(self, text: str, final: bool) -> str:
        while text:
            if self._call is None:
                at = text.find(OPEN)
                if at < 0:
                    keep = 0 if final else held_back(text, OPEN)
                    self._content(text[:len(text) - keep])
                    return text[len(text) - keep:]
                self._content(text[:at])
                self._call = JsonCall(self.new_call())
                self._call.text = OPEN  # what goes back to content if the call cannot be read
                text = text[at + len(OPEN):]
                continue
            at = text.find(CLOSE)
            end = at if at >= 0 else len(text) - (0 if final else held_back(text, CLOSE))
            self._body(text[:end])
            if at < 0:
                if final:
                    self._close()
                return text[end:]
            self._call.text += CLOSE
            self._close()
            text = text[at + len(CLOSE):]
        if final and self._call is not None:
            self._close()
        return ""

    def _body(self, text: str) -> None:
        call = self._call
        used = call.feed(text)
        if text[used:].strip():  # text after the object, inside the tags
            call.scanner.error = True
        call.text += text[used:]
        self.update(call.call)

    def _close(self) -> None:
        """The call's tags closed (or the output ended inside them)."""
        call, self._call = self._call, None
        if call.failed or not call.scanner.done or call.call.name is None:
            self.give_back(call.call, call.text)
