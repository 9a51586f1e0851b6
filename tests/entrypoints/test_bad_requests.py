"""Bad requests get a 4xx with OpenAI's error JSON whose message names the field, and the
server serves on."""
import pytest

from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL_NAME

pytestmark = pytest.mark.timeout(300)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **fields}


# (route, body, status, the field the error names: in its message and as its param)
BAD_REQUESTS = {
    "wrong type": (COMPLETIONS, completion(max_tokens="many"), 400, "max_tokens"),
    "wrong type in chat": (CHAT, chat(temperature="hot"), 400, "temperature"),
    "messages not a list": (CHAT, chat(messages="hi"), 400, "messages"),
    "prompt of no allowed type": (COMPLETIONS, completion(prompt=["a", 3]), 400, "prompt"),
    "negative max_tokens": (COMPLETIONS, completion(max_tokens=-3), 400, "max_tokens"),
    "zero max_completion_tokens": (CHAT, chat(max_tokens=None, max_completion_tokens=0), 400,
                                   "max_completion_tokens"),
    "max_tokens beyond the model length": (COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    "oversized prompt": (COMPLETIONS, completion(prompt="x" * (MAX_MODEL_LEN + 10)), 400, "prompt"),
    "oversized chat": (CHAT, chat(messages=[{"role": "user", "content": "x" * MAX_MODEL_LEN}]), 400, "messages"),
    "unknown field": (COMPLETIONS, completion(max_token=5), 400, "max_token"),
    "unknown field in chat": (CHAT, chat(functions=[]), 400, "functions"),
    "negative temperature": (COMPLETIONS, completion(temperature=-1.0), 400, "temperature"),
    "n of 0": (CHAT, chat(n=0), 400, "n"),
    "logprobs beyond max_logprobs": (COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    "tools on a server without --enable-auto-tool-choice": (
        CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]), 400,
        "tool_choice"),
    "logit_bias key not a token id": (CHAT, chat(logit_bias={"abc": 1.0}), 400, "logit_bias"),
    "best_of above n": (COMPLETIONS, completion(best_of=3), 400, "best_of"),
    "empty prompt": (COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    "token outside the vocabulary": (COMPLETIONS, completion(prompt=[5, 100000]), 400, "vocabulary"),
    "empty conversation": (CHAT, chat(messages=[]), 400, "messages"),
    "image content part": (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
                           "messages"),
    "unknown model": (COMPLETIONS, completion(model="gpt-9"), 404, "model"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_a_bad_request_gets_an_error_naming_the_field(client, name):
    route, body, status, field = BAD_REQUESTS[name]
    r = client.post(route, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert field in error["message"], error
    if field != "vocabulary":
        assert error["param"] == field, error


def test_malformed_json_is_a_400_and_the_server_serves_on(client):
    r = client.post(COMPLETIONS, content=b'{"model": "tiny-llama", "prompt": ', headers={"content-type":
                                                                                         "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for name in ("wrong type", "oversized prompt", "logprobs beyond max_logprobs"):
        route, body, _, _ = BAD_REQUESTS[name]
        assert client.post(route, json=body).status_code == 400
    r = client.post(COMPLETIONS, json=completion(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = client.post(CHAT, json=chat(max_tokens=2, ignore_eos=True, stream=True))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_a_generating_server_answers_embeddings_and_score_with_a_400_naming_the_runner(client):
    for route, body in [("/v1/embeddings", {"model": MODEL_NAME, "input": "hello"}),
                        ("/score", {"model": MODEL_NAME, "text_1": "a", "text_2": "b"})]:
        r = client.post(route, json=body)
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text
