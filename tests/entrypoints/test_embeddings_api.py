"""/v1/embeddings and /score of a real `jaxllm serve --runner pooling` on 127.0.0.1 (the tiny Llama with
a character tokenizer, its config.json listing Matryoshka dimensions), through the official openai client
and plain HTTP: the vectors are HF transformers' final hidden states (tests/engine/test_embeddings.py's
reference and tolerance), as floats and as base64; a bad request is a 400 naming the field, and the
server serves on."""
import base64

import httpx
import numpy as np
import openai
import pytest

from tests.engine.test_embeddings import ATOL, golden, matryoshka_llama, normalized  # noqa: F401 (fixtures)
from tests.entrypoints.conftest import API_KEY, MODEL_NAME, start_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pooling_server(matryoshka_llama, tmp_path_factory):
    server = start_server(matryoshka_llama, tmp_path_factory, "pooling_server", "--runner", "pooling",
                          "--api-key", API_KEY)
    yield server  # pytest runs the rest at teardown, whatever the tests did
    server.stop()


@pytest.fixture(scope="module")
def client(pooling_server):
    with openai.OpenAI(base_url=pooling_server.url + "/v1", api_key=API_KEY, timeout=60.0, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(pooling_server):
    with httpx.Client(base_url=pooling_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60.0) as c:
        yield c


def test_embeddings_are_hf_transformers_last_hidden_states_normalized(client, golden):
    prompts = [prompt for prompt, _ in golden]
    response = client.embeddings.create(model=MODEL_NAME, input=prompts, encoding_format="float")
    assert [d.index for d in response.data] == list(range(len(golden)))
    for data, (_, hidden) in zip(response.data, golden):
        np.testing.assert_allclose(data.embedding, normalized(hidden[-1]), atol=ATOL, rtol=0)
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(p) for p in prompts)


def test_base64_holds_the_same_float32_values(client, golden):
    prompt, _ = golden[2]
    floats = client.embeddings.create(model=MODEL_NAME, input=[prompt], encoding_format="float").data[0].embedding
    raw = client.embeddings.create(model=MODEL_NAME, input=[prompt], encoding_format="base64").data[0].embedding
    assert isinstance(raw, str)
    assert np.frombuffer(base64.b64decode(raw), "<f4").tolist() == floats
    # Without encoding_format the client asks for base64 and decodes it itself.
    assert client.embeddings.create(model=MODEL_NAME, input=[prompt]).data[0].embedding == floats


def test_text_inputs_and_matryoshka_dimensions(client, http):
    texts = ["the cat sat", "a dog ran"]
    full = [d.embedding for d in client.embeddings.create(model=MODEL_NAME, input=texts,
                                                          encoding_format="float").data]
    tokens = http.post("/tokenize", json={"prompt": texts[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model=MODEL_NAME, input=[tokens], encoding_format="float").data[0]
    assert by_ids.embedding == full[0]
    raw = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float",
                                   extra_body={"normalize": False}).data
    short = client.embeddings.create(model=MODEL_NAME, input=texts, dimensions=16, encoding_format="float").data
    for r, s in zip(raw, short):
        assert len(s.embedding) == 16
        np.testing.assert_allclose(s.embedding, normalized(np.array(r.embedding[:16])), atol=ATOL, rtol=0)


@pytest.mark.parametrize("route", ["/score", "/v1/score"])
def test_score_is_the_cosine_similarity_of_the_embeddings(http, route):
    texts = ["the cat sat", "the cat sat down", "zebra"]
    r = http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": texts})
    vectors = [np.array(d["embedding"]) for d in r.json()["data"]]  # normalized: a dot product is the cosine
    r = http.post(route, json={"model": MODEL_NAME, "text_1": texts[0], "text_2": texts[1:]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1] and body["object"] == "list"
    assert [d["score"] for d in body["data"]] == pytest.approx([vectors[0] @ vectors[1], vectors[0] @ vectors[2]],
                                                               abs=1e-6)


BAD_REQUESTS = {
    "dimensions the model does not list": ("/v1/embeddings", {"input": "hi", "dimensions": 20}, "dimensions"),
    "dimensions of 0": ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
    "empty input": ("/v1/embeddings", {"input": ""}, "input"),
    "no input": ("/v1/embeddings", {"input": []}, "input"),
    "an empty token list": ("/v1/embeddings", {"input": [[5, 6], []]}, "input"),
    "an unknown encoding_format": ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    "texts that do not pair": ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    "no text_2": ("/score", {"text_1": "a", "text_2": []}, "text_2"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_a_bad_request_is_a_400_naming_the_field_and_the_server_serves_on(http, name):
    route, body, field = BAD_REQUESTS[name]
    r = http.post(route, json={"model": MODEL_NAME, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error
    r = http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "hi"})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
