"""Tool calling and reasoning through a real server (the official `openai` client) on the tiny
Llama with a byte-level tokenizer that holds <think> and </think>, served as Qwen3 is:
`--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`. Its chat
template renders the tools, earlier calls and tool results, and opens the thinking in the
prompt unless enable_thinking is false (then it closes it there).

A random model writes no tool call of its own: forced calls ("required", a named function)
come from structured outputs, and an "auto" call from a regex that spells one; a bias on
</think> ends the thinking soon."""
import json

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import MODEL_NAME, THINK_END_ID, start_server

pytestmark = pytest.mark.timeout(300)

TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }}({{ t.function.parameters.properties | list | "
    "join(',') }});{% endfor %}</tools>{% endif -%}"
    "{%- for m in messages %}<{{ m.role }}>"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{%- if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}|{% endfor -%}"
    "{%- if add_generation_prompt %}<assistant><think>{% if enable_thinking is defined and not enable_thinking %}"
    "</think>{% endif %}{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "weather?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# A random model given whitespace or the next JSON token mostly picks whitespace (byte b is token b + 3).
NO_WHITESPACE = {str(ord(c) + 3): -100.0 for c in " \t\n\r"}
# ... and ends its thinking within a few dozen tokens, not with EOS (a grammar's EOS still wins: it is alone).
END_THINKING_SOON = {**NO_WHITESPACE, str(THINK_END_ID): 2.0, "2": -100.0}
A_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>'


@pytest.fixture(scope="module")
def server(think_llama, tmp_path_factory):
    server = start_server(think_llama, tmp_path_factory, "tools", "--enable-auto-tool-choice", "--tool-call-parser",
                          "hermes", "--reasoning-parser", "qwen3", chat_template=TEMPLATE)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120.0, max_retries=0)


def chat(api, **fields):
    extra = {**fields.pop("extra_body", {}), **fields.pop("thinking", NO_THINKING)}
    return api.chat.completions.create(model=MODEL_NAME, messages=fields.pop("messages", USER),
                                       max_tokens=fields.pop("max_tokens", 120), tools=fields.pop("tools", TOOLS),
                                       extra_body=extra, **fields)


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")


def stream_message(stream) -> tuple[str, str, dict, str, list]:
    """A streamed choice 0: its reasoning, content, calls {index: [id, name, arguments]}, finish reason and
    tool call deltas."""
    reasoning = content = finish = ""
    calls, deltas = {}, []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for d in delta.tool_calls or ():
                deltas.append(d)
                if d.id is not None:
                    calls[d.index] = [d.id, d.function.name, ""]
                calls[d.index][2] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish, deltas


@pytest.mark.parametrize("seed", range(3))
def test_required_gives_calls_whose_arguments_fit_their_function(api, seed):
    out = chat(api, tool_choice="required", seed=seed, logit_bias=NO_WHITESPACE, max_tokens=300)
    choice = out.choices[0]
    assert_valid_calls(choice.message.tool_calls)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_required_without_parallel_tool_calls_gives_one_call(api):
    for seed in range(3):
        calls = chat(api, tool_choice="required", seed=seed, logit_bias=NO_WHITESPACE,
                     parallel_tool_calls=False).choices[0].message.tool_calls
        assert len(calls) == 1
        assert_valid_calls(calls)


@pytest.mark.parametrize("seed", range(3))
def test_a_named_function_is_called_with_arguments_that_fit_it(api, seed):
    out = chat(api, tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=seed,
               logit_bias=NO_WHITESPACE)
    choice = out.choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert_valid_calls(choice.message.tool_calls)
    assert choice.finish_reason == "stop"  # OpenAI's for a named function


def test_a_streamed_forced_call_sends_its_name_first_then_its_arguments(api):
    stream = chat(api, tool_choice="required", seed=2, logit_bias=NO_WHITESPACE, max_tokens=300, stream=True)
    _, content, calls, finish, deltas = stream_message(stream)
    whole = chat(api, tool_choice="required", seed=2, logit_bias=NO_WHITESPACE, max_tokens=300)
    whole = whole.choices[0].message.tool_calls
    assert [(name, args) for _, name, args in calls.values()] == [(c.function.name, c.function.arguments)
                                                                  for c in whole]
    assert content == "" and finish == "tool_calls"
    for d in deltas:
        if d.id is not None:
            assert d.type == "function" and d.function.name in SCHEMAS and d.function.arguments == ""
        else:
            assert d.function.name is None and d.type is None


def test_auto_reads_the_call_the_model_writes_streamed_or_not(api):
    spelled = {"structured_outputs": {"regex": "Sure\\." + A_CALL.replace("{", "\\{").replace("}", "\\}")}}
    choice = chat(api, tool_choice="auto", extra_body=spelled).choices[0]
    assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    _, content, calls, finish, _ = stream_message(chat(api, extra_body=spelled, stream=True))
    assert (content, finish) == ("Sure.", "tool_calls")
    assert [(name, json.loads(args)) for _, name, args in calls.values()] == \
        [("get_weather", {"city": "Oslo", "unit": "celsius"})]


@pytest.mark.parametrize("seed", range(3))
def test_structured_outputs_shape_the_answer_after_the_thinking(api, seed):
    schema = SCHEMAS["get_weather"]
    out = chat(api, tools=None, thinking={}, seed=seed, max_tokens=200, logit_bias=END_THINKING_SOON,
               response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    message = out.choices[0].message
    assert message.reasoning_content  # free text: the grammar waited for </think>
    jsonschema.validate(json.loads(message.content), schema)
    reasoning, content, _, _, _ = stream_message(
        chat(api, tools=None, thinking={}, seed=seed, max_tokens=200, logit_bias=END_THINKING_SOON, stream=True,
             response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}))
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_a_forced_call_after_the_thinking(api):
    message = chat(api, tool_choice="required", thinking={}, seed=1, max_tokens=300, parallel_tool_calls=False,
                   logit_bias=END_THINKING_SOON).choices[0].message
    assert message.reasoning_content
    assert_valid_calls(message.tool_calls)


def test_the_template_renders_tools_earlier_calls_and_their_results(server):
    messages = [*USER, {"role": "assistant", "content": None, "reasoning_content": "Oslo, then.",
                        "tool_calls": [{"id": "call_1", "type": "function", "function": {
                            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == ("<tools>get_weather(city,unit);get_time(utc);</tools><user>weather?|<assistant><think>Oslo, "
                    "then.</think>" + A_CALL + "|<tool>sunny[call_1]|<assistant><think>")


BAD = {
    "a named function not in tools": ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                                      "tool_choice", "nope"),
    "tool_choice without tools": ({"tools": None, "tool_choice": "required"}, "tool_choice", "tools"),
    "a schema structured outputs cannot follow": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
         "tool_choice": "required"}, "tools", "tools[0].function.parameters"),
    "a forced call and a response_format": ({"tool_choice": "required", "response_format": {"type": "json_object"}},
                                            "tool_choice", "response_format"),
    "a tool of another type": ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools", "tools"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_tool_request_is_a_400_naming_the_field_and_the_server_serves_on(api, case):
    fields, param, named = BAD[case]
    with pytest.raises(openai.BadRequestError) as error:
        chat(api, **{"max_tokens": 4, **fields})
    assert error.value.body["param"] == param and named in error.value.body["message"]
    assert chat(api, tool_choice="none", max_tokens=4).choices[0].finish_reason in ("stop", "length")


def test_bench_serve_times_chat_requests_with_and_without_tools(server, tmp_path, capsys):
    from jaxllm.benchmarks.serve import sample_tools
    from jaxllm.cli import main
    runs = {}
    for num_tools in (0, 3):
        path = tmp_path / f"tools{num_tools}.json"
        assert main(["bench", "serve", "--base-url", server.url, "--endpoint", "/v1/chat/completions", "--num-prompts",
                     "4", "--random-input-len", "6", "--random-output-len", "5", "--ignore-eos", "--num-tools",
                     str(num_tools), "--output-json", str(path)]) == 0
        runs[num_tools] = json.loads(path.read_text())
    for num_tools, result in runs.items():
        assert result["completed"] == 4 and result["num_tools"] == num_tools
        assert result["endpoint"] == "/v1/chat/completions"
        assert result["output_lens"] == [5] * 4 and 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    # The served prompt lengths: the template's, and with tools the tools' rendering before the message.
    plain, with_tools = runs[0]["input_lens"], runs[3]["input_lens"]
    assert all(n > 6 for n in plain)
    rendered = sum(len(f"{t['function']['name']}({','.join(t['function']['parameters']['properties'])});")
                   for t in sample_tools(3))  # one token a character
    assert [b - a for a, b in zip(plain, with_tools)] == [len("<tools></tools>") + rendered] * 4
    status = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "1", "--num-tools", "2"])
    assert status != 0 and "--num-tools needs the chat endpoint" in capsys.readouterr().err
