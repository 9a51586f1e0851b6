"""response_format and vLLM's structured_outputs through the server, on the tiny Llama with
a byte-level tokenizer (llguidance reads it): a random model's output still fits the
constraint."""
import concurrent.futures
import json

import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import MODEL_NAME, start_server

pytestmark = pytest.mark.timeout(300)

# A random model given the choice between whitespace and the next JSON token mostly picks
# whitespace (four tokens against one): bias it away (byte b is token id b + 3).
NO_WHITESPACE = {str(ord(c) + 3): -100.0 for c in " \t\n\r"}
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


@pytest.fixture(scope="module")
def api(byte_llama, tmp_path_factory):
    server = start_server(byte_llama, tmp_path_factory, "structured")
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120.0, max_retries=0)
    finally:
        server.stop()


@pytest.mark.parametrize("seed", range(3))
def test_response_format_json_schema_gives_json_of_the_schema(api, seed):
    out = api.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "yes?"}], max_tokens=100, seed=seed,
        logit_bias=NO_WHITESPACE, response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_object_gives_a_json_object(api):
    stopped = 0
    for seed in range(3):
        out = api.completions.create(model=MODEL_NAME, prompt="{", max_tokens=100, seed=seed, logit_bias=NO_WHITESPACE,
                                     extra_body={"response_format": {"type": "json_object"}})
        text = out.choices[0].text
        assert text.startswith("{")
        if out.choices[0].finish_reason == "stop":  # else a random key or string ran out of tokens
            assert isinstance(json.loads(text), dict)
            stopped += 1
    assert stopped >= 1


def test_structured_outputs_choice_and_regex(api):
    for seed in range(3):
        out = api.completions.create(model=MODEL_NAME, prompt="pick", max_tokens=20, seed=seed,
                                     extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
        assert out.choices[0].text in ("red", "green", "blue")
        out = api.completions.create(model=MODEL_NAME, prompt="digits", max_tokens=20, seed=seed,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
        assert out.choices[0].text[:3].isdigit() and out.choices[0].text[3] == "-" and len(out.choices[0].text) == 6


def test_a_bad_constraint_is_a_400_naming_it(api):
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        api.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                               extra_body={"structured_outputs": {"regex": "[a-z"}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        api.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                    response_format={"type": "json_schema", "json_schema": {"name": "x"}})


@pytest.mark.parametrize("regex", [r"[^\s\S]", r"x[^\s\S]"])
def test_a_regex_no_output_can_match_is_a_400_and_a_request_in_flight_finishes(api, regex):
    # It was an empty completion with finish_reason "stop".
    def in_flight():
        return api.completions.create(model=MODEL_NAME, prompt="digits", max_tokens=40, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    expected = in_flight().choices[0].text
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        meanwhile = pool.submit(in_flight)
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                                   extra_body={"structured_outputs": {"regex": regex}})
        out = meanwhile.result(60)
    error = refused.value.body
    assert error["param"] == "structured_outputs" and "no output can match it" in error["message"]
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "length"
