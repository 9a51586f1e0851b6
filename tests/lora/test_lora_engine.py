"""Multi-LoRA serving on the tiny Llama against HF PEFT's goldens (scripts/make_lora_fixtures.py): a
batch mixing adapters and the base model, adapters loaded and evicted at run time with no compilation,
the prefix cache kept per adapter, and broken adapters failing alone."""
import os
import shutil

import pytest

from jaxllm import LLM, LoRARequest, compilation
from tests.conftest import tiny_model
from tests.lora.adapters import (GOLDEN_ADAPTERS, MAX_LORA_RANK, assert_golden, golden_prompts, greedy, lora_request,
                                 write_adapter)

pytestmark = pytest.mark.usefixtures("warm_up_every_engine")


@pytest.fixture(scope="module")
def llm():
    # Two device slots and two adapters in host memory for three adapters: loading evicts.
    # In this process, so that the compilation counter sees the core's.
    with LLM(tiny_model("llama"), skip_tokenizer_init=True, max_model_len=128, max_num_seqs=16,
             max_num_batched_tokens=64, num_gpu_blocks_override=64, block_size=16, show_progress=False,
             enable_multiprocessing=False, enable_lora=True, max_loras=2, max_cpu_loras=2,
             max_lora_rank=MAX_LORA_RANK) as llm:
        yield llm


def test_a_batch_mixing_three_adapters_and_the_base_model_gives_each_peft_tokens(llm):
    prompts = golden_prompts()
    models = ["base", *GOLDEN_ADAPTERS]
    loras = [None if m == "base" else lora_request(m) for m in models]
    outputs = llm.generate(prompts * len(models), greedy(), use_tqdm=False,
                           lora_request=[lora for lora in loras for _ in prompts])
    for k, model in enumerate(models):
        assert_golden(outputs[k * len(prompts):(k + 1) * len(prompts)], model, range(len(prompts)))


def test_a_request_alone_gets_what_it_got_in_the_mixed_batch(llm):
    prompts = golden_prompts()
    alone = llm.generate(prompts[2], greedy(), use_tqdm=False, lora_request=lora_request("all_r16"))
    assert_golden(alone, "all_r16", [2])


def test_adapters_load_and_evict_at_run_time_without_compiling(llm):
    count = compilation.num_compilations()
    prompts = golden_prompts()[:2]
    # Each call needs an adapter the two slots (and the two host copies) may not hold.
    for model in ("attn_r8", "mlp_r4_rslora", "all_r16", "attn_r8", "all_r16", "mlp_r4_rslora"):
        assert_golden(llm.generate(prompts, greedy(), use_tqdm=False, lora_request=lora_request(model)), model, [0, 1])
    assert len(llm.llm_engine.list_loras()) <= 2
    assert llm.llm_engine.remove_lora(lora_request("attn_r8").lora_int_id) in (True, False)
    assert lora_request("attn_r8").lora_int_id not in llm.llm_engine.list_loras()
    assert llm.llm_engine.add_lora(lora_request("attn_r8"))
    assert lora_request("attn_r8").lora_int_id in llm.llm_engine.list_loras()
    assert_golden(llm.generate(prompts, greedy(), use_tqdm=False, lora_request=lora_request("attn_r8")), "attn_r8",
                  [0, 1])
    assert compilation.num_compilations() == count


def test_the_prefix_cache_serves_a_prompt_only_to_requests_of_its_adapter(llm):
    prompt = golden_prompts()[2]  # 20 tokens: one full block of 16
    assert llm.reset_prefix_cache()
    llm.generate(prompt, greedy(), use_tqdm=False)  # the base model's KV of the block, cached
    _, hits = llm.llm_engine.prefix_cache_stats()
    assert_golden(llm.generate(prompt, greedy(), use_tqdm=False, lora_request=lora_request("attn_r8")), "attn_r8", [2])
    assert llm.llm_engine.prefix_cache_stats()[1] == hits  # the base's block is not the adapter's
    assert_golden(llm.generate(prompt, greedy(), use_tqdm=False, lora_request=lora_request("attn_r8")), "attn_r8", [2])
    assert llm.llm_engine.prefix_cache_stats()[1] == hits + 16  # its own block is


@pytest.mark.parametrize("make, message", [
    (lambda d: write_adapter(d, r=32), "r=32 exceeds max_lora_rank"),
    (lambda d: write_adapter(d, targets=("embed_tokens",)), r"target_modules \['embed_tokens'\] are not supported"),
    (lambda d: write_adapter(d, shapes={"0.mlp.up_proj.lora_A": (4, 32)}, targets=("up_proj",)), "has shape"),
    (lambda d: str(d / "nothing here"), "is not a folder"),
])
def test_a_broken_adapter_is_refused_at_generate_and_the_engine_serves_on(llm, tmp_path, make, message):
    bad = LoRARequest("bad", 99, make(tmp_path / "bad"))
    prompts = golden_prompts()[:2]
    with pytest.raises(ValueError, match=f"prompt 1: .*{message}"):
        llm.generate(prompts, greedy(), use_tqdm=False, lora_request=[lora_request("attn_r8"), bad])
    assert_golden(llm.generate(prompts, greedy(), use_tqdm=False, lora_request=lora_request("attn_r8")), "attn_r8",
                  [0, 1])
    assert llm.llm_engine.get_stats()["num_requests"] == 0


def test_an_adapter_that_fails_to_load_in_the_engine_fails_its_requests_alone(llm, tmp_path):
    """Checked at the boundary, then broken before its first step: the runner's load fails."""
    folder = shutil.copytree(tiny_model("lora/attn_r8"), tmp_path / "attn_r8")
    broken = LoRARequest("broken", 77, str(folder))
    llm.llm_engine.lora_checks.check(broken)
    with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
        f.write(b"not safetensors")
    prompts = golden_prompts()[:2]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=[broken, lora_request("all_r16")])
    assert outputs[0].outputs[0].finish_reason == "error"
    assert "LoRA adapter 'broken'" in outputs[0].error and "adapter_model.safetensors" in outputs[0].error
    assert_golden(outputs[1:], "all_r16", [1])


def test_an_engine_without_enable_lora_refuses_a_lora_request():
    from jaxllm.lora.adapter import AdapterChecks  # the front end's check, which needs no engine
    with pytest.raises(ValueError, match="lora_request: this engine was started without enable_lora"):
        AdapterChecks(None, None).check(lora_request("attn_r8"))
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        AdapterChecks(None, None).check("attn_r8")
