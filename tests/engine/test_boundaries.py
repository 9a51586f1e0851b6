"""Bad values raise at the boundary where they enter (EngineArgs, SamplingParams, the
engine's add_request), as a TypeError or ValueError that names the field, and the
engine serves a valid request afterwards exactly as before."""
import dataclasses
import math
import re
import sys

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm import LLM, EngineArgs, SamplingParams
from jaxllm import config as config_module
from jaxllm import dtypes
from jaxllm.kernels.attention import BACKENDS
from jaxllm.sampling_params import RequestOutputKind
from tests.conftest import tiny_model

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 3]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TINY_MAX_LEN = 512  # max_position_embeddings of the tiny llama


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model("llama"), skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=40,
               show_progress=False, enable_multiprocessing=False)


@pytest.fixture(scope="module")
def reference_tokens(llm):
    return greedy_tokens(llm)


def greedy_tokens(llm) -> list[int]:
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def assert_names_field(error: Exception, field: str) -> None:
    assert isinstance(error, (TypeError, ValueError)), repr(error)
    assert re.match(rf"{field}\b", str(error)), f"{field}: {error}"


# -- one test per item -------------------------------------------------------

@pytest.mark.parametrize("field", ["max_model_len", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_zero_or_negative_lengths_raise_instead_of_taking_the_default(field, value):
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got {value}"):
        EngineArgs(model=tiny_model("llama"), **{field: value}).create_config()


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_seqs": 2.5}, "max_num_seqs must be an int or None, got 2.5"),
    ({"max_model_len": 64.0}, "max_model_len must be an int or None, got 64.0"),
    ({"max_num_batched_tokens": 256.0}, "max_num_batched_tokens must be an int or None, got 256.0"),
    ({"seed": "1"}, "seed must be an int, got '1'"),
    ({"max_num_seqs": "8"}, "max_num_seqs must be an int or None, got '8'"),
    ({"block_size": True}, "block_size must be an int, got True"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a number, got '0.5'"),
    ({"skip_tokenizer_init": "yes"}, "skip_tokenizer_init must be a bool, got 'yes'"),
    ({"async_scheduling": 1}, "async_scheduling must be a bool or None, got 1"),
    ({"enable_multiprocessing": "0"}, "enable_multiprocessing must be a bool or None, got '0'"),
])
def test_engine_args_of_the_wrong_type_raise_before_the_model_is_read(monkeypatch, kwargs, message):
    def read_model(*args):
        raise AssertionError("the model was read before the arguments were checked")
    monkeypatch.setattr(config_module, "resolve_model", read_model)
    with pytest.raises(TypeError, match=re.escape(message)):
        EngineArgs(model=tiny_model("llama"), **kwargs).create_config()


@pytest.mark.parametrize("kwargs, message", [
    ({"seed": 1.5}, "seed must be an int or None, got 1.5"),
    ({"seed": True}, "seed must be an int or None, got True"),
    ({"max_tokens": True}, "max_tokens must be an int or None, got True"),
    ({"top_k": True}, "top_k must be an int, got True"),
    ({"stop": {"a": 1}}, "stop must be a str or a list of str or None, got {'a': 1}"),
    ({"stop": 123}, "stop must be a str or a list of str or None, got 123"),
    ({"stop": ["a", 1]}, "stop must be a str or a list of str or None, got ['a', 1]"),
    ({"stop_token_ids": [2, True]}, "stop_token_ids must be a list of int or None, got [2, True]"),
    ({"ignore_eos": "no"}, "ignore_eos must be a bool, got 'no'"),
    ({"skip_special_tokens": None}, "skip_special_tokens must be a bool, got None"),
    ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind, got 'delta'"),
    ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
    ({"top_p": False}, "top_p must be a number, got False"),
])
def test_sampling_params_of_the_wrong_type_raise_naming_the_field(kwargs, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -3), ("temperature", math.nan), ("top_k", 2.0), ("stop", 7), ("output_kind", "delta"),
])
def test_params_changed_after_construction_are_checked_when_the_engine_takes_them(llm, reference_tokens,
                                                                                    field, value):
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    with pytest.raises((TypeError, ValueError)) as error:
        llm.llm_engine.add_request("changed", PROMPT, params)
    assert_names_field(error.value, field)
    assert not llm.llm_engine.has_unfinished_requests()
    assert greedy_tokens(llm) == reference_tokens


# -- every field, random invalid values ---------------------------------------

def not_of(*valid: type) -> st.SearchStrategy:
    """Values of none of the types in `valid` (bool is not an int; a number is an int or float)."""
    values = {bool: st.booleans(), int: st.integers(), float: st.floats(), str: st.text(max_size=4),
              list: st.lists(st.integers(), max_size=2), type(None): st.none()}
    if float in valid:
        valid = (*valid, int)
    return st.one_of(*(s for t, s in values.items() if t not in valid))


