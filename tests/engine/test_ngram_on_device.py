"""N-gram drafts made on the device, under asynchronous scheduling (the default): they change no
token a request gives (greedy or seeded, n > 1, logprobs, stops and lengths), the token ids kept beside the KV
follow preemption and the prefix cache, and they cost no compilation and no KV block."""
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.spec_decode.draft_model import RunnerDrafts
from jaxllm.spec_decode.ngram import NgramProposer
from tests.conftest import tiny_model
from tests.engine.test_draft_model import assert_same_completions, completions, drafts_taken, generate
from tests.engine.test_speculative import NGRAM, check_200_requests_with_aborts, check_stops_are_the_same_with_drafts

pytestmark = pytest.mark.usefixtures("warm_up_every_engine")


@pytest.fixture(scope="module")
def llm(char_llama):
    """The tiny Llama (a character tokenizer) on a cache small enough to preempt."""
    with LLM(char_llama, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, block_size=16,
             num_gpu_blocks_override=24, speculative_config=NGRAM, enable_multiprocessing=False,
             show_progress=False) as llm:
        yield llm


def repeating(rng, length: int) -> list[int]:
    return (rng.integers(3, 250, int(rng.integers(2, 6))).tolist() * 40)[:length]


def test_ngram_drafts_are_made_on_the_device_under_asynchronous_scheduling(llm):
    config = llm.llm_engine.config
    assert config.scheduler.async_scheduling and config.drafts_on_device
    assert isinstance(llm.llm_engine.engine_core.core.scheduler.proposer, RunnerDrafts)
    off = EngineArgs(model=tiny_model("llama"), speculative_config=NGRAM, async_scheduling=False).create_config()
    assert not off.drafts_on_device


def test_greedy_and_seeded_tokens_are_the_same_with_device_drafts(llm):
    """Twice: the second run finds the prompts' blocks in the prefix cache, whose token ids the
    first run wrote; the cache of 24 blocks preempts some of the 12 requests."""
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": repeating(rng, 10 + 4 * i)} for i in range(12)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=20 + i, ignore_eos=True,
                             min_tokens=i % 4) for i in range(12)]
    want = generate(llm, prompts, params, speculate=False)
    preemptions = llm.llm_engine.engine_core.core.scheduler.num_preemptions
    for _ in range(2):
        got = []
        num_drafts, num_taken = drafts_taken(llm, lambda: got.extend(generate(llm, prompts, params)))
        assert got == want and 0 < num_taken <= num_drafts
    assert all(len(w) == p.max_tokens for w, p in zip(want, params))  # max_tokens, never more
    stats = llm.llm_engine.get_stats()
    assert llm.llm_engine.engine_core.core.scheduler.num_preemptions > preemptions and stats["prefix_cache_hits"] > 0


def test_parallel_samples_and_logprobs_are_the_same_with_device_drafts(llm):
    """n = 2 (the samples share the prompt's blocks, so its token ids) with logprobs, and a penalty."""
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": repeating(rng, 30)}, {"prompt_token_ids": repeating(rng, 17)}]
    params = [SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=20, ignore_eos=True, logprobs=2,
                             frequency_penalty=0.3),
              SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)]
    want, got = completions(llm, prompts, params, speculate=False), []
    num_drafts, num_taken = drafts_taken(llm, lambda: got.extend(completions(llm, prompts, params)))
    assert_same_completions(want, got)
    assert 0 < num_taken <= num_drafts


def test_a_text_that_does_not_repeat_is_scheduled_without_drafts(llm):
    """Drafts where the text repeats, none once it stops finding copies: a request with no copy in
    its last table gets no draft placeholders, so drafts are scheduled for few of its steps."""
    rng = np.random.default_rng(4)
    prompt = {"prompt_token_ids": rng.permutation(np.arange(3, 250))[:40].tolist()}  # no token twice
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = generate(llm, [prompt], params, speculate=False)[0]
    host = NgramProposer(llm.llm_engine.config.speculative)
    text = np.array(prompt["prompt_token_ids"] + tokens, np.int32)
    lookups = [host.propose(_Request(text[:n]), 3) for n in range(40, len(text))]
    num_drafts, _ = drafts_taken(llm, lambda: generate(llm, [prompt], params))
    # The first decoding step in flight guesses k drafts; after that only where the host finds a copy
    # one or two steps before.
    assert num_drafts <= 3 * (2 + 3 * sum(map(bool, lookups)))


class _Request:
    """What NgramProposer reads of a request: its id and its tokens."""
    request_id = "r"

    def __init__(self, tokens: np.ndarray):
        self.tokens, self.num_tokens = tokens, len(tokens)

    def token_ids(self, start: int, end: int) -> np.ndarray:
        return self.tokens[start:end]


def test_stops_and_lengths_are_the_same_with_device_drafts(llm):
    check_stops_are_the_same_with_drafts(llm)


def test_no_compilation_and_every_block_back_after_200_requests_with_aborts(llm):
    check_200_requests_with_aborts(llm.llm_engine, np.random.default_rng(3),
                                   lambda rng: repeating(rng, int(rng.integers(2, 60))))
