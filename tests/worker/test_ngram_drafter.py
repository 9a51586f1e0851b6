"""N-gram drafts on the device are the host's, continued where the host's stop at the text's
end: for random texts kept a token per KV slot in shuffled blocks, each request's drafts start
with propose_ngram's, and the run from the copy to the end repeats after them."""
import functools

import jax
import numpy as np

from jaxllm.contracts.step import NO_DRAFT
from jaxllm.spec_decode.ngram import propose_ngram
from jaxllm.worker.ngram_drafter import ngram_drafts

BLOCK_SIZE, BLOCKS_PER_SEQ = 4, 8


def test_device_drafts_are_the_hosts_for_random_texts():
    rng = np.random.default_rng(0)
    num_reqs, num_blocks = 6, 64
    for low, high, k in ((1, 1, 3), (1, 3, 4), (2, 4, 2), (3, 3, 5)):
        draft = jax.jit(functools.partial(ngram_drafts, min_n=low, max_n=high, num_drafts=k, block_size=BLOCK_SIZE))
        for _ in range(10):
            token_ids = rng.integers(0, 100, num_blocks * BLOCK_SIZE).astype(np.int32)  # stale tokens elsewhere
            tables = rng.permutation(num_blocks)[:num_reqs * BLOCKS_PER_SEQ].reshape(num_reqs, BLOCKS_PER_SEQ)
            texts = [rng.integers(0, 3, int(n)).astype(np.int32)  # few distinct ids: many copies
                     for n in rng.integers(1, BLOCK_SIZE * BLOCKS_PER_SEQ + 1, num_reqs)]
            for table, text in zip(tables, texts):  # all but the last token in the cache
                at = np.arange(len(text) - 1)
                token_ids[table[at // BLOCK_SIZE] * BLOCK_SIZE + at % BLOCK_SIZE] = text[:-1]
            got = np.asarray(draft(token_ids, tables.astype(np.int32), np.array([t[-1] for t in texts], np.int32),
                                   np.array([len(t) - 1 for t in texts], np.int32)))
            for text, row in zip(texts, got):
                host = propose_ngram(text, low, high, k)
                assert row.tolist()[:len(host)] == host, (text.tolist(), low, high, k)
                assert row.tolist() == repeating_copy(text, low, high, k), (text.tolist(), low, high, k)


def repeating_copy(text: np.ndarray, low: int, high: int, k: int) -> list[int]:
    """Brute force: the latest earlier copy of the longest suffix of `text` of low..high tokens; the
    k tokens after it, the text from there to its end repeated; -1s without a copy."""
    last = len(text) - 1
    for n in range(min(high, last), low - 1, -1):
        ends = [e for e in range(n - 1, last) if (text[e - n + 1:e + 1] == text[last - n + 1:]).all()]
        if ends:
            run = text[ends[-1] + 1:].tolist()  # to the end, the last token included
            return [run[i % len(run)] for i in range(k)]
    return [NO_DRAFT] * k