def numbers_but(valid) -> st.SearchStrategy:
    """Ints and floats (nan and infinities included) for which valid(x) is false."""
    return st.one_of(st.floats(), st.integers()).filter(lambda x: not valid(x))


NOT_BOOL = not_of(bool)
SAMPLING_INVALID = {
    "n": st.one_of(st.integers(max_value=0), not_of(int)),
    "temperature": st.one_of(numbers_but(lambda x: 0 <= x <= sys.float_info.max), not_of(float)),
    "top_p": st.one_of(numbers_but(lambda x: 0 < x <= 1), not_of(float)),
    "top_k": st.one_of(st.integers(max_value=-2), not_of(int)),
    "min_p": st.one_of(numbers_but(lambda x: 0 <= x <= 1), not_of(float)),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), not_of(int, type(None))),
    "max_tokens": st.one_of(st.integers(max_value=0), not_of(int, type(None))),
    "stop": st.one_of(st.lists(st.text(min_size=1), max_size=2).map(lambda s: [*s, ""]), st.just(""),
                      st.dictionaries(st.text(), st.integers(), max_size=2), st.lists(st.integers(), min_size=1),
                      not_of(str, list, type(None))),
    "stop_token_ids": st.one_of(st.lists(st.integers(max_value=-1), min_size=1),
                                st.lists(st.one_of(st.booleans(), st.floats(), st.text()), min_size=1),
                                not_of(list, type(None))),
    "ignore_eos": NOT_BOOL,
    "return_routed_experts": NOT_BOOL,
    "include_stop_str_in_output": NOT_BOOL,
    "skip_special_tokens": NOT_BOOL,
    "logprobs": st.one_of(st.integers(max_value=-1), not_of(int, type(None))),
    "presence_penalty": st.one_of(numbers_but(lambda x: -2 <= x <= 2), not_of(float)),
    "frequency_penalty": st.one_of(numbers_but(lambda x: -2 <= x <= 2), not_of(float)),
    "repetition_penalty": st.one_of(numbers_but(lambda x: 0 < x <= sys.float_info.max), not_of(float)),
    "min_tokens": st.one_of(st.integers(max_value=-1), st.integers(min_value=17), not_of(int)),  # max_tokens 16
    "logit_bias": st.one_of(st.dictionaries(st.integers(max_value=-1), st.floats(-1, 1), min_size=1),
                            st.dictionaries(st.integers(0, 9), st.sampled_from([math.nan, math.inf]), min_size=1),
                            not_of(type(None))),
    "allowed_token_ids": st.one_of(st.lists(st.integers(max_value=-1), min_size=1), st.just([]),
                                   not_of(list, type(None))),
    "bad_words": st.one_of(st.lists(st.sampled_from(["", " ", "\t"]), min_size=1),
                           st.lists(st.integers(), min_size=1), not_of(list, type(None))),
    "spaces_between_special_tokens": NOT_BOOL,
    "detokenize": NOT_BOOL,
    "truncate_prompt_tokens": st.one_of(st.integers(max_value=0).filter(lambda k: k != -1), not_of(int, type(None))),
    "prompt_logprobs": st.one_of(st.integers(max_value=-1), not_of(int, type(None))),
    "structured_outputs": not_of(type(None)),
    "extra_args": not_of(type(None)),
    "output_kind": st.one_of(st.sampled_from([k.name for k in RequestOutputKind]), st.integers(0, 2), st.none()),
}
_VALID_DTYPES = {"auto", *dtypes.DTYPES, *dtypes.DTYPE_ALIASES}
ENGINE_INVALID = {
    "model": st.one_of(st.text(max_size=6).map(lambda s: f"/no/such/model{s}"), not_of(str, type(None))),
    "dtype": st.one_of(st.text(max_size=6).filter(lambda s: s not in _VALID_DTYPES), not_of(str)),
    "max_model_len": st.one_of(st.integers(max_value=0), st.integers(min_value=TINY_MAX_LEN + 1),
                               not_of(int, type(None))),
    "max_num_seqs": st.one_of(st.integers(max_value=0), not_of(int, type(None))),
    "max_num_batched_tokens": st.one_of(st.integers(max_value=63), not_of(int, type(None))),  # < max_num_seqs
    "block_size": st.one_of(st.integers().filter(lambda b: b not in (16, 32, 64, 128)), not_of(int)),
    "gpu_memory_utilization": st.one_of(numbers_but(lambda x: 0 < x <= 1), not_of(float)),
    "num_gpu_blocks_override": st.one_of(st.integers(max_value=0), not_of(int, type(None))),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), not_of(int)),
    "load_format": st.one_of(st.text(max_size=6).filter(lambda s: s not in ("auto", "dummy")), not_of(str)),
    "attention_backend": st.one_of(st.text(max_size=8).filter(lambda s: s not in BACKENDS),
                                   not_of(str, type(None))),
    "tensor_parallel_size": st.one_of(st.integers(max_value=0), st.integers(min_value=jax.device_count() + 1),
                                      not_of(int)),
    "skip_tokenizer_init": NOT_BOOL,
    "tokenizer": st.one_of(st.text(max_size=6).map(lambda s: f"/no/such/tokenizer{s}"), not_of(str, type(None))),
    "max_logprobs": st.one_of(st.integers(max_value=-1), not_of(int)),
    "quantization": st.one_of(st.text(max_size=6).filter(lambda s: s != "fp8"), not_of(str, type(None))),
    "kv_cache_dtype": st.one_of(st.text(max_size=8).filter(lambda s: s not in config_module.KV_CACHE_DTYPES),
                                not_of(str)),
    "async_scheduling": not_of(bool, type(None)),
    "capacity_scheduler_policy": st.one_of(
        st.text(max_size=20).filter(lambda s: s not in config_module.CAPACITY_POLICIES), not_of(str)),
    "speculative_config": st.one_of(
        st.fixed_dictionaries({"method": st.text(max_size=6).filter(lambda s: s != "ngram"),
                               "num_speculative_tokens": st.just(2)}),
        st.fixed_dictionaries({"method": st.just("ngram"), "num_speculative_tokens": st.integers(max_value=0)}),
        st.fixed_dictionaries({"method": st.just("ngram"), "num_speculative_tokens": st.just(2),
                               "prompt_lookup_min": st.integers(max_value=0)}),
        not_of(type(None))),
    "logits_processors": st.one_of(st.lists(st.sampled_from(["no.such:Thing", "json:loads", "os"]), min_size=1),
                                   st.lists(st.sampled_from([int, dict]), min_size=1), not_of(list, type(None))),
    "enable_multiprocessing": not_of(bool, type(None)),
    "enable_prefix_caching": NOT_BOOL,
    "batch_invariant": NOT_BOOL,
    "enable_expert_parallel": st.one_of(st.just(True), NOT_BOOL),  # True: the tiny Llama has no experts
    "data_parallel_size": st.one_of(st.integers(max_value=0), not_of(int)),
    # 3+: more stages than the tiny Llama's 2 layers (and than the devices of most machines)
    "pipeline_parallel_size": st.one_of(st.integers(max_value=0), st.integers(min_value=3), not_of(int)),
    "enable_dbo": NOT_BOOL,
    "enable_lora": NOT_BOOL,
    # Checked by type alone without enable_lora (their ranges with it: tests/lora/test_lora_config.py)
    "max_loras": not_of(int),
    "max_lora_rank": not_of(int),
    "max_cpu_loras": not_of(int, type(None)),
    "revision": not_of(str, type(None)),
    "tokenizer_revision": not_of(str, type(None)),
    "download_dir": not_of(str, type(None)),
    "distributed_executor_backend": st.one_of(st.text(max_size=8).filter(lambda s: s not in ("uni", "multihost", "ray")),
                                              not_of(str)),
    "num_hosts": st.one_of(st.integers(max_value=0), st.integers(min_value=2), not_of(int)),  # 2+: no backend
    "host_rank": st.one_of(st.integers(max_value=-1), st.integers(min_value=1), not_of(int)),
    "coordinator_address": not_of(str, type(None)),
    "runner": st.one_of(st.text(max_size=8).filter(lambda s: s not in config_module.RUNNERS), not_of(str)),
    # With the default runner any pooler_config is one too many.
    "pooler_config": st.one_of(st.dictionaries(st.text(max_size=4), st.integers(), max_size=2), not_of(type(None))),
}


