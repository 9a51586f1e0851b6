"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, Granite 4.0-H) over 2, 4 and
8 devices, the experts whole on each device (enable_expert_parallel) or split as a dense MLP, the
attention and Mamba layers tensor parallel: the same greedy tokens and logprobs as one device, the
experts placed by the rules, and nothing compiled after warm-up. The tests need 8 devices; in a
process with fewer, the last test runs them in a child with 8 forced host devices."""
import json
import os

import jax
import pytest

from jaxllm import LLM
from jaxllm.config import EngineArgs
from tests.conftest import run_with_host_devices, tiny_model
from tests.engine.test_tensor_parallel import ENGINE, assert_same_outputs, outputs

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: the last test runs these with 8")


def run(name, tp, expert_parallel=True):
    with LLM(tiny_model(name), tensor_parallel_size=tp, enable_expert_parallel=expert_parallel, **ENGINE) as llm:
        return outputs(llm)


@pytest.fixture(scope="module")
def one_device():
    return {name: run(name, 1, expert_parallel=False)
            for name in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "granite_hybrid")}


@needs_8
def test_expert_parallelism_gives_one_devices_tokens_and_logprobs(one_device):
    """Qwen3-MoE (a dense layer between two sparse ones) over 2, 4 and 8 devices: 4, 2 and 1 of its
    8 experts on each; Qwen2-MoE (its shared expert tensor parallel) over 8; DeepSeek-V3 (routed in
    groups, its latent attention's heads split) over 4; Granite 4.0-H (its Mamba heads split) over 2."""
    for tp in (2, 4, 8):
        assert_same_outputs(run("qwen3_moe", tp), one_device["qwen3_moe"], f"qwen3_moe, expert parallel over {tp}")
    for name, tp in (("qwen2_moe", 8), ("deepseek_v3", 4), ("granite_hybrid", 2)):
        assert_same_outputs(run(name, tp), one_device[name], f"{name}, expert parallel over {tp}")


@needs_8
def test_experts_split_as_a_dense_mlp_give_one_devices_tokens_and_logprobs(one_device):
    assert_same_outputs(run("qwen3_moe", 8, expert_parallel=False), one_device["qwen3_moe"], "qwen3_moe, tp=8")


@needs_8
@pytest.mark.usefixtures("warm_up")
def test_each_device_holds_its_whole_experts_gives_one_devices_outputs_and_compiles_nothing_after_warm_up(one_device):
    """Mixtral over 4 devices."""
    with LLM(tiny_model("mixtral"), tensor_parallel_size=4, enable_expert_parallel=True, **ENGINE) as llm:
        before = llm.llm_engine.get_stats()["num_compilations"]
        assert_same_outputs(outputs(llm), one_device["mixtral"], "mixtral, expert parallel over 4")
        assert llm.llm_engine.get_stats()["num_compilations"] == before
        experts = llm.llm_engine.engine_core.core.executor.runner.weights.model().layers[0].mlp.experts
        # 8 experts over 4 devices: 2 whole ones each (hidden 32, intermediate 16)
        assert {s.data.shape for s in experts.gate_up_proj.get_value().addressable_shards} == {(2, 32, 2, 16)}
        assert {s.data.shape for s in experts.down_proj.get_value().addressable_shards} == {(2, 16, 32)}


@needs_8
@pytest.mark.parametrize("change, expert_parallel, message", [
    ({"moe_intermediate_size": 12}, False, r"tensor_parallel_size=8 must divide each expert's intermediate size \(12\)"),
    ({"num_experts": 12}, True, r"tensor_parallel_size=8 must divide the model's experts \(12\)"),
])
def test_experts_that_do_not_split_over_the_devices_are_a_clear_error(tmp_path, change, expert_parallel, message):
    with open(os.path.join(tiny_model("qwen3_moe"), "config.json")) as f:
        config = {**json.load(f), **change}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    args = EngineArgs(model=str(tmp_path), load_format="dummy", tensor_parallel_size=8,
                      enable_expert_parallel=expert_parallel)
    with pytest.raises(ValueError, match=message):
        args.create_config()


def test_expert_parallel_over_eight_forced_devices():
    """The tests above, in a child process with 8 forced host devices."""
    if jax.device_count() >= 8:
        pytest.skip("this process has the devices: the tests above run here")
    run_with_host_devices(__file__, "not eight_forced", 8, "5 passed", timeout_s=900)
