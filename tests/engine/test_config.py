"""Bad engine arguments and bad sampling parameters fail at the boundary, naming the field."""
import json
import re

import pytest

from jaxllm import EngineArgs, SamplingParams
from tests.conftest import tiny_model


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_p": 1.5}, "min_p"),
    ({"stop": [""]}, "stop"),
    ({"n": 0}, "n must be >= 1"),
])
def test_invalid_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_and_minus_one_are_accepted(top_k):
    assert SamplingParams(top_k=top_k).top_k == top_k  # vLLM's values for "all tokens"


def test_top_k_error_names_every_accepted_value():
    with pytest.raises(ValueError, match=re.escape("top_k must be 0 or -1 (disabled) or >= 1, got -2")):
        SamplingParams(top_k=-2)


def test_unknown_model_path_raises():
    with pytest.raises(ValueError, match="not found"):
        EngineArgs(model="/no/such/model").create_config()


def test_unsupported_architecture_raises(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        EngineArgs(model=str(tmp_path)).create_config()


@pytest.mark.parametrize("kwargs, message", [
    ({"max_model_len": 100_000}, "max_model_len"),
    ({"block_size": 24}, "block_size"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"dtype": "int8"}, "dtype"),
    ({"load_format": "pt"}, "load_format"),
    ({"attention_backend": "flash"}, "attention_backend"),
    ({"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}, "capacity_scheduler_policy must be one of"),
])
def test_invalid_engine_args_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_model("llama"), **kwargs).create_config()


def test_bundled_config_needs_dummy_weights():
    with pytest.raises(ValueError, match="dummy"):
        EngineArgs(model="llama-3.1-8b").create_config()
    config = EngineArgs(model="llama-3.1-8b", load_format="dummy", max_model_len=1024).create_config()
    assert config.model.arch.num_layers == 32


@pytest.mark.parametrize("kwargs, error, message", [
    ({"temperature": float("nan")}, ValueError, "temperature must be a finite"),
    ({"top_p": float("inf")}, ValueError, "top_p must be a finite"),
    ({"max_tokens": 2.5}, TypeError, "max_tokens must be an int"),
    ({"top_k": 1.5}, TypeError, "top_k must be an int"),
])
def test_non_finite_or_non_integer_sampling_params_raise(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_the_tokenizer_engine_arg_gives_a_dummy_model_text_prompts(char_llama):
    from jaxllm import LLM, SamplingParams
    with LLM(tiny_model("llama"), tokenizer=char_llama, max_model_len=64, max_num_seqs=4,
             max_num_batched_tokens=16, num_gpu_blocks_override=8, show_progress=False,
             enable_multiprocessing=False) as llm:
        (out,) = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert out.prompt_token_ids == llm.get_tokenizer().encode("abc") and out.outputs[0].text


@pytest.mark.parametrize("tokenizer", ["/no/such/folder", __file__])
def test_a_tokenizer_that_is_neither_a_folder_nor_a_gguf_file_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="tokenizer must be an HF folder, a .gguf file or a hub id"):
        EngineArgs(model=tiny_model("llama"), tokenizer=tokenizer).create_config()


def test_a_pipeline_parallel_size_below_1_is_an_error():
    with pytest.raises(ValueError, match=re.escape("pipeline_parallel_size must be >= 1, got 0")):
        EngineArgs(model=tiny_model("llama"), pipeline_parallel_size=0).create_config()


def test_a_data_parallel_size_below_1_is_an_error():
    with pytest.raises(ValueError, match=re.escape("data_parallel_size must be >= 1, got 0")):
        EngineArgs(model=tiny_model("llama"), data_parallel_size=0).create_config()


def test_the_capacity_policy_reaches_the_scheduler_and_the_cli():
    import argparse

    from jaxllm.cli import add_engine_args, engine_args_from
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", tiny_model("llama"), "--capacity-scheduler-policy", "guaranteed_no_evict"])
    config = engine_args_from(ns).create_config()
    assert config.scheduler.capacity_scheduler_policy == "guaranteed_no_evict"


def test_the_parallel_config_carries_every_size():
    parallel = EngineArgs(model=tiny_model("llama")).create_config().parallel
    assert (parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.pipeline_parallel_size) == (1, 1, 1)


def test_a_path_that_is_no_hub_id_is_not_looked_up(monkeypatch):
    from jaxllm import model_hub

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")
    monkeypatch.setattr(model_hub, "download_snapshot", no_hub)
    for model in ("/no/such/model", "./no-such-model", "no/such/model"):
        with pytest.raises(ValueError, match="not found"):
            EngineArgs(model=model).create_config()
