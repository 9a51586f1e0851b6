"""kv_cache_dtype="fp8": K and V stored in e4m3 (kernels/reference.py write_kv), half the bytes a
token, so twice the tokens in the same memory; the embedded model stays within a stated distance
of its own cache's dtype."""
import logging

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, EngineArgs, SamplingParams
from tests.conftest import tiny_model
from tests.models.test_fp8 import ONE_PROMPT, teacher_forced

pytestmark = pytest.mark.timeout(600)


def runner(llm):
    return llm.llm_engine.engine_core.core.executor.runner


@pytest.mark.parametrize("name,dtype", [("fp8", jnp.float8_e4m3fn), ("fp8_e4m3", jnp.float8_e4m3fn),
                                        ("fp8_e5m2", jnp.float8_e5m2), ("bfloat16", jnp.bfloat16),
                                        ("auto", jnp.float32)])  # auto: the model's, float32 on CPU
def test_the_names_are_vllms(name, dtype):
    config = EngineArgs(model=tiny_model("llama"), kv_cache_dtype=name, skip_tokenizer_init=True).create_config()
    assert config.cache.cache_dtype == dtype


def test_an_unknown_name_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'fp8'.* got 'int8'"):
        EngineArgs(model=tiny_model("llama"), kv_cache_dtype="int8").create_config()


def scale_warnings(caplog):
    return [r for r in caplog.records if r.name == "jaxllm.worker.kv_cache" and "scale 1.0" in r.getMessage()]


def test_an_fp8_block_takes_a_quarter_of_a_float32_ones_bytes(caplog):
    """...and the engine warns, once, that the 8-bit cache's scale is 1 (as vLLM does)."""
    caplog.set_level(logging.WARNING, logger="jaxllm.worker.model_runner")
    args = dict(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=256, show_progress=False,
                enable_multiprocessing=False)
    with LLM(**args) as llm:
        exact = runner(llm)
        exact_bytes, exact_blocks = exact.kv_cache.bytes_per_block, exact.num_blocks
    assert not scale_warnings(caplog)
    with LLM(kv_cache_dtype="fp8", **args) as llm:
        [warning] = scale_warnings(caplog)
        assert "float8_e4m3fn" in warning.getMessage()
        fp8 = runner(llm)
        assert {c.dtype for pair in fp8.kv_caches for c in pair} == {jnp.dtype(jnp.float8_e4m3fn)}
        assert "float8_e4m3fn" in fp8.describe()
        assert fp8.kv_cache.bytes_per_block * 4 == exact_bytes  # float32 on CPU: a quarter
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 6
        stats = llm.llm_engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    # CPU sizes the cache for max_num_seqs full-length requests: the block count is the same
    assert fp8.num_blocks == exact_blocks


def test_the_embedded_model_with_an_fp8_cache_stays_within_the_stated_tolerance(smollm2):
    """SmolLM2-135M, teacher-forced over 48 tokens of text, every K and V read back from the
    e4m3 cache: the mean |logprob| difference is under 0.2 nats (0.13 measured) and the top
    token agrees at >= 90% of positions (97.9%); greedy decoding keeps at least its first 8
    tokens (all 16 measured)."""
    exact = teacher_forced(smollm2)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    prompt = "The capital of France is"
    want = smollm2.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(kv_cache_dtype="fp8", **ONE_PROMPT) as llm:
        fp8 = teacher_forced(llm)
        got = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(fp8) == len(exact) > 40
    diff = np.mean([abs(a[0] - b[0]) for a, b in zip(exact, fp8)])
    agree = np.mean([a[1] == b[1] for a, b in zip(exact, fp8)])
    assert diff < 0.2
    assert agree >= 0.9
    assert got[:8] == want[:8]
