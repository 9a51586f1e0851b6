"""Reasoning parsers (`jaxllm serve --reasoning-parser NAME`, vLLM's names): a reasoning
model's output is its thinking, between <think> and </think>, then its answer. The thinking
goes to `reasoning_content`, the answer to `content`.

- `deepseek_r1`: the output starts in the thinking (DeepSeek-R1's template opens it in the
  prompt; a leading <think> is dropped); with no </think>, all of it is thinking.
- `qwen3`: the output thinks only if it starts with <think> (Qwen3 with enable_thinking);
  else all of it is the answer.

Where the prompt's own text ends the template's turn inside the tags, the prompt decides:
a prompt ending in </think> (Qwen3's enable_thinking=false) leaves only an answer to
write; one ending in <think> (Qwen3-Thinking's, DeepSeek-R1's templates) starts in the
thinking. Both tags must be tokens of the model's vocabulary: structured outputs start
after the </think> token (StructuredOutputsParams.reasoning_end_token_id).
"""
from jaxllm.entrypoints.openai.tool_parsers.base import held_back

THINK_START, THINK_END = "<think>", "</think>"
# name -> whether the output starts in the thinking when neither it nor the prompt says
REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}


def reasoning_end_token_id(tokenizer, name: str) -> int:
    """The </think> token's id; a ValueError for `--reasoning-parser name` when the vocabulary
    lacks <think> or </think> as tokens (vLLM refuses them too)."""
    if tokenizer is None:
        raise ValueError(f"--reasoning-parser {name} needs the model's tokenizer, and the engine has none")
    vocab = tokenizer.get_vocab()
    missing = [tag for tag in (THINK_START, THINK_END) if tag not in vocab]
    if missing:
        raise ValueError(f"--reasoning-parser {name} needs {' and '.join(missing)} as tokens of the model's "
                         "vocabulary, and this tokenizer has none")
    return vocab[THINK_END]


def thinking_state(prompt_text: str) -> bool | None:
    """What the prompt's end says about the output: True (it starts in the thinking), False
    (the thinking is over), None (the prompt says nothing)."""
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_END):
        return False
    if tail.endswith(THINK_START):
        return True
    return None


class ReasoningParser:
    """Splits one output, fed a piece at a time, into (reasoning, content) pieces. A whole
    output is fed once and finished: the same code, so a stream's pieces join to the whole
    output's split."""

    def __init__(self, thinks_by_default: bool, prompt_state: bool | None):
        # "start": the output may open with <think>; "thinking"; "answer".
        self._state = "start" if prompt_state is None else "thinking" if prompt_state else "answer"
        self._default = "thinking" if thinks_by_default else "answer"
        self.thought = self._state == "thinking"  # the output had a thinking part (reasoning_content not None)
        self._held = ""

    @property
    def thinking(self) -> bool:
        return self._state != "answer"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning = ""
        if self._state == "start":
            stripped = text.lstrip()
            if not final and THINK_START.startswith(stripped):
                self._held = text  # may be the opening tag, still being written
                return "", ""
            if stripped.startswith(THINK_START):
                text, self._state = stripped[len(THINK_START):], "thinking"
            else:
                self._state = self._default
            self.thought = self._state == "thinking"
        if self._state == "thinking":
            at = text.find(THINK_END)
            if at < 0:
                keep = 0 if final else held_back(text, THINK_END)
                self._held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text, self._state = text[:at], text[at + len(THINK_END):], "answer"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)
