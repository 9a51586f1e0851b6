"""The tool parsers on each model family's exact output format: a whole output gives its exact
calls and content; the same output streamed token by token (the embedded SmolLM2's tokens,
which split every tag into pieces) or character by character gives deltas that reassemble
to the same; a call the parser cannot read makes the whole output content."""
import json
import re

import pytest

from jaxllm.entrypoints.openai.output_parser import OutputParser
from jaxllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, NamedToolParser, RequiredToolParser
from tests.entrypoints.conftest import token_pieces

WEATHER_PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME_ZURICH = ("get_time", {"zone": "Zürich", "at": [1, {"note": "a } and a \" inside"}]})

# parser -> case -> (output, content, calls): each call (name, arguments as an object)
CASES = {
    "hermes": {
        "one call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                     '</tool_call>', None, [WEATHER_PARIS]),
        "two calls after text": (
            'Let me look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Zürich", "at": '
            '[1, {"note": "a } and a \\" inside"}]}}\n</tool_call>', "Let me look both up.",
            [WEATHER_PARIS, TIME_ZURICH]),
        "arguments first, text after": (
            '<tool_call>{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather"}</tool_call>\n\n'
            'Done.', "\n\nDone.", [WEATHER_PARIS]),
        "arguments as a JSON string": (
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": '
            '\\"celsius\\"}"}\n</tool_call>', None, [WEATHER_PARIS]),
    },
    "llama3_json": {
        "one call": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
                     [WEATHER_PARIS]),
        "two calls after the python tag": (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
            '{"name": "get_time", "parameters": {"zone": "Zürich", "at": [1, {"note": "a } and a \\" inside"}]}}',
            None, [WEATHER_PARIS, TIME_ZURICH]),
        "text before the python tag": (
            'I will check.<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}', "I will check.", [WEATHER_PARIS]),
    },
    "mistral": {
        "a list of calls": (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "get_time", "arguments": {"zone": "Zürich", "at": [1, {"note": "a } and a \\" inside"}]}}]',
            None, [WEATHER_PARIS, TIME_ZURICH]),
        "v11 calls after text": (
            'Checking.[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time{"zone": '
            '"Zürich", "at": [1, {"note": "a } and a \\" inside"}]}', "Checking.", [WEATHER_PARIS, TIME_ZURICH]),
    },
    "pythonic": {
        "one call": ("[get_weather(city='Paris', unit='celsius')]", None, [WEATHER_PARIS]),
        "two calls": ("[get_weather(city='Paris', unit='celsius'), get_time(zone='Zürich', "
                      "at=[1, {'note': 'a } and a \" inside'}])]", None, [WEATHER_PARIS, TIME_ZURICH]),
    },
}
MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
               "Checking. <tool_call>not JSON</tool_call>",
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Paris"}',
                    '{"parameters": {"city": "Paris"}}',
                    '{"name": "get_weather", "parameters": {"city": "Paris"}} and some text'],
    "mistral": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',
                '[TOOL_CALLS]get_weather'],
    "pythonic": ["[get_weather(city='Paris'", "[get_weather('Paris')]", "[get_weather(city=lookup())]"],
}
PLAIN = "The weather in Paris is mild: {not a call} and [a list]."


def whole(parser, text):
    """(content, [(name, arguments object)]) of a whole output."""
    parsed = OutputParser(None, parser).parse(text)
    return parsed.content, [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls], parsed


def streamed(parser, pieces):
    """(content or None, [(name, arguments text)], the tool call deltas) of a stream."""
    output = OutputParser(None, parser)
    deltas = [output.feed(piece) for piece in pieces] + [output.finish()]
    content = "".join(d.content for d in deltas)
    calls, call_deltas = {}, [c for d in deltas for c in d.tool_calls]
    for c in call_deltas:
        if c.id is not None:
            calls[c.index] = [c.name, ""]
        calls[c.index][1] += c.arguments
    return content or None, [tuple(call) for call in calls.values()], call_deltas


