"""Prompt logprobs end to end: SamplingParams.prompt_logprobs on the tiny
Llama in fp32 against the log_softmax of HF transformers' logits at every prompt position
(golden.npz), over prompts split into prefill chunks by a busy batch and recomputed after
preemption, with sample logprobs beside them and no compilation after warm-up."""
import numpy as np
import pytest

from jaxllm import SamplingParams
from tests.engine.test_logprobs import golden, llm, log_softmax  # noqa: F401 (fixtures: the same engine shape)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("warm_up_every_engine")]

NUM_LOGPROBS = 3


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 2, "ignore_eos": True,
                             "prompt_logprobs": NUM_LOGPROBS, **kwargs})


def assert_matches_hf(prompt_logprobs, prompt, hf_logits) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        ref = log_softmax(hf_logits[position - 1])  # the logits after the tokens before this one
        entry, token_id = prompt_logprobs[position], int(prompt[position])
        top = np.argsort(-ref, kind="stable")[:NUM_LOGPROBS].tolist()
        assert set(entry) == {token_id, *top}
        assert entry[token_id].rank == int((ref >= ref[token_id]).sum())
        for t, e in entry.items():
            assert abs(e.logprob - ref[t]) < 1e-4, (position, t, e.logprob, ref[t])
        for rank, t in enumerate(top, start=1):
            assert t == token_id or entry[t].rank == rank


def test_prompt_logprobs_are_the_log_softmax_of_hf_transformers_logits(llm, golden):
    for prompt, hf_logits in golden:
        (out,) = llm.generate({"prompt_token_ids": prompt.tolist()}, params(), use_tqdm=False)
        assert_matches_hf(out.prompt_logprobs, prompt, hf_logits)


def test_prompts_split_into_chunks_and_preempted_get_each_position_once(llm, golden):
    # Three copies of every golden prompt at once: the 128-token budget splits the long ones into
    # chunks, and 40 blocks of 16 tokens cannot hold them all, so some are preempted and recomputed.
    prompts = [prompt for prompt, _ in golden for _ in range(3)]
    before = llm.llm_engine.get_stats()
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params(max_tokens=24, logprobs=2),
                        use_tqdm=False)
    after = llm.llm_engine.get_stats()
    assert after["num_preemptions"] > before["num_preemptions"]
    assert after["num_compilations"] == before["num_compilations"]
    for out, (prompt, hf_logits) in zip(outs, [g for g in golden for _ in range(3)]):
        assert_matches_hf(out.prompt_logprobs, prompt, hf_logits)
        assert len(out.outputs[0].logprobs) == 24


def test_zero_prompt_logprobs_gives_the_prompt_tokens_own(llm, golden):
    prompt, hf_logits = golden[1]
    (out,) = llm.generate({"prompt_token_ids": prompt.tolist()}, params(prompt_logprobs=0), use_tqdm=False)
    assert [list(entry) for entry in out.prompt_logprobs[1:]] == [[int(t)] for t in prompt[1:]]


def test_a_request_without_prompt_logprobs_gets_none(llm):
    (out,) = llm.generate({"prompt_token_ids": [4, 5, 6]}, params(prompt_logprobs=None), use_tqdm=False)
    assert out.prompt_logprobs is None
