"""scripts/gpu_run.sh, the GPU runner: it parses (bash -n); its dry run lists each part's
commands, with the settings the measurements in docs/benchmarks.md ran under, and every jaxllm
command among them parses; its budget skips a command that would not fit; --tiny runs a part
end to end on the CPU."""
import os
import re
import shlex
import subprocess

import pytest

from jaxllm.benchmarks import ENGINE_BENCHES, OTHER_BENCHES
from jaxllm.cli import main

pytestmark = pytest.mark.usefixtures("warm_up_every_engine")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = os.path.join(ROOT, "scripts", "gpu_run.sh")
PARTS = ["smoke", "step", "tput", "tput1000", "tput2048", "qwen", "startup", "fp8", "prefix", "prefill", "serve",
         "sampling", "hf-compare", "kernels", "long", "check", "hybrid", "weights", "invariant", "spec", "draft", "eagle",
         "moe-matmul", "ssd", "lora", "embed", "tools", "models", "kv-dtype", "quant", "sampler", "multi-gpu"]
ENGINE_8B = "--model llama-3.1-8b --load-format dummy --dtype bfloat16"


def runner(*args: str, env: dict | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", RUNNER, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def dry_run(*parts: str, env: dict | None = None) -> dict[str, list[str]]:
    """part -> the commands its dry run lists."""
    done = runner("--dry-run", *parts, env=env)
    assert done.returncode == 0, done.stderr
    commands, part = {}, None
    for line in done.stdout.splitlines():
        if line.startswith("==== "):
            part = line[5:]
            commands[part] = []
        elif line.startswith("$ ") and part:
            commands[part].append(line[2:])
    return commands


def test_the_runner_parses():
    assert subprocess.run(["bash", "-n", RUNNER]).returncode == 0


def test_every_part_lists_its_commands():
    commands = dry_run(*PARTS)
    assert list(commands) == PARTS
    assert all(commands[part] for part in PARTS)


def test_profile_is_the_fp8_step_startup_and_tput_parts():
    assert list(dry_run("profile")) == ["fp8", "step", "startup", "tput"]


def test_an_unknown_part_is_refused_before_anything_runs():
    done = runner("--dry-run", "tput", "benchmarks")
    assert done.returncode == 2 and "unknown part benchmarks" in done.stderr and "====" not in done.stdout


def test_the_wheel_folder_is_installed_first():
    done = runner("--dry-run", "--wheels", "/wheels", "tput")
    lines = done.stdout.splitlines()
    assert lines[1].startswith("$ python3 -m pip install -q --no-index --no-deps") and "--target /tmp/site" in lines[1]
    assert lines[2] == "$ python3 -m pip install -q --no-index --no-deps --no-build-isolation -e ."


@pytest.mark.parametrize("part, expected", [
    ("tput", f"bench throughput {ENGINE_8B} --max-model-len 2048 --max-num-seqs 1024 --max-num-batched-tokens 16384 "
             "--input-len 128 --output-len 128 --num-prompts 1000"),
    ("tput2048", f"bench throughput {ENGINE_8B} --max-model-len 2176 --max-num-seqs 1024 "
                 "--max-num-batched-tokens 16384 --input-len 2048 --output-len 128 --num-prompts 1000"),
    ("step", f"bench step {ENGINE_8B} --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 8192 "
             "--batch-sizes 1,256 --input-len 1000 --output-len 96 --profile-dir /tmp/profile"),
    ("prefix", f"bench throughput {ENGINE_8B} --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 8192 "
               "--prefix-len 1024 --input-len 128 --output-len 128 --num-prompts 1000 --enable-prefix-caching"),
    ("serve", "bench serve --base-url http://127.0.0.1:8765 --num-prompts 1000 --random-input-len 1000 "
              "--random-output-len 1000 --ignore-eos --temperature 1.0 --request-rate inf --max-concurrency 256"),
    ("hf-compare", "bench hf --config models/configs/llama-3.1-8b.json --batch-sizes 1,64,256 --input-len 128 "
                   "--output-len 128"),
    ("sampling", "--sampling all --structured-requests 64"),
    ("startup", f"bench startup {ENGINE_8B} --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 8192 "
                "--skip-tokenizer-init"),
])
def test_a_part_runs_with_the_settings_of_its_measurements(part, expected):
    assert any(expected in command for command in dry_run(part)[part])


def test_quant_and_kv_reach_the_engine_parts_but_not_startup():
    commands = dry_run("step", "tput", "startup", env={"QUANT": "fp8", "KV": "fp8"})
    assert all("--quantization fp8 --kv-cache-dtype fp8" in c for c in commands["step"] + commands["tput"])
    assert not any("--quantization" in c for c in commands["startup"])


def test_multi_gpu_runs_each_configuration_in_its_modes():
    [*benches, report] = dry_run("multi-gpu", env={"MULTI": "tp2:step dp2:long 70b-tp4:short"})["multi-gpu"][1:]
    assert [re.search(r"bench (\w+)", c)[1] for c in benches] == ["step", "throughput", "throughput"]
    assert "-tp 2" in benches[0] and "--profile-dir /tmp/prof-tp2" in benches[0]
    assert "-dp 2" in benches[1] and "--input-len 1000 --output-len 1000" in benches[1]
    assert "--model llama-3.1-70b" in benches[2] and "-tp 4" in benches[2]
    assert all(c.startswith("env NCCL_NVLS_ENABLE=0 ") for c in benches)
    assert report.endswith("bench report multi --dir /tmp/out/multi-gpu --configs tp2:step dp2:long 70b-tp4:short")


def test_every_jaxllm_command_of_every_part_parses(monkeypatch):
    called = []
    for name, module in {**ENGINE_BENCHES, **OTHER_BENCHES}.items():
        monkeypatch.setattr(module, "main", lambda *args, name=name: called.append(name) or 0)
    commands = [c for part in dry_run(*PARTS).values() for c in part if "-m jaxllm.cli bench" in c]
    for command in commands:
        argv = shlex.split(command)
        assert main(argv[argv.index("jaxllm.cli") + 1:]) == 0, command
    assert len(called) == len(commands) and {"throughput", "step", "serve", "hf", "bounds", "report"} <= set(called)


def test_a_command_that_does_not_fit_the_budget_is_skipped(tmp_path):
    done = runner("--tiny", "--out", str(tmp_path), "--budget-s", "60", "tput")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIPPED throughput 128/128: 40 s left, it needs ~120 s" in done.stdout


@pytest.mark.timeout(600)
def test_the_prefix_part_runs_on_the_tiny_llama_and_prints_its_table(tmp_path):
    done = runner("--tiny", "--out", str(tmp_path), "--budget-s", "560", "prefix", timeout=580)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(tmp_path / "prefix")) == ["prefix_enable-prefix-caching.json",
                                                      "prefix_no-enable-prefix-caching.json"]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| off ", "| on "))]
    assert len(rows) == 2 and "% (" in rows[1]  # the cache found the shared prefix
    assert "on / off throughput:" in done.stdout and (tmp_path / "log.txt").exists()
