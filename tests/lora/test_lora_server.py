"""LoRA adapters through a real `jaxllm serve` (--enable-lora --lora-modules), with the official
`openai` client: each adapter is a model name, its completions are PEFT's greedy tokens, and
adapters load and unload at run time ($JAXLLM_ALLOW_RUNTIME_LORA_UPDATING), a bad one a 400."""
import argparse
import os

import httpx
import openai
import pytest

from jaxllm.entrypoints.openai.cli_args import lora_module
from jaxllm.entrypoints.openai.serving_models import runtime_lora_updating
from tests.conftest import tiny_model
from tests.entrypoints.conftest import MODEL_NAME, metric_values, scrape, start_server
from tests.lora.adapters import MAX_LORA_RANK, golden, write_adapter

pytestmark = pytest.mark.timeout(300)  # a hung server fails the test; the fixture stops it either way


@pytest.fixture(scope="module")
def server(char_llama, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")  # the server process inherits it
        server = start_server(char_llama, tmp_path_factory, "lora_server", "--enable-lora", "--max-loras", "2",
                              "--max-lora-rank", str(MAX_LORA_RANK), "--lora-modules",
                              f"attn={tiny_model('lora/attn_r8')}",
                              f'{{"name": "mlp", "path": "{tiny_model("lora/mlp_r4_rslora")}"}}')
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0)


@pytest.fixture(scope="module")
def decode(char_llama):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(char_llama, "tokenizer.json")).decode


def completion(client, model: str, prompt_index: int = 0) -> str:
    prompt = golden()[f"prompt_{prompt_index}"].tolist()
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def expected(decode, model: str, prompt_index: int = 0) -> str:
    return decode(golden()[f"{model}_tokens"][prompt_index].tolist())


def test_models_lists_each_adapter_with_the_base_model_as_parent(client):
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) >= {MODEL_NAME, "attn", "mlp"}
    assert cards["attn"].parent == MODEL_NAME and cards["attn"].root == tiny_model("lora/attn_r8")
    assert getattr(cards[MODEL_NAME], "parent", None) is None


def test_a_completion_on_an_adapter_name_runs_on_that_adapter(client, decode):
    assert completion(client, "attn", 0) == expected(decode, "attn_r8", 0)
    assert completion(client, "mlp", 1) == expected(decode, "mlp_r4_rslora", 1)
    assert completion(client, MODEL_NAME, 0) == expected(decode, "base", 0)
    chat = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "attn" and chat.choices[0].finish_reason in ("length", "stop")


def test_an_unknown_model_name_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        completion(client, "no-such-adapter")


def test_an_adapter_loads_and_unloads_at_run_time(server, client, decode):
    path = tiny_model("lora/all_r16")
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": path}, timeout=60)
    assert r.status_code == 200, r.text
    assert "all" in {card.id for card in client.models.list().data}
    assert completion(client, "all", 2) == expected(decode, "all_r16", 2)
    assert completion(client, "attn", 2) == expected(decode, "attn_r8", 2)  # three adapters, two slots
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "all"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        completion(client, "all")
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "all"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("body, message", [
    ({"lora_name": "big", "lora_path": "RANK32"}, "r=32 exceeds max_lora_rank"),
    ({"lora_name": "gone", "lora_path": "/no/such/adapter"}, "is not a folder"),
    ({"lora_name": "attn", "lora_path": tiny_model("lora/attn_r8")}, "has already been loaded"),
    ({"lora_name": "x"}, "lora_path"),
])
def test_a_bad_load_is_a_400_and_the_server_serves_on(server, client, decode, tmp_path, body, message):
    if body.get("lora_path") == "RANK32":
        body = {**body, "lora_path": write_adapter(tmp_path / "big", r=32)}
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert completion(client, "attn", 0) == expected(decode, "attn_r8", 0)


def test_lora_modules_take_name_equals_path_or_vllm_json():
    assert lora_module("a=/x/y") == ("a", "/x/y")
    assert lora_module('{"name": "a", "path": "/x/y", "base_model_name": "m"}') == ("a", "/x/y")
    for bad in ("no-path", "=/x", '{"name": "a"}'):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module(bad)


def test_runtime_updating_is_off_unless_a_variable_says_true(monkeypatch):
    for name in ("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    assert not runtime_lora_updating()
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert runtime_lora_updating()


def test_metrics_show_the_running_adapters(server):
    body = {"model": "attn", "prompt": [5, 17, 99], "max_tokens": 400, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        for _ in range(5):  # a few steps in: each step's stats name the running adapters
            next(lines)
        running = metric_values(scrape(server), "jaxllm:lora_requests_info")
    assert list(running) == ['{max_lora="2",running_lora_adapters="attn",waiting_lora_adapters=""}'], running
