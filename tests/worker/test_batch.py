"""The step's one input buffer: what the host packs is what the jitted step reads."""
import jax
import numpy as np
import pytest

from jaxllm.config import EngineArgs
from jaxllm.sample.sampler import (COLUMN, FLOAT_COLUMNS, NUM_SAMPLING_WORDS, ProcessorMetadata, SampleMode,
                                   SamplingMetadata)
from jaxllm.worker import input_batch as batching
from jaxllm.worker.model_runner import ModelRunner
from tests.conftest import tiny_model


@pytest.mark.parametrize("num_tokens, num_reqs, max_blocks", [(16, 16, 8), (32, 32, 8), (64, 32, 8), (128, 32, 8),
                                                              (2048, 256, 128)])
def test_every_field_unpacks_on_the_device_as_the_host_wrote_it(num_tokens, num_reqs, max_blocks):
    layout = batching.BatchLayout(num_tokens, num_reqs, max_blocks)
    buffer = np.zeros(layout.size, np.int32)
    views = layout.host_views(buffer)
    rng = np.random.default_rng(num_tokens)
    for view in views.values():
        view[...] = rng.integers(0, 2**31 - 1, view.shape)
    batch = jax.jit(layout.unpack)(buffer)
    np.testing.assert_array_equal(batch.input_ids, views["input_ids"])
    np.testing.assert_array_equal(batch.prev_rows, views["prev_rows"])
    np.testing.assert_array_equal(batch.attention.block_tables, views["block_tables"])
    np.testing.assert_array_equal(batch.attention.slot_mapping, views["slot_mapping"])
    np.testing.assert_array_equal(batch.attention.query_start_loc, views["query_start_loc"])
    np.testing.assert_array_equal(batch.sampling, views["sampling"])


def test_sampling_words_unpack_into_the_samplers_metadata():
    words = np.random.default_rng(0).integers(0, 2**31 - 1, (8, NUM_SAMPLING_WORDS)).astype(np.int32)
    floats = np.float32(np.random.default_rng(1).random((8, len(FLOAT_COLUMNS))))
    words[:, FLOAT_COLUMNS] = floats.view(np.int32)
    md, pmd = SamplingMetadata.from_words(words), ProcessorMetadata.from_words(words)
    np.testing.assert_array_equal(md.top_p, words[:, COLUMN["top_p"]].view(np.float32))
    np.testing.assert_array_equal(md.seeds, words[:, [COLUMN["seed_high"], COLUMN["seed_low"]]].view(np.uint32))
    np.testing.assert_array_equal(md.positions, words[:, COLUMN["position"]])
    np.testing.assert_array_equal(pmd.repetition_penalty, words[:, COLUMN["repetition_penalty"]].view(np.float32))
    np.testing.assert_array_equal(pmd.update_rows, words[:, COLUMN["update_row"]] - 1)
    np.testing.assert_array_equal(pmd.processed, words[:, COLUMN["processed"]] != 0)


def test_fields_start_256_byte_aligned():
    layout = batching.BatchLayout(48, 24, 5)
    assert all(offset % 64 == 0 for offset, _ in layout.fields.values())


def test_an_all_padding_step_writes_nothing_to_the_kv_cache():
    config = EngineArgs(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=128, max_num_seqs=32,
                        max_num_batched_tokens=128, num_gpu_blocks_override=40).create_config()
    runner = ModelRunner(config)
    for token_bucket in runner.token_buckets:
        runner.kv_cache.caches = jax.tree.map(jax.numpy.ones_like, runner.kv_caches)  # so a write of anything shows
        buffer, views = runner.host_buffers.next(token_bucket)
        batching.fill_padding(views)
        jax.block_until_ready(runner.dispatch(token_bucket, buffer, SampleMode.FILTERED, processed=True,
                                              num_logprobs=runner.sampling.num_logprobs))
        assert all(np.all(np.asarray(c) == 1) for c in jax.tree.leaves(runner.kv_caches)), token_bucket
