"""Generated request bodies (OpenAI's fields with values of every type and size, unicode with
lone surrogates, nesting, unknown fields, bytes that are not UTF-8 or not JSON) sent to
every endpoint of a live server: each answer is a 2xx or a 4xx, never a 5xx or a dropped
connection; a well-formed stream in flight meanwhile finishes with its normal output; and
afterwards the engine holds no request and every KV block is free."""
import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.entrypoints.conftest import MODEL_NAME, StreamsInFlight, metric, start_server, wait_for_idle_engine

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 96  # short outputs, so the requests that pass are quick

TEXT = st.text(max_size=12)
ANY_TEXT = st.text(st.characters(exclude_categories=[]), max_size=12)  # lone surrogates ("Cs") too
INTS = st.one_of(st.integers(-3, 300), st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30]),
                 st.integers())
FLOATS = st.one_of(st.floats(-3, 3), st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -0.0]))
VALUES = st.recursive(st.one_of(st.none(), st.booleans(), INTS, FLOATS, ANY_TEXT),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
                      max_leaves=12)

# Valid values of each route's fields: (required, optional).
TOKEN_IDS = st.lists(st.integers(3, 255), min_size=1, max_size=6)
PROMPT_TEXT = st.text(min_size=1, max_size=12)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                           "content": TEXT | st.lists(st.fixed_dictionaries(
                                               {"type": st.just("text"), "text": TEXT}), max_size=2)}),
                    min_size=1, max_size=3)
SAMPLING = {
    "model": st.just(MODEL_NAME), "n": st.integers(1, 3), "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.1, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**63 - 1), "stream": st.booleans(),
    "stop": TEXT | st.lists(TEXT.filter(bool), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=3), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100), max_size=3),
    "user": TEXT, "min_tokens": st.integers(0, 2), "ignore_eos": st.booleans(),
    "allowed_token_ids": st.lists(st.integers(3, 255), min_size=1, max_size=5),
    "bad_words": st.lists(st.text("abc", min_size=1, max_size=3), max_size=2), "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "structured_outputs": st.sampled_from([{"regex": "[a-c]{1,4}"}, {"choice": ["yes", "no"]}, {"regex": "[^\\s\\S]"},
                                           {"json": {"type": "object"}}, {"grammar": 'start: "a" | "b"'}]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}
# (route, its required fields, its optional ones), each with a strategy of valid values.
ROUTES = [
    ("/v1/completions", {"prompt": PROMPT_TEXT | TOKEN_IDS | st.lists(PROMPT_TEXT, min_size=1, max_size=3)
                         | st.lists(TOKEN_IDS, min_size=1, max_size=3)},
     {**SAMPLING, "logprobs": st.integers(0, 5), "echo": st.booleans()}),
    ("/v1/chat/completions", {"messages": MESSAGES},
     {**SAMPLING, "max_completion_tokens": st.integers(1, 8), "logprobs": st.booleans(),
      "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
      "chat_template": st.sampled_from(["{{ messages }}", "{% for", "{{ raise_exception('x') }}"]),
      "chat_template_kwargs": st.dictionaries(TEXT, TEXT, max_size=2)}),
    ("/tokenize", {"prompt": TEXT}, {"model": st.just(MODEL_NAME), "add_special_tokens": st.booleans()}),
    ("/tokenize", {"messages": MESSAGES}, {"model": st.just(MODEL_NAME), "add_generation_prompt": st.booleans()}),
    ("/detokenize", {"tokens": TOKEN_IDS}, {"model": st.just(MODEL_NAME)}),
]


def bodies(required: dict, optional: dict) -> st.SearchStrategy[bytes]:
    """A valid body; one with a field or two given any value (or an unknown field); or bytes
    spoilt on the way: cut short, a byte no UTF-8 text holds, nested deep, any JSON at all."""
    valid = st.fixed_dictionaries(required, optional=optional)
    names = st.sampled_from(sorted({**required, **optional}) + ["unknown_field"])
    spoilt = st.tuples(valid, st.dictionaries(names, VALUES, min_size=1, max_size=2)).map(lambda t: {**t[0], **t[1]})
    as_json = json.dumps  # lone surrogates as "\ud800" escapes; NaN and Infinity as Python writes them
    return st.one_of(
        valid.map(as_json), valid.map(as_json), valid.map(as_json), spoilt.map(as_json), spoilt.map(as_json),
        st.tuples(valid.map(as_json), st.floats(0, 1)).map(lambda t: t[0][:int(len(t[0]) * t[1])]),
        valid.map(lambda body: as_json(body).replace('"', '"\udcff', 1)),  # the byte 0xFF, once encoded
        st.integers(1, 3000).map(lambda depth: '{"prompt": ' + "[" * depth + "]" * depth + "}"),
        VALUES.map(as_json)).map(lambda text: text.encode("utf-8", "surrogateescape"))


ROUTES_AND_BODIES = st.one_of([st.tuples(st.just(route), bodies(required, optional))
                               for route, required, optional in ROUTES])


@pytest.fixture(scope="module")
def fuzz_server(byte_llama, tmp_path_factory):
    server = start_server(byte_llama, tmp_path_factory, "fuzz", "--max-model-len", str(MAX_MODEL_LEN),
                          "--max-seqs-per-request", "8", "--max-request-body-bytes", "65536")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def streams_in_flight(fuzz_server):
    with StreamsInFlight(fuzz_server, max_tokens=32) as streams:
        yield streams


@pytest.fixture(scope="module")
def client(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=60.0) as client:
        yield client


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ROUTES_AND_BODIES)
def test_every_generated_body_gets_a_2xx_or_a_4xx(client, streams_in_flight, route_and_body):
    route, body = route_and_body
    with client.stream("POST", route, content=body, headers={"content-type": "application/json"}) as r:
        text = r.read().decode()  # a dropped connection raises here
    assert r.status_code < 500, (route, body[:300], text[:500])
    event(f"{route} {r.status_code}")  # pytest --hypothesis-show-statistics shows how many got through
    if r.status_code >= 400:
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
    else:
        json.loads(text)


def test_the_streams_in_flight_meanwhile_finished_with_their_normal_output(streams_in_flight):
    streams_in_flight.assert_all_normal()


def test_afterwards_no_request_is_left_in_the_engine_and_every_kv_block_is_free(fuzz_server):
    text = wait_for_idle_engine(fuzz_server)
    assert metric(text, "jaxllm:num_requests_running") == 0 and metric(text, "jaxllm:num_requests_waiting") == 0
    assert metric(text, "jaxllm:kv_cache_usage_perc") == 0.0
