"""The one-token bucket (worker/model_runner.py single_token_bucket; on a GPU by default, here with
JAXLLM_SINGLE_TOKEN_BUCKET=1): a lone request's decode steps run a forward of one token, whose
attention on a GPU splits the context over the whole device."""
import re

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams, compilation
from jaxllm.worker.executables import FORWARD
from jaxllm.worker.model_runner import single_token_bucket
from tests.conftest import engines_warmed_up, tiny_model
from tests.engine.test_batch_invariance import tokens_and_logprobs as outputs

ENGINE = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64,
              num_gpu_blocks_override=64, show_progress=False, enable_multiprocessing=False)
TARGET = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
OTHERS = [{"prompt_token_ids": list(range(20 + i, 40 + 3 * i))} for i in range(5)]


def runner_of(llm):
    return llm.llm_engine.engine_core.core.executor.runner


def forwards_taken(llm, prompts) -> tuple[list, list[str]]:
    """The outputs of generating `prompts`, and the forwards each step took."""
    runner, taken = runner_of(llm), []
    get = runner.executables.get
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner.executables, "get", lambda key, lower: taken.append(str(key)) or get(key, lower))
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [outputs(o) for o in outs], [name for name in taken if name.startswith("forward")]


@pytest.fixture(scope="module")
def without():
    with LLM(tiny_model("llama"), **ENGINE) as llm:
        yield llm


@pytest.fixture
def single_token(monkeypatch):
    monkeypatch.setenv("JAXLLM_SINGLE_TOKEN_BUCKET", "1")


def test_the_one_token_bucket_is_on_by_default_on_a_gpu_alone(monkeypatch):
    monkeypatch.delenv("JAXLLM_SINGLE_TOKEN_BUCKET", raising=False)
    assert single_token_bucket("gpu") and not single_token_bucket("cpu")
    monkeypatch.setenv("JAXLLM_SINGLE_TOKEN_BUCKET", "0")
    assert not single_token_bucket("gpu")
    monkeypatch.setenv("JAXLLM_SINGLE_TOKEN_BUCKET", "1")
    assert single_token_bucket("cpu")


def test_a_lone_requests_decode_steps_take_the_one_token_forward(single_token, without):
    with engines_warmed_up(), LLM(tiny_model("llama"), **ENGINE) as llm:
        runner = runner_of(llm)
        assert runner.token_buckets == [1, 16, 32, 64]
        assert runner.layouts[1].num_rows == runner.layouts[16].num_rows  # the samplers of bucket 16
        compiled = compilation.num_compilations()
        [alone], taken = forwards_taken(llm, [TARGET])
        assert taken == ["forward 16"] + ["forward 1"] * 7
        batch, taken = forwards_taken(llm, [TARGET] + OTHERS)
        assert taken[0] == "forward 64" and "forward 16" in taken  # (its last steps may hold one request)
        assert compilation.num_compilations() == compiled
        # The KV caches are written in place, as in every other bucket (a copy would be the whole cache).
        text = runner.executables.compiled[next(k for k in runner.executables.compiled
                                                if k.kind == FORWARD and k.bucket == 1)].as_text()
        shapes = {f"{a.dtype.name.replace('float', 'f')}{list(a.shape)}".replace(" ", "")
                  for a in jax.tree.leaves(runner.kv_cache.caches)}
        params = re.findall(r"(%\S+) = (\w+\[[\d,]*\])\{[\d,]*\} parameter\(", text)
        caches = [name for name, shape in params if shape in shapes]
        assert caches and not [name for name in caches if f" copy({name})" in text]
    want_alone, want_batch = [outputs(o) for o in without.generate([TARGET], PARAMS, use_tqdm=False)], \
        [outputs(o) for o in without.generate([TARGET] + OTHERS, PARAMS, use_tqdm=False)]
    assert alone[0] == want_alone[0][0] and [b[0] for b in batch] == [b[0] for b in want_batch]
    for (_, got), (_, want) in zip([alone] + batch, want_alone + want_batch):
        np.testing.assert_allclose([lp for d in got for _, lp in d], [lp for d in want for _, lp in d], atol=1e-5)


def test_batch_invariant_bits_are_the_same_in_the_one_token_bucket(single_token):
    """A request alone decodes in the one-token bucket, among others in bucket 16: bit for bit the same."""
    with LLM(tiny_model("llama"), batch_invariant=True, **ENGINE) as llm:
        [alone], taken = forwards_taken(llm, [TARGET])
        assert "forward 1" in taken
        batch, taken = forwards_taken(llm, OTHERS[:2] + [TARGET] + OTHERS[2:4])
        assert "forward 1" not in taken
        assert batch[2] == alone


def test_dual_batch_overlap_runs_the_one_token_step_whole(single_token, without):
    with LLM(tiny_model("llama"), enable_dbo=True, **ENGINE) as llm:
        [alone], taken = forwards_taken(llm, [TARGET])
        assert "forward 1" in taken
    [want] = [outputs(o) for o in without.generate([TARGET], PARAMS, use_tqdm=False)]
    assert alone[0] == want[0]


def test_a_one_token_step_under_dual_batch_overlap_returns_each_layers_routed_experts(single_token):
    """Run whole, a one-token step's MoE layers route once each (not a first half and a second)."""
    from tests.models.test_moe import assert_routed_experts_are_a_plain_forwards
    prompt = [5, 17, 99, 3, 250, 41, 8]
    with LLM(tiny_model("qwen3_moe"), enable_dbo=True, **{**ENGINE, "dtype": "float32"}) as llm:
        outs = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True, return_routed_experts=True), use_tqdm=False)
    assert_routed_experts_are_a_plain_forwards("qwen3_moe", [prompt], outs)
