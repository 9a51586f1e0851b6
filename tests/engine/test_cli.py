"""The `jaxllm` command: a user's mistake prints one line,
`jaxllm: error: ...`, and exits 2; a bad sampling flag fails before the engine is built;
a crash keeps its traceback."""
import os
import subprocess
import sys
import time

import pytest

import jaxllm
from jaxllm.cli import main
from jaxllm.models.gguf import find_default_model
from tests.conftest import tiny_model

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def truncated_gguf(tmp_path) -> str:
    path = tmp_path / "truncated.gguf"
    with open(find_default_model(), "rb") as f:
        path.write_bytes(f.read(4096))
    return str(path)


def assert_one_line_error(stderr: str, message: str) -> None:
    assert stderr.count("\n") == 1 and stderr.startswith(f"jaxllm: error: {message}"), stderr


@pytest.mark.parametrize("command", [["generate"], ["bench", "step"], ["bench", "throughput", "--input-len", "8"],
                                     ["bench", "latency"]], ids=["generate", "step", "throughput", "latency"])
@pytest.mark.parametrize("flags, message", [
    (["--block-size", "7"], "block_size must be 16, 32, 64 or 128, got 7"),
    (["--model", "/nonexistent"], "model '/nonexistent' not found"),
    (["--num-gpu-blocks-override", "0"], "num_gpu_blocks_override must be >= 1, got 0"),
    (["--model", "TRUNCATED"], "TRUNCATED is not a readable GGUF file"),
], ids=["block size", "no such model", "kv blocks", "truncated gguf"])
def test_a_bad_engine_flag_prints_one_line_and_exits_2(tmp_path, capsys, command, flags, message):
    gguf = truncated_gguf(tmp_path)
    flags = [gguf if f == "TRUNCATED" else f for f in flags]
    argv = [*command, "--model", tiny_model("llama"), *flags, "--no-enable-multiprocessing"]
    assert main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, message.replace("TRUNCATED", gguf))


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
    (["--max-tokens", "0"], "max_tokens must be >= 1, got 0"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--sampling-seed", "-5"], "seed must be in [0, 2**63), got -5"),
])
def test_a_bad_sampling_flag_fails_before_the_engine_is_built(monkeypatch, capsys, flags, message):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the sampling flags were checked")
    monkeypatch.setattr(jaxllm, "LLM", no_engine)
    start = time.perf_counter()
    assert main(["generate", "--model", tiny_model("llama"), *flags]) == 2
    assert time.perf_counter() - start < 1.0
    assert_one_line_error(capsys.readouterr().err, message)


def test_a_start_up_failure_in_the_core_process_prints_one_line_and_exits_2():
    result = subprocess.run([sys.executable, "-m", "jaxllm.cli", "generate", "--model", tiny_model("llama"),
                             "--block-size", "7", "--enable-multiprocessing"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "block_size must be 16, 32, 64 or 128, got 7")


def test_a_crash_keeps_its_traceback(monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("a bug in the engine")
    monkeypatch.setattr(jaxllm, "LLM", crash)
    with pytest.raises(RuntimeError, match="a bug in the engine"):
        main(["generate", "--model", tiny_model("llama")])


@pytest.mark.parametrize("flags, message", [
    (["--input-len", "0"], "argument --input-len: must be >= 1, got 0"),
    (["--output-len", "-2"], "argument --output-len: must be >= 1, got -2"),
    (["--batch-sizes", "1,0"], "argument --batch-sizes: must be >= 1, got 0"),
    (["--batch-sizes", "1,x"], "argument --batch-sizes: invalid batch_sizes value: '1,x'"),
])
def test_a_bad_bench_flag_is_an_argparse_error(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "step", "--model", tiny_model("llama"), *flags])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"jaxllm bench step: error: {message}\n")


@pytest.mark.parametrize("flags, field, value", [
    (["-tp", "2"], "tensor_parallel_size", 2),
    (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
    (["-dp", "3"], "data_parallel_size", 3),
    (["-pp", "4"], "pipeline_parallel_size", 4),
    (["--revision", "v2", "--download-dir", "/tmp/hub"], "download_dir", "/tmp/hub"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'], "speculative_config",
     {"method": "ngram", "num_speculative_tokens": 3}),
    (["--speculative-config", '{"method": "eagle3", "model": "/heads/e3", "num_speculative_tokens": 2}'],
     "speculative_config", {"method": "eagle3", "model": "/heads/e3", "num_speculative_tokens": 2}),
    (["--no-async-scheduling"], "async_scheduling", False),
    ([], "async_scheduling", None),
])
def test_parallelism_short_flags_and_hub_flags_set_engine_args(flags, field, value):
    import argparse
    from jaxllm.cli import add_engine_args, engine_args_from
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert getattr(engine_args_from(parser.parse_args(flags)), field) == value


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_speculative_config_that_is_not_a_json_object_is_an_argparse_error(capsys, text):
    with pytest.raises(SystemExit):
        main(["generate", "--speculative-config", text])
    assert "--speculative-config" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["-dp", "2", "--no-enable-multiprocessing"], "data_parallel_size > 1 (or the ray backend) runs each replica's "
     "engine core in a process of its own: enable_multiprocessing must not be False"),
    (["-pp", "64", "--no-enable-multiprocessing"], "pipeline_parallel_size=64 x tensor_parallel_size=1 exceeds the"),
])
def test_bad_parallelism_flags_print_one_line_and_exit_2(capsys, flags, message):
    assert main(["generate", "--model", tiny_model("llama"), *flags]) == 2
    assert_one_line_error(capsys.readouterr().err, message)
