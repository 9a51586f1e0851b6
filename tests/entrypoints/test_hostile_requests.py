"""Numbers and strings no field can take (integers beyond 64 bits, negative ids, floats and
booleans where integers go, NaN and Infinity, lone surrogates in every kind of string,
deep nesting, bodies that are not UTF-8 JSON objects) get a 4xx in OpenAI's error shape
naming the field, never a 500 or a dropped connection; a well-formed stream in flight
meanwhile finishes with its normal output."""
import json

import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, StreamsInFlight

pytestmark = pytest.mark.timeout(300)

COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
HUGE = 10**30
LONE = "\ud800"  # json.dumps writes it as the escape "\ud800", which JSON allows and UTF-8 cannot encode


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def message(**fields):
    return chat(messages=[{"role": "user", "content": "hi", **fields}])


def so(**constraint):
    return completion(structured_outputs=constraint)


# name: (route, body (JSON-able, or raw bytes), status, the field named in the message and as param)
HOSTILE = {
    # integers beyond 64 bits: msgpack to the engine core cannot carry them (this was a bare 500)
    "huge stop_token_ids": (COMPLETIONS, completion(stop_token_ids=[HUGE]), 400, "stop_token_ids"),
    "huge top_k": (COMPLETIONS, completion(top_k=HUGE), 400, "top_k"),
    "huge n": (COMPLETIONS, completion(n=HUGE), 400, "n"),
    "huge max_tokens": (COMPLETIONS, completion(max_tokens=HUGE), 400, "max_tokens"),
    "huge seed": (COMPLETIONS, completion(seed=HUGE), 400, "seed"),
    "huge min_tokens": (COMPLETIONS, completion(min_tokens=HUGE), 400, "min_tokens"),
    "huge allowed_token_ids": (COMPLETIONS, completion(allowed_token_ids=[HUGE]), 400, "allowed_token_ids"),
    "huge logprobs": (COMPLETIONS, completion(logprobs=HUGE), 400, "logprobs"),
    "huge best_of": (COMPLETIONS, completion(best_of=HUGE), 400, "best_of"),
    "huge top_logprobs": (CHAT, chat(logprobs=True, top_logprobs=HUGE), 400, "top_logprobs"),
    "huge max_completion_tokens": (CHAT, chat(max_tokens=None, max_completion_tokens=HUGE), 400,
                                   "max_completion_tokens"),
    "huge prompt token id": (COMPLETIONS, completion(prompt=[5, HUGE]), 400, "prompt"),
    "huge token id in a prompt list": (COMPLETIONS, completion(prompt=[[5], [HUGE]]), 400, "prompt"),
    "huge detokenize id": (DETOKENIZE, {"tokens": [HUGE]}, 400, "tokens"),
    "huge logit_bias key": (COMPLETIONS, completion(logit_bias={str(HUGE): 1.0}), 400, "logit_bias"),
    "100-digit logit_bias key": (COMPLETIONS, completion(logit_bias={"9" * 100: 1.0}), 400, "logit_bias"),
    "5000-digit integer": (COMPLETIONS, b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}", 400, None),
    # negative ids, and keys Python's int() reads but a token id is not
    "negative prompt token id": (COMPLETIONS, completion(prompt=[-5]), 400, "prompt"),
    "negative detokenize id": (DETOKENIZE, {"tokens": [-1]}, 400, "tokens"),
    "negative logit_bias key": (COMPLETIONS, completion(logit_bias={"-1": 1.0}), 400, "logit_bias"),
    "negative seed": (COMPLETIONS, completion(seed=-1), 400, "seed"),
    "logit_bias key with a space": (COMPLETIONS, completion(logit_bias={" 5": 1.0}), 400, "logit_bias"),
    "logit_bias key with an underscore": (COMPLETIONS, completion(logit_bias={"1_0": 1.0}), 400, "logit_bias"),
    "logit_bias key of Arabic digits": (COMPLETIONS, completion(logit_bias={"\u0665": 1.0}), 400, "logit_bias"),
    # other types where integers go (OpenAI's types are strict)
    "float max_tokens": (COMPLETIONS, completion(max_tokens=2.5), 400, "max_tokens"),
    "integral float n": (COMPLETIONS, completion(n=2.0), 400, "n"),
    "boolean n": (COMPLETIONS, completion(n=True), 400, "n"),
    "string max_tokens": (COMPLETIONS, completion(max_tokens="5"), 400, "max_tokens"),
    "boolean token id": (COMPLETIONS, completion(prompt=[5, True]), 400, "prompt"),
    # NaN and Infinity (Python's json writes and reads them; JSON has neither)
    "NaN temperature": (COMPLETIONS, completion(temperature=float("nan")), 400, "temperature"),
    "Infinity top_p": (COMPLETIONS, completion(top_p=float("inf")), 400, "top_p"),
    "-Infinity logit bias": (CHAT, chat(logit_bias={"5": float("-inf")}), 400, "logit_bias"),
    "1e400 frequency_penalty": (COMPLETIONS, b'{"prompt": "x", "frequency_penalty": 1e400}', 400,
                                "frequency_penalty"),
    # lone surrogates, in every kind of string (in model a 500; in a regex a dropped connection)
    "surrogate model": (COMPLETIONS, completion(model=LONE), 400, "model"),
    "surrogate model in chat": (CHAT, chat(model=LONE), 400, "model"),
    "surrogate model in tokenize": (TOKENIZE, {"model": LONE, "prompt": "x"}, 400, "model"),
    "surrogate model in detokenize": (DETOKENIZE, {"model": LONE, "tokens": [5]}, 400, "model"),
    "surrogate prompt": (COMPLETIONS, completion(prompt="a" + LONE), 400, "prompt"),
    "surrogate in a prompt list": (COMPLETIONS, completion(prompt=["a", LONE]), 400, "prompt"),
    "surrogate stop": (COMPLETIONS, completion(stop=LONE), 400, "stop"),
    "surrogate in stop list": (COMPLETIONS, completion(stop=["a", LONE]), 400, "stop"),
    "surrogate bad_words": (COMPLETIONS, completion(bad_words=[LONE]), 400, "bad_words"),
    "surrogate user": (COMPLETIONS, completion(user=LONE), 400, "user"),
    "surrogate regex": (COMPLETIONS, so(regex=LONE), 400, "structured_outputs"),
    "surrogate choice": (COMPLETIONS, so(choice=["a", LONE]), 400, "structured_outputs"),
    "surrogate grammar": (COMPLETIONS, so(grammar=f'start: "{LONE}"'), 400, "structured_outputs"),
    "surrogate JSON schema text": (COMPLETIONS, so(json='{"enum": ["' + LONE + '"]}'), 400, "structured_outputs"),
    "surrogate JSON schema": (COMPLETIONS, so(json={"enum": [LONE]}), 400, "structured_outputs"),
    "surrogate whitespace_pattern": (COMPLETIONS, so(json_object=True, whitespace_pattern=LONE), 400,
                                     "structured_outputs"),
    "surrogate response_format schema": (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"const": LONE}}}), 400, "response_format"),
    "surrogate logit_bias key": (COMPLETIONS, completion(logit_bias={LONE: 1.0}), 400, "logit_bias"),
    "surrogate content": (CHAT, message(content=LONE), 400, "messages"),
    "surrogate content part": (CHAT, message(content=[{"type": "text", "text": LONE}]), 400, "messages"),
    "surrogate role": (CHAT, chat(messages=[{"role": LONE, "content": "hi"}]), 400, "messages"),
    "surrogate name": (CHAT, message(name=LONE), 400, "messages"),
    "surrogate chat_template": (CHAT, chat(chat_template="{{ '" + LONE + "' }}"), 400, "chat_template"),
    "surrogate chat_template_kwargs value": (CHAT, chat(chat_template_kwargs={"x": LONE}), 400,
                                             "chat_template_kwargs"),
    "surrogate chat_template_kwargs key": (CHAT, chat(chat_template_kwargs={LONE: 1}), 400,
                                           "chat_template_kwargs"),
    "surrogate tokenize prompt": (TOKENIZE, {"prompt": LONE}, 400, "prompt"),
    "surrogate tokenize messages": (TOKENIZE, {"messages": [{"role": "user", "content": LONE}]}, 400, "messages"),
    "surrogate field name": (COMPLETIONS, completion(**{LONE: 1}), 400, "'\\ud800'"),
    # a grammar no output can match: it was an empty completion with finish_reason "stop"
    "regex of an empty class": (COMPLETIONS, so(regex=r"[^\s\S]"), 400, "structured_outputs"),
    # nesting, and bodies that are not UTF-8 JSON objects
    "nested 70 deep": (CHAT, chat(chat_template_kwargs={"x": json.loads("[" * 70 + "]" * 70)}), 400,
                       "chat_template_kwargs"),
    "nested 100000 deep": (COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    "a list body": (COMPLETIONS, b"[1, 2]", 400, None),
    "a null body": (CHAT, b"null", 400, None),
    "an empty body": (COMPLETIONS, b"", 400, None),
    "not UTF-8": (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    "UTF-16": (COMPLETIONS, json.dumps(completion()).encode("utf-16"), 400, None),
    "stream_options without stream": (COMPLETIONS, completion(stream_options={"include_usage": True}), 400,
                                      "stream_options"),
}


def post(client, route: str, body, content_type: str = "application/json"):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(route, content=content, headers={"content-type": content_type})


@pytest.fixture(scope="module")
def streams_in_flight(server):
    with StreamsInFlight(server, {"Authorization": f"Bearer {API_KEY}"}) as streams:
        yield streams


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_value_gets_a_4xx_naming_its_field(client, streams_in_flight, name):
    route, body, status, field = HOSTILE[name]
    r = post(client, route, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == field and (field is None or field in error["message"]), error


def test_a_body_that_is_not_json_gets_a_415(client, streams_in_flight):
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = post(client, COMPLETIONS, completion(), content_type)
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], r.text
    assert post(client, COMPLETIONS, completion(), "application/json; charset=utf-8").status_code == 200


def test_an_unknown_route_or_method_gets_openais_error_shape(client):
    for r in (client.get("/v1/nothing"), client.get("/v1/completions")):
        assert r.status_code in (404, 405) and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_streams_in_flight_meanwhile_finished_with_their_normal_output(streams_in_flight):
    streams_in_flight.assert_all_normal()
    assert len(streams_in_flight.results) >= 3
