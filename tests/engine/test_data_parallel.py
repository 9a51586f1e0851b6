"""Data parallelism on one host: replicas in processes of their own give the outputs of
one engine, share the requests, and merge their stats."""
import asyncio

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.engine.dp_client import replica_env
from tests.conftest import child_pids, host_devices_flags, tiny_model

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, skip_tokenizer_init=True,
              show_progress=False)
PARAMS = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)]


def prompts(num=12):
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(3, 256, int(rng.integers(5, 40))).tolist()} for _ in range(num)]


def generate(llm):
    return [[o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)] for params in PARAMS]


@pytest.fixture(scope="module")
def single():
    with LLM(tiny_model("llama"), **ENGINE) as llm:
        return generate(llm)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)], ids=["dp2", "dp2xtp2", "dp2xpp2"])
def test_replicas_give_one_engines_outputs_and_share_the_requests(single, tp, pp, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", host_devices_flags(2))  # the replicas' CPUs
    with LLM(tiny_model("llama"), data_parallel_size=2, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             **ENGINE) as llm:
        assert generate(llm) == single
        client = llm.llm_engine.engine_core
        served = [c.call_utility("get_stats")["prefix_cache_queries"] for c in client.clients]
        assert all(tokens > 0 for tokens in served)  # both replicas took requests
        stats = llm.llm_engine.get_stats()
        assert stats["prefix_cache_queries"] == sum(served) and stats["num_free_blocks"] == stats["num_blocks"]
        assert client.config.parallel.data_parallel_size == 2
        assert client.config.parallel.pipeline_parallel_size == pp  # each replica's stages on its 2 devices
        pids = [c.proc.pid for c in client.clients]
    assert not set(pids) & set(child_pids())


@pytest.mark.timeout(600)
def test_async_replicas_stream_and_abort():
    async def run():
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model("llama"), data_parallel_size=2, **{
            k: v for k, v in ENGINE.items() if k != "show_progress"}), show_progress=False)
        try:
            async def one(i, prompt):
                final = None
                async for out in engine.generate(prompt, PARAMS[0], f"r{i}"):
                    final = out
                return final.outputs[0].token_ids

            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts())))
            stats = await engine.get_stats()
            return results, stats
        finally:
            engine.shutdown()

    results, stats = asyncio.run(run())
    assert all(len(tokens) == 12 for tokens in results)
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_replica_env_gives_each_replica_its_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert replica_env(1, 2)["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert replica_env(1, 2)["JAXLLM_DATA_PARALLEL_RANK"] == "1"
    with pytest.raises(ValueError, match="more GPUs"):
        replica_env(2, 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert replica_env(3, 2)["CUDA_VISIBLE_DEVICES"] == "6,7"


@pytest.mark.timeout(600)
def test_ray_replicas_give_one_engines_outputs(single):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with LLM(tiny_model("llama"), data_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
            assert generate(llm) == single
            client = llm.llm_engine.engine_core
            assert all(c.call_utility("get_stats")["prefix_cache_queries"] > 0 for c in client.clients)
            actors = [c._process.core.actor for c in client.clients]
        # Shut down: each replica's actor has returned from its engine core.
        assert all(c._process.core.exit_code() == 0 for c in client.clients), actors
    finally:
        ray.shutdown()
