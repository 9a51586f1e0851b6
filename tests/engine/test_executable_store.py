"""The executable store: a second start of the same config loads every executable the
first compiled, traces nothing and gives the same outputs; any change to what the
executables are built from is a new key, and a broken file is compiled again.

Each start is a process of its own, as a warm start is (and as XLA:CPU needs:
compilation.ExecutableStore.maybe), running this module: `python -m
tests.engine.test_executable_store OVERRIDES_JSON` prints one JSON line."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("warm_up_every_engine")]


def start(store_dir, env=None, **overrides) -> dict:
    """A start of the tiny Llama in a child with the store on in `store_dir` (and `env` in its
    environment): what its compile phase did, its outputs, and its log."""
    # XLA's own cache off: a warm start loads from the store alone, and on CPU nothing else deserializes.
    env = dict(os.environ, JAXLLM_EXECUTABLE_STORE=str(store_dir), JAXLLM_COMPILATION_CACHE="off", **(env or {}))
    result = subprocess.run([sys.executable, "-m", "tests.engine.test_executable_store", json.dumps(overrides)],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "log": result.stderr}


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> tuple[str, dict]:
    """A store filled by one start, and that start."""
    store_dir = str(tmp_path_factory.mktemp("store"))
    return store_dir, start(store_dir)


def test_a_second_start_loads_every_executable_and_gives_the_same_outputs(first):
    store_dir, first_start = first
    assert first_start["stored"] == 0
    second = start(store_dir)
    assert second["stored"] == second["executables"] > 0
    assert second["lowering_s"] == 0.0
    assert second["outputs"] == first_start["outputs"]
    assert len(first_start["outputs"][1][1]) == 6  # the sampled request's logprobs, compared too


def test_another_config_is_another_key(first, tmp_path):
    store_dir = shutil.copytree(first[0], tmp_path / "store")
    assert start(store_dir, max_num_seqs=1)["stored"] == 0


def test_a_kernel_chosen_by_the_environment_is_another_key(first, tmp_path):
    """JAXLLM_MOE_KERNEL, JAXLLM_SSD_KERNEL, JAXLLM_SSD_UPDATE and JAXLLM_MLA_PREFILL change what a model traces."""
    store_dir = shutil.copytree(first[0], tmp_path / "store")
    other = "expanded" if os.environ.get("JAXLLM_MLA_PREFILL") == "absorbed" else "absorbed"
    assert start(store_dir, env={"JAXLLM_MLA_PREFILL": other})["stored"] == 0


def test_a_broken_stored_executable_is_compiled_again(first, tmp_path):
    store_dir = shutil.copytree(first[0], tmp_path / "store")
    files = glob.glob(os.path.join(store_dir, "*", "*.exe"))
    assert len(files) == first[1]["executables"]
    with open(files[0], "wb") as f:
        f.write(b"not an executable")
    second = start(store_dir)
    assert second["stored"] == second["executables"] - 1
    assert "could not load the stored executable" in second["log"]
    assert second["outputs"] == first[1]["outputs"]


def test_the_store_keeps_the_keys_last_used(tmp_path):
    from jaxllm.compilation import prune_folders
    for i in range(5):
        (tmp_path / f"key{i}").mkdir()
        os.utime(tmp_path / f"key{i}", (1000 + i, 1000 + i))
    prune_folders(str(tmp_path), keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key2", "key3", "key4"]


def _child(overrides: dict) -> None:
    from jaxllm import LLM, SamplingParams
    args = dict(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=32, max_num_seqs=2,
                max_num_batched_tokens=16, enable_multiprocessing=False, show_progress=False)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": list(range(5, 25))}]
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7, logprobs=2)]
    with LLM(**{**args, **overrides}) as llm:
        split = re.search(r"(\d+) executables, (\d+) of them stored: loading [\d.]+ s, tracing and lowering "
                          r"([\d.]+) s", llm.llm_engine.engine_core.description)
        outs = []
        for out in llm.generate(prompts, params, use_tqdm=False):
            logprobs = out.outputs[0].logprobs or []
            outs.append((out.outputs[0].token_ids, [{t: lp.logprob for t, lp in s.items()} for s in logprobs]))
    print(json.dumps({"executables": int(split[1]), "stored": int(split[2]), "lowering_s": float(split[3]),
                      "outputs": outs}))


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
