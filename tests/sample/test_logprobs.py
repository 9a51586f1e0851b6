"""compute_logprobs (the step's sample logprobs) against a float64 numpy log_softmax."""
import functools

import jax
import numpy as np
import pytest

from jaxllm.config import EngineArgs
from jaxllm.sample.logprobs import compute_logprobs
from jaxllm.worker.model_runner import ModelRunner
from tests.conftest import tiny_model


def reference(logits: np.ndarray, sampled: np.ndarray, k: int):
    """float64: (logprobs [R, 1 + k], token ids [R, 1 + k], ranks [R]); the top k in
    descending order, ties by the lower id; rank = the tokens whose logprob is >= the sampled one's."""
    x = logits.astype(np.float64)
    logprobs = x - x.max(-1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
    top = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    rows = np.arange(len(x))
    sampled_logprobs = logprobs[rows, sampled]
    ids = np.concatenate([sampled[:, None], top], -1)
    ranks = (logprobs >= sampled_logprobs[:, None]).sum(-1)
    return np.take_along_axis(logprobs, ids, -1), ids, ranks


def run(logits: np.ndarray, sampled: np.ndarray, k: int, max_num_seqs: int | None = None):
    padded = np.zeros(max_num_seqs or len(sampled), np.int32)  # the step's ids come padded to max_num_seqs
    padded[:len(sampled)] = sampled
    fn = jax.jit(functools.partial(compute_logprobs, num_logprobs=k))
    return [np.asarray(a) for a in fn(logits.astype(np.float32), padded)]


@pytest.mark.parametrize("num_reqs, vocab, k", [(1, 7, 3), (8, 256, 5), (16, 1000, 20), (5, 64, 64)])
def test_logprobs_top_ids_and_ranks_match_a_float64_log_softmax(num_reqs, vocab, k):
    rng = np.random.default_rng(num_reqs * vocab + k)
    logits = rng.standard_normal((num_reqs, vocab)) * 4
    sampled = rng.integers(0, vocab, num_reqs)  # any token, not only the likeliest: ranks vary
    sampled[0] = np.argmax(logits[0])
    logprobs, ids, ranks = run(logits, sampled, k, max_num_seqs=num_reqs + 3)
    ref_logprobs, ref_ids, ref_ranks = reference(logits.astype(np.float32), sampled, k)
    assert logprobs.dtype == np.float32 and ids.dtype == np.int32 and ranks.dtype == np.int32
    assert logprobs.shape == ids.shape == (num_reqs, 1 + k) and ranks.shape == (num_reqs,)
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(ranks, ref_ranks)
    assert ranks[0] == 1
    # The sampled token's entry is the top list's entry at its rank.
    untied = ranks <= k
    np.testing.assert_array_equal(ids[untied, ranks[untied]], sampled[untied])


def test_ties_put_the_lower_id_first_and_count_against_the_sampled_rank():
    rng = np.random.default_rng(0)
    logits = rng.integers(0, 4, (12, 32)).astype(np.float32)  # many exactly equal logits
    sampled = rng.integers(0, 32, 12)
    logprobs, ids, ranks = run(logits, sampled, 10)
    ref_logprobs, ref_ids, ref_ranks = reference(logits, sampled, 10)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(ranks, ref_ranks)  # vLLM's rank: (logprobs >= sampled's).sum()
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=1e-5)
    for row, top in zip(logits, ids[:, 1:]):
        key = [(-row[t], t) for t in top]
        assert key == sorted(key)


def test_zero_top_logprobs_gives_the_sampled_token_only():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 50))
    sampled = np.array([3, 0, 49, 7])
    logprobs, ids, ranks = run(logits, sampled, 0)
    ref_logprobs, ref_ids, ref_ranks = reference(logits.astype(np.float32), sampled, 0)
    assert logprobs.shape == ids.shape == (4, 1)
    np.testing.assert_array_equal(ids[:, 0], sampled)
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(ranks, ref_ranks)


def test_the_runners_logprobs_executable_holds_no_conditional():
    config = EngineArgs(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=64, max_num_seqs=8,
                        max_num_batched_tokens=32, num_gpu_blocks_override=8).create_config()
    runner = ModelRunner(config)
    sampled, logits, *_ = runner.lower_forward(runner.token_buckets[0]).out_info
    for k in runner.sampling.logprob_buckets:
        text = runner.fns.logprobs.lower(logits, sampled, k).as_text()
        assert "stablehlo.if" not in text and "stablehlo.case" not in text
    assert runner.sampling.num_logprobs == 20  # max_logprobs, vLLM's default
    assert runner.sampling.logprob_buckets == [0, 8, 20]
