"""SampleMode: the host picks the least work that samples a batch right, and the
step holds no XLA conditional (on GPU one stalls the host every step)."""
import jax
import numpy as np
import pytest

from jaxllm.config import EngineArgs
from jaxllm.sample.sampler import SampleMode, needs_processors, sample, sample_mode
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker import input_batch as batching
from jaxllm.worker.model_runner import ModelRunner
from tests.conftest import tiny_model
from tests.sample.test_sampler import metadata, random_logits


@pytest.mark.parametrize("params, mode", [
    (SamplingParams(temperature=0.0, top_k=5, top_p=0.5), SampleMode.GREEDY),
    (SamplingParams(temperature=0.7), SampleMode.RANDOM),
    (SamplingParams(temperature=0.7, top_k=-1, top_p=1.0, min_p=0.0), SampleMode.RANDOM),
    (SamplingParams(temperature=0.7, top_k=0), SampleMode.RANDOM),
    (SamplingParams(temperature=0.7, top_k=1), SampleMode.FILTERED),
    (SamplingParams(temperature=0.7, top_p=0.999), SampleMode.NUCLEUS),
    (SamplingParams(temperature=0.7, min_p=0.01), SampleMode.NUCLEUS),
    (SamplingParams(temperature=0.7, top_p=0.5, top_k=3), SampleMode.FILTERED),
])
def test_a_request_needs_the_least_mode_that_samples_it(params, mode):
    assert sample_mode(params) == mode
    assert not needs_processors(params)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repetition_penalty=1.1), SamplingParams(temperature=0.7, presence_penalty=-0.5),
    SamplingParams(frequency_penalty=0.1), SamplingParams(min_tokens=1), SamplingParams(logit_bias={3: 0.5}),
    SamplingParams(allowed_token_ids=[3]), SamplingParams(bad_words=["no"]),
])
def test_a_request_that_changes_its_logits_needs_the_processors(params):
    assert needs_processors(params)


def test_an_empty_logit_bias_needs_no_processors():
    assert not needs_processors(SamplingParams(logit_bias={}))


def test_a_batch_takes_the_highest_mode_of_its_requests():
    rows = batching.RequestRows(max_blocks_per_seq=2, num_rows=4)
    rows.sample_mode[:] = [SampleMode.GREEDY, SampleMode.FILTERED, SampleMode.RANDOM, SampleMode.GREEDY]
    assert rows.batch_sample_mode(np.array([0, 3])) == SampleMode.GREEDY
    assert rows.batch_sample_mode(np.array([0, 2, 3])) == SampleMode.RANDOM
    assert rows.batch_sample_mode(np.array([2, 1])) == SampleMode.FILTERED


@pytest.mark.parametrize("mode", [SampleMode.GREEDY, SampleMode.RANDOM, SampleMode.NUCLEUS])
def test_a_lower_mode_samples_its_batches_as_the_general_path(mode):
    n = 16
    temperature = np.where(np.arange(n) % 2, 0.8, 0.0) if mode != SampleMode.GREEDY else 0.0
    md = metadata(n, positions=np.arange(n), top_p=0.8 if mode == SampleMode.NUCLEUS else 1.0)
    md = type(md)(**{**vars(md), "temperature": jax.numpy.asarray(np.broadcast_to(temperature, (n,)), "float32")})
    logits = random_logits(n, vocab=200)
    general = jax.jit(sample, static_argnums=2)(logits, md, SampleMode.FILTERED)
    np.testing.assert_array_equal(jax.jit(sample, static_argnums=2)(logits, md, mode), general)
    if mode != SampleMode.GREEDY:  # the random rows did draw: not every one is the argmax
        assert np.any(np.asarray(general)[1::2] != np.argmax(np.asarray(logits), -1)[1::2])


def test_the_step_holds_no_conditional():
    config = EngineArgs(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=64, max_num_seqs=8,
                        max_num_batched_tokens=32, num_gpu_blocks_override=8).create_config()
    runner = ModelRunner(config)
    token_bucket = runner.token_buckets[0]
    buffer, views = runner.host_buffers.next(token_bucket)
    batching.fill_padding(views)
    params = runner.weights.params
    forward = runner.fns.forward.lower(params, runner.kv_caches, runner._prev_tokens, buffer, token_bucket)
    texts = [forward.as_text()]
    _, logits, words, *_ = runner.fns.forward.eval_shape(params, runner.kv_caches, runner._prev_tokens,
                                                           buffer, token_bucket)
    texts += [runner.fns.sample.lower(logits, words, mode).as_text() for mode in list(SampleMode)[1:]]
    bitmask = runner.sampling.all_allowed_bitmask(logits.shape[0])
    texts += [runner.fns.sample_processed.lower(logits, words, runner.processor_rows.state, bitmask,
                                                runner.processor_rows.user_states(None, logits.shape[0]), mode).as_text()
              for mode in SampleMode]
    for text in texts:
        assert "stablehlo.if" not in text and "stablehlo.case" not in text
