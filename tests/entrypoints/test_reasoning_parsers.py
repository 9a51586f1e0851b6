"""The reasoning parsers: a whole output splits exactly into thinking and answer, and the same
output streamed token by token (the embedded SmolLM2's tokens, which split the tags) splits
the same; outputs that never close their thinking, and outputs with no thinking at all; the
prompt's own end deciding where the output starts; tool calls read from the answer only."""
import json

import pytest

from jaxllm.entrypoints.openai.output_parser import OutputParser
from jaxllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser, thinking_state
from jaxllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from tests.entrypoints.conftest import token_pieces

# parser -> case -> (prompt's end, output, reasoning, content)
CASES = {
    "deepseek_r1": {
        "thinking then answer": ("", "<think>\nFirst, 2+2.\n</think>\n\nIt is 4.", "\nFirst, 2+2.\n", "\n\nIt is 4."),
        "opened in the prompt": ("<think>\n", "First, 2+2.\n</think>It is 4.", "First, 2+2.\n", "It is 4."),
        "never closed": ("<think>\n", "First, 2+2. Then", "First, 2+2. Then", None),
        "closed at the very end": ("", "<think>Hm.</think>", "Hm.", None),
        "closed in the prompt: no thinking": ("<think>\n\n</think>\n\n", "It is 4, </think> and all.", None,
                                              "It is 4, </think> and all."),
    },
    "qwen3": {
        "thinking then answer": ("", "<think>\nFirst, 2+2.\n</think>\n\nIt is 4.", "\nFirst, 2+2.\n", "\n\nIt is 4."),
        "no thinking at all": ("", "It is 4.", None, "It is 4."),
        "never closed": ("", "<think>\nFirst, 2+2. Then", "\nFirst, 2+2. Then", None),
        "a late <think> is content": ("", "It is 4. <think>no</think>", None, "It is 4. <think>no</think>"),
        "opened in the prompt": ("<think>\n", "First.</think>It is 4.", "First.", "It is 4."),
        "closed in the prompt (enable_thinking off)": ("<think>\n\n</think>\n\n", "It is 4.", None, "It is 4."),
    },
}
ALL_CASES = [(name, case) for name, cases in CASES.items() for case in cases]


def parser(name: str, prompt_end: str) -> OutputParser:
    return OutputParser(ReasoningParser(REASONING_PARSERS[name], thinking_state("<|user|>Hi" + prompt_end)), None)


@pytest.mark.parametrize("name,case", ALL_CASES)
def test_a_whole_output_splits_into_thinking_and_answer(name, case):
    prompt_end, text, reasoning, content = CASES[name][case]
    parsed = parser(name, prompt_end).parse(text)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)


@pytest.mark.parametrize("name,case", ALL_CASES)
def test_a_stream_splits_as_the_whole_output(name, case, smollm2_tokenizer):
    prompt_end, text, reasoning, content = CASES[name][case]
    output = parser(name, prompt_end)
    deltas = [output.feed(piece) for piece in token_pieces(smollm2_tokenizer, text)] + [output.finish()]
    assert "".join(d.reasoning for d in deltas) == (reasoning or "")
    assert "".join(d.content for d in deltas) == (content or "")


def test_tool_calls_are_read_from_the_answer_only():
    text = ('<think>I could write <tool_call>{"name": "nope", "arguments": {}}</tool_call> here.</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    output = OutputParser(ReasoningParser(REASONING_PARSERS["qwen3"], None), TOOL_PARSERS["hermes"]())
    parsed = output.parse(text)
    assert parsed.reasoning == 'I could write <tool_call>{"name": "nope", "arguments": {}}</tool_call> here.'
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert parsed.content is None  # the newlines before the call are not content


def test_a_prompt_that_ends_the_thinking_says_so_and_one_that_opens_it_too():
    assert thinking_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") is False
    assert thinking_state("<|Assistant|><think>\n") is True
    assert thinking_state("<|im_start|>assistant\n") is None