ALL_CASES = [(name, case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("name,case", ALL_CASES)
def test_a_whole_output_gives_its_calls_and_content(name, case):
    text, content, calls = CASES[name][case]
    assert whole(TOOL_PARSERS[name](), text)[:2] == (content, calls)


@pytest.mark.parametrize("pieces", ["tokens", "characters"])
@pytest.mark.parametrize("name,case", ALL_CASES)
def test_a_stream_reassembles_to_the_whole_outputs_calls(name, case, pieces, smollm2_tokenizer):
    text, content, calls = CASES[name][case]
    split = token_pieces(smollm2_tokenizer, text) if pieces == "tokens" else list(text)
    got_content, got_calls, deltas = streamed(TOOL_PARSERS[name](), split)
    assert (got_content, [(n, json.loads(arguments)) for n, arguments in got_calls]) == (content, calls)
    firsts = [d for d in deltas if d.id is not None]
    assert [d.index for d in firsts] == list(range(len(calls)))  # one first delta per call, in order
    assert all(d.name is None for d in deltas if d.id is None)  # the later ones carry arguments only
    assert len({d.id for d in firsts}) == len(calls)


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_call_the_parser_cannot_read_makes_the_whole_output_content(name):
    for text in MALFORMED[name]:
        content, calls, _ = whole(TOOL_PARSERS[name](), text)
        assert (content, calls) == (text, []), text


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_stream_gives_back_what_it_cannot_read_as_content(name, smollm2_tokenizer):
    for text in MALFORMED[name]:
        content, _, deltas = streamed(TOOL_PARSERS[name](), token_pieces(smollm2_tokenizer, text))
        assert content is not None or deltas, text  # nothing is lost without a trace
        if not deltas:
            assert content == text


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_text_without_calls_is_content_as_it_is(name, smollm2_tokenizer):
    assert whole(TOOL_PARSERS[name](), PLAIN)[:2] == (PLAIN, [])
    assert streamed(TOOL_PARSERS[name](), token_pieces(smollm2_tokenizer, PLAIN))[:2] == (PLAIN, [])


def test_mistral_call_ids_are_nine_letters_and_digits_and_the_others_vllms():
    _, _, parsed = whole(TOOL_PARSERS["mistral"](), CASES["mistral"]["a list of calls"][0])
    assert all(re.fullmatch("[A-Za-z0-9]{9}", call.id) for call in parsed.tool_calls)
    _, _, parsed = whole(TOOL_PARSERS["hermes"](), CASES["hermes"]["one call"][0])
    assert re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", parsed.tool_calls[0].id)


def test_required_reads_the_forced_list_of_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, ' \
           '{"name": "get_time", "parameters": {"zone": "Zürich", "at": [1, {"note": "a } and a \\" inside"}]}}]'
    assert whole(RequiredToolParser(), text)[:2] == (None, [WEATHER_PARIS, TIME_ZURICH])
    content, calls, _ = streamed(RequiredToolParser(), list(text))
    assert (content, [(n, json.loads(a)) for n, a in calls]) == (None, [WEATHER_PARIS, TIME_ZURICH])


def test_a_named_function_takes_the_whole_output_as_its_arguments():
    text = '{"city": "Paris", "unit": "celsius"}'
    assert whole(NamedToolParser("get_weather"), text)[:2] == (None, [WEATHER_PARIS])
    assert streamed(NamedToolParser("get_weather"), list(text))[:2] == (None, [("get_weather", text)])


def test_without_parallel_tool_calls_only_the_first_call_is_given():
    text = CASES["hermes"]["two calls after text"][0]
    parsed = OutputParser(None, TOOL_PARSERS["hermes"](), parallel_tool_calls=False).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [WEATHER_PARIS]
    stream = OutputParser(None, TOOL_PARSERS["hermes"](), parallel_tool_calls=False)
    deltas = [stream.feed(c) for c in text] + [stream.finish()]
    assert {c.index for d in deltas for c in d.tool_calls} == {0}
