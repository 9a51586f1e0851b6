"""Warm-up's check of the budget's step reserve against the compiled executables' temporaries."""
import pytest

from jaxllm.config import EngineArgs
from jaxllm.contracts.step import NewRequestData, ScheduledRequest, SchedulerOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker.model_runner import ModelRunner
from jaxllm.worker.warm_up import outgrown_reserve
from tests.conftest import tiny_model

ENGINE = dict(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, num_gpu_blocks_override=8, block_size=16)


@pytest.mark.timeout(300)
def test_an_executable_whose_temporaries_outgrow_the_reserve_is_named():
    runner = ModelRunner(EngineArgs(**ENGINE).create_config())
    try:
        prompt = list(range(5, 25))
        step = SchedulerOutput([ScheduledRequest("r", 0, len(prompt), prompt, [[1, 2]], True)], len(prompt),
                               new_requests=[NewRequestData("r", prompt, SamplingParams(max_tokens=1), seed=0,
                                                               stop_token_ids=[2])],
                               step_id=1)
        runner.execute_model(step).get_output()  # compiles the step's executables (no warm-up in the tests)
        compiled = runner.executables.compiled
        assert outgrown_reserve(compiled, 1 << 40) is None
        warning = outgrown_reserve(compiled, 1)
        widest = max(compiled, key=lambda k: compiled[k].memory_analysis().temp_size_in_bytes)
        assert warning.startswith(f"the {widest} executable keeps ")
        assert "the KV cache's budget left for a step" in warning and "lower max_num_batched_tokens" in warning
    finally:
        runner.shutdown()
