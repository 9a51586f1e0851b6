"""`jaxllm bench serve` against the test server writes vLLM's figures and JSON keys."""
import json

import pytest

from jaxllm.cli import main
from tests.entrypoints.conftest import API_KEY, MODEL_NAME

pytestmark = pytest.mark.timeout(300)

KEYS = {"date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
        "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
        "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
        "generated_texts", "errors"}
KEYS |= {f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p99")
         for metric in ("ttft", "tpot", "itl", "e2el")}


def bench(server, tmp_path, *args) -> dict:
    path = tmp_path / "result.json"
    status = main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--ignore-eos",
                   "--output-json", str(path), *args])
    assert status == 0
    return json.loads(path.read_text())


def test_bench_serve_random_writes_vllms_keys_and_counts_every_token(server, tmp_path):
    result = bench(server, tmp_path, "--num-prompts", "24", "--random-input-len", "8", "--random-output-len", "6",
                   "--random-range-ratio", "0.5", "--max-concurrency", "8", "--request-rate", "200")
    assert KEYS <= set(result)
    assert result["model_id"] == MODEL_NAME and result["completed"] == 24 and result["failed"] == 0
    assert result["max_concurrency"] == 8 and result["request_rate"] == 200
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert result["total_output_tokens"] == sum(result["output_lens"]) and all(3 <= n <= 9 for n in result["output_lens"])
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration"])
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"] and result["p99_itl_ms"] > 0
    assert result["errors"] == [""] * 24


def test_bench_serve_reads_a_sharegpt_file(server, tmp_path):
    conversations = [{"conversations": [{"from": "human", "value": f"question number {i} is here"},
                                        {"from": "gpt", "value": "an answer of some length"[:10 + i]}]}
                     for i in range(6)]
    conversations.append({"conversations": [{"from": "human", "value": "hi"}]})  # no answer: skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    result = bench(server, tmp_path, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "6")
    assert result["completed"] == 6 and result["request_rate"] == float("inf")
    # The answers' lengths (one token a character), in the shuffled order the bench sent them.
    assert sorted(result["output_lens"]) == [len("an answer of some length"[:10 + i]) for i in range(6)]
    assert sorted(result["input_lens"]) == sorted(len(f"question number {i} is here") for i in range(6))


def test_bench_serve_names_a_lora_module_in_each_request_and_refuses_unknown_ones(server, tmp_path, capsys):
    result = bench(server, tmp_path, "--num-prompts", "4", "--random-input-len", "4", "--random-output-len", "2",
                   "--lora-modules", MODEL_NAME)
    assert result["completed"] == 4 and result["lora_modules"] == [MODEL_NAME]
    status = main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "1",
                   "--lora-modules", "no-such-adapter"])
    assert status != 0 and "--lora-modules ['no-such-adapter'] are not among the server's models" in \
        capsys.readouterr().err
