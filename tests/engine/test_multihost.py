"""Two hosts, one mesh: two processes of CPU devices joined by jax.distributed run one engine (host 0
serves, host 1 follows) with one process's outputs: TP = 8 over 4 devices each, and a pipeline of two
stages, one per host, each TP = 2."""
import os
import subprocess
import sys

import pytest

from jaxllm import LLM, SamplingParams
from tests.conftest import free_ports, host_devices_flags
from tests.engine.test_tensor_parallel import write_model

ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=32,
              skip_tokenizer_init=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 250, 41, 8]}, {"prompt_token_ids": list(range(30, 52))}]
PARAMS = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)]


def generate(llm):
    return [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)] for p in PARAMS]


def run_on_two_hosts(model: str, monkeypatch, devices_per_host: int, **parallel) -> tuple[list, dict]:
    """generate() on an engine over two processes with `devices_per_host` CPU devices each (host 0 this
    process's engine core, host 1 a `jaxllm worker`): the outputs, and the engine's stats at the end."""
    # The coordinator's port, and the four above it: the step broadcast, its handshake, and each host's
    # transfer server under pipeline parallelism.
    address = f"127.0.0.1:{free_ports(5)}"
    multihost = dict(distributed_executor_backend="multihost", num_hosts=2, coordinator_address=address, **parallel)
    env = dict(os.environ, XLA_FLAGS=host_devices_flags(devices_per_host), JAX_PLATFORMS="cpu")
    monkeypatch.setenv("XLA_FLAGS", env["XLA_FLAGS"])  # host 0's engine core: as many devices
    flags = ["--model", model, "--skip-tokenizer-init", "--host-rank", "1"]
    for key, value in {**multihost, **ENGINE}.items():
        if key != "skip_tokenizer_init":
            flags += [f"--{key.replace('_', '-')}", str(value)]
    worker = subprocess.Popen([sys.executable, "-m", "jaxllm.cli", "worker", *flags], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with LLM(model, show_progress=False, host_rank=0, **multihost, **ENGINE) as llm:
            got = generate(llm)
            stats = llm.llm_engine.get_stats()
        assert worker.wait(timeout=60) == 0  # host 0's shutdown ends it
    finally:
        if worker.poll() is None:
            worker.kill()
        output = worker.communicate(timeout=30)[0]
    assert worker.returncode == 0, output[-3000:]
    return got, stats


@pytest.mark.timeout(900)
def test_two_hosts_run_one_tensor_parallel_engine_with_one_process_outputs(tmp_path, monkeypatch):
    model = write_model(tmp_path)
    with LLM(model, show_progress=False, **ENGINE) as llm:
        want = generate(llm)
    got, stats = run_on_two_hosts(model, monkeypatch, 4, tensor_parallel_size=8)
    assert got == want
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.timeout(900)
def test_two_hosts_run_a_pipeline_stage_each_with_one_process_outputs(tmp_path, monkeypatch):
    """Pipeline parallelism with a stage per host: the residual stream and the sampled tokens cross
    between the hosts' devices (JAX's transfer servers), and host 0 reads every step's outputs."""
    model = write_model(tmp_path)
    with LLM(model, show_progress=False, **ENGINE) as llm:
        want = generate(llm)
    got, stats = run_on_two_hosts(model, monkeypatch, 2, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert got == want
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_multihost_flags_are_checked():
    from jaxllm.config import EngineArgs
    from tests.conftest import tiny_model
    for bad, field in [(dict(num_hosts=2), "num_hosts"), (dict(num_hosts=2, distributed_executor_backend="multihost",
                                                               host_rank=2, coordinator_address="h:1"), "host_rank"),
                       (dict(num_hosts=2, distributed_executor_backend="multihost"), "coordinator_address"),
                       (dict(distributed_executor_backend="mpi"), "distributed_executor_backend")]:
        with pytest.raises(ValueError, match=field):
            EngineArgs(model=tiny_model("llama"), **bad).create_config()
