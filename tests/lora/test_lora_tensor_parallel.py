"""LoRA under tensor parallelism: the tiny Llama over 4 devices (its 2 KV heads repeated to one per
device, and with them each adapter's k_proj and v_proj columns) gives PEFT's tokens and logprobs. The
test needs 4 devices; in a process with fewer, the last test runs it in a child with 4 forced host
devices."""
import jax
import pytest

from jaxllm import LLM
from tests.conftest import run_with_host_devices, tiny_model
from tests.lora.adapters import GOLDEN_ADAPTERS, assert_golden, golden_prompts, greedy, lora_request


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices: the last test runs it with 4")
def test_adapters_over_four_devices_give_peft_tokens():
    prompts, models = golden_prompts(), ["base", *GOLDEN_ADAPTERS]
    with LLM(tiny_model("llama"), tensor_parallel_size=4, skip_tokenizer_init=True, max_model_len=64, max_num_seqs=8,
             max_num_batched_tokens=32, show_progress=False, enable_multiprocessing=False, enable_lora=True,
             max_loras=3) as llm:
        outputs = llm.generate(prompts * len(models), greedy(), use_tqdm=False,
                               lora_request=[None if m == "base" else lora_request(m) for m in models for _ in prompts])
        for mod, (a_layers, b_layers) in llm.llm_engine.engine_core.core.executor.runner.lora.stacks.items():
            column_parallel = mod not in ("o_proj", "down_proj")  # B shards its out axis, else A its in axis
            for a, b in zip(a_layers, b_layers):
                assert (b if column_parallel else a).sharding.spec[2 if column_parallel else 0] == "model", mod
    for k, model in enumerate(models):
        assert_golden(outputs[k * len(prompts):(k + 1) * len(prompts)], model, range(len(prompts)))


@pytest.mark.timeout(660)
def test_four_forced_devices_in_a_child():
    if jax.device_count() >= 4:
        pytest.skip("this process has the devices: the test above runs here")
    run_with_host_devices(__file__, "not four_forced", 4, "1 passed", timeout_s=600)