def test_the_tables_cover_every_field():
    assert set(SAMPLING_INVALID) == {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(ENGINE_INVALID) == {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize("field", sorted(SAMPLING_INVALID))
def test_invalid_sampling_params_raise_naming_the_field(llm, reference_tokens, field):
    @settings(max_examples=15, deadline=None, database=None)
    @given(SAMPLING_INVALID[field])
    def check(value):
        with pytest.raises((TypeError, ValueError)) as error:
            SamplingParams(**{field: value})
        assert_names_field(error.value, field)
        params = SamplingParams()
        setattr(params, field, value)
        with pytest.raises((TypeError, ValueError)) as error:
            llm.llm_engine.add_request("invalid", PROMPT, params)
        assert_names_field(error.value, field)

    check()
    assert greedy_tokens(llm) == reference_tokens


@pytest.mark.parametrize("field", sorted(ENGINE_INVALID))
def test_invalid_engine_args_raise_naming_the_field(llm, reference_tokens, field):
    @settings(max_examples=15, deadline=None, database=None)
    @given(ENGINE_INVALID[field])
    def check(value):
        with pytest.raises((TypeError, ValueError)) as error:
            EngineArgs(**{"model": tiny_model("llama"), field: value}).create_config()
        assert_names_field(error.value, field)

    check()
    assert greedy_tokens(llm) == reference_tokens
