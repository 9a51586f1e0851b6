"""/v1/responses through a real server and the official `openai` client, on the tiny Llama whose
byte-level tokenizer holds <think> and </think> (served as Qwen3: hermes tool calls, the qwen3
reasoning parser): conversations through previous_response_id, the stream's events in
OpenAI's order, function calls and their outputs, the bounded store, and the errors."""
import httpx
import openai
import pytest

from tests.entrypoints.conftest import MODEL_NAME, start_server
from tests.entrypoints.test_tool_calling import END_THINKING_SOON, NO_THINKING, NO_WHITESPACE, SCHEMAS, TEMPLATE

pytestmark = pytest.mark.timeout(300)

STORED = 4
TOOLS = [{"type": "function", "name": name, "parameters": schema} for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def server(think_llama, tmp_path_factory):
    server = start_server(think_llama, tmp_path_factory, "responses", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--max-stored-responses",
                          str(STORED), chat_template=TEMPLATE)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120.0, max_retries=0)


def respond(api, **fields):
    extra = {**NO_THINKING, **fields.pop("extra_body", {})}
    return api.responses.create(model=MODEL_NAME, max_output_tokens=fields.pop("max_output_tokens", 12),
                                temperature=0.0, extra_body=extra, **fields)


def prompt_tokens(server, messages, **fields) -> int:
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}, **fields}
    return httpx.post(server.url + "/tokenize", json=body).json()["count"]


def test_three_turns_through_previous_response_id_carry_the_conversation(api, server):
    first = respond(api, input="Hi there", instructions="Be brief.")
    second = respond(api, input="And then?", previous_response_id=first.id)
    third = respond(api, input=[{"role": "user", "content": [{"type": "input_text", "text": "Why?"}]}],
                    previous_response_id=second.id)
    assert [r.output[0].type for r in (first, second, third)] == ["message"] * 3
    assert third.previous_response_id == second.id and third.status in ("completed", "incomplete")
    conversation = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And then?"}, {"role": "assistant", "content": second.output_text},
                    {"role": "user", "content": "Why?"}]
    # The instructions were the first turn's alone; the outputs were carried.
    assert first.usage.input_tokens == prompt_tokens(server, [{"role": "system", "content": "Be brief."},
                                                              conversation[0]])
    assert third.usage.input_tokens == prompt_tokens(server, conversation)


def test_a_stored_response_is_there_to_get(api):
    made = respond(api, input="Hi", metadata={"topic": "greeting"})
    got = api.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    assert got.metadata == {"topic": "greeting"} and got.object == "response" and got.id.startswith("resp_")


def event_types(events) -> list[str]:
    return [e.type for e in events]


def test_a_streamed_answer_comes_as_openais_events_in_order(api):
    events = list(respond(api, input="Hi", stream=True, max_output_tokens=8))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = event_types(events)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    done = events[-1].response
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == done.output_text
    assert done.output[0].status == "incomplete" and done.output[0].content[0].text == text
    assert respond(api, input="Hi", max_output_tokens=8).output_text == text  # greedy: the whole output's


def test_thinking_then_calls_stream_as_a_reasoning_item_then_function_call_items(api):
    fields = dict(input="weather?", tools=TOOLS, tool_choice="required", max_output_tokens=300,
                  extra_body={"chat_template_kwargs": {}, "logit_bias": END_THINKING_SOON})
    events = list(respond(api, stream=True, **fields))
    types = event_types(events)
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    reasoning_end = types.index("response.output_item.done")
    assert types[4:reasoning_end] == ["response.reasoning_text.delta"] * (reasoning_end - 6) + [
        "response.reasoning_text.done", "response.content_part.done"]
    calls, rest = [], types[reasoning_end + 1:-1]
    while rest:  # each call: added, argument deltas, done, item done
        assert rest[0] == "response.output_item.added"
        end = rest.index("response.output_item.done")
        assert set(rest[1:end - 1]) == {"response.function_call_arguments.delta"}
        assert rest[end - 1] == "response.function_call_arguments.done"
        calls.append(rest[:end + 1])
        rest = rest[end + 1:]
    assert calls and types[-1] == "response.completed"
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning"] + ["function_call"] * len(calls)
    assert done.usage.output_tokens_details.reasoning_tokens > 0
    whole = respond(api, **fields)  # greedy: the same output, but for its ids
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in whole.output] == \
        [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in done.output]


def test_a_function_calls_output_goes_back_to_the_model(api, server):
    first = respond(api, input="weather?", tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                    max_output_tokens=60, extra_body={"logit_bias": NO_WHITESPACE})
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_time" and call.status == "completed"
    second = respond(api, previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    conversation = [{"role": "user", "content": "weather?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": "get_time", "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}]
    tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["parameters"]}} for t in TOOLS]
    assert second.usage.input_tokens == prompt_tokens(server, conversation, tools=tools)
    # The first response's output items, sent back as they came, make the same conversation.
    again = respond(api, tools=TOOLS, tool_choice="none",
                    input=[{"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True),
                           {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert again.usage.input_tokens == second.usage.input_tokens


def test_an_unknown_id_is_a_404_in_openais_error_shape(api, server):
    r = httpx.get(server.url + "/v1/responses/resp_nope")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "Response with id 'resp_nope' not found.",
                                  "type": "invalid_request_error", "param": None, "code": None}}
    with pytest.raises(openai.NotFoundError) as error:
        respond(api, input="Hi", previous_response_id="resp_nope")
    assert error.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(api):
    made = respond(api, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(made.id)


def test_the_store_drops_the_least_recently_used(api):
    ids = [respond(api, input="Hi", max_output_tokens=1).id for _ in range(STORED)]
    api.responses.retrieve(ids[0])  # now the most recently used
    respond(api, input="Hi", max_output_tokens=1)
    api.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(ids[1])


@pytest.mark.parametrize("fields,param,named", [
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "output": "x"}]}, "input",
     "input[1].call_id"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "input[0].type"),
    ({"input": "Hi", "max_output_tokens": 10_000}, "max_output_tokens", "max_output_tokens"),
    ({"input": "Hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
])
def test_a_bad_request_is_a_400_naming_its_field(api, fields, param, named):
    with pytest.raises(openai.BadRequestError) as error:
        respond(api, **{"max_output_tokens": 4, **fields})
    assert error.value.body["param"] == param and named in error.value.body["message"]
