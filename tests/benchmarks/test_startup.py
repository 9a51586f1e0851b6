"""`jaxllm bench startup` on the tiny Llama: one start, timed, with the engine's split of it and
its outputs' digest; a later start whose outputs differ from the earlier one's fails."""
import json

import pytest

from jaxllm.benchmarks import startup
from jaxllm.cli import main
from tests.conftest import tiny_model

pytestmark = pytest.mark.timeout(300)
ENGINE_FLAGS = ["--model", tiny_model("llama"), "--skip-tokenizer-init", "--max-model-len", "128",
                "--no-enable-multiprocessing"]


@pytest.fixture(scope="module")
def started(tmp_path_factory) -> tuple[str, dict]:
    path = tmp_path_factory.mktemp("startup") / "cold.json"
    assert main(["bench", "startup", *ENGINE_FLAGS, "--output-json", str(path)]) == 0
    return str(path), json.loads(path.read_text())


def test_a_start_reports_its_time_its_phases_and_its_outputs(started):
    _, result = started
    assert result["startup_s"] > 0
    assert "start-up: weights" in result["description"] and "compile" in result["description"]
    assert len(result["outputs"]) == 16 and int(result["outputs"], 16) >= 0


def test_a_second_start_gives_the_first_ones_outputs(started, tmp_path, capsys):
    path, first = started
    assert main(["bench", "startup", *ENGINE_FLAGS, "--expect-outputs", path,
                 "--output-json", str(tmp_path / "warm.json")]) == 0
    assert json.loads((tmp_path / "warm.json").read_text())["outputs"] == first["outputs"]


def test_a_start_whose_outputs_differ_fails(started, monkeypatch, capsys):
    path, first = started
    monkeypatch.setattr(startup, "run_startup_bench", lambda engine_args: {**first, "outputs": "0" * 16})
    assert main(["bench", "startup", *ENGINE_FLAGS, "--expect-outputs", path]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"FAILED: the outputs differ from {path}'s: {'0' * 16} against {first['outputs']}")
