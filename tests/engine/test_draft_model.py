"""Speculative decoding with a draft model: its drafts change no token a request gives (greedy
or seeded), the draft's KV cache follows the target's (the target as its own draft has every
greedy draft taken, after preemption and from cached prefixes too, on a hybrid cache), and it
costs no compilation and no KV block."""
import json

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from tests.conftest import tiny_model
from tests.engine.test_speculative import check_200_requests_with_aborts, check_stops_are_the_same_with_drafts

pytestmark = pytest.mark.usefixtures("warm_up_every_engine")

# Gemma 3's hybrid cache (a window of 8 beside full attention): the draft's layers, sliding ones
# too, read the target's full-attention group's block tables.
ENGINE = dict(model=tiny_model("gemma3"), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
              block_size=16)
SELF_DRAFT = {"method": "draft_model", "model": tiny_model("gemma3"), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def llm(char_llama):
    """The tiny Gemma 3 drafting for itself (with a character tokenizer), on a cache small enough to preempt;
    asynchronous scheduling, the default with a draft model."""
    with LLM(**ENGINE, tokenizer=char_llama, num_gpu_blocks_override=24, speculative_config=SELF_DRAFT,
             enable_multiprocessing=False, show_progress=False) as llm:
        yield llm


def scheduler(llm):
    return llm.llm_engine.engine_core.core.scheduler


def completions(llm, prompts, params, speculate=True):
    """Every completion of the prompts, with the engine's drafts or (speculate=False) without."""
    sched = scheduler(llm)
    proposer, sched.proposer = sched.proposer, (sched.proposer if speculate else None)
    try:
        return [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
    finally:
        sched.proposer = proposer


def generate(llm, prompts, params, speculate=True):
    return [c.token_ids for c in completions(llm, prompts, params, speculate)]


def assert_same_completions(want, got) -> None:
    """The same tokens, and logprobs within 1e-4."""
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for wc, gc in zip(want, got):
        for wl, gl in zip(wc.logprobs, gc.logprobs):
            assert wl.keys() == gl.keys()
            np.testing.assert_allclose([v.logprob for v in gl.values()], [v.logprob for v in wl.values()], atol=1e-4)


def drafts_taken(llm, run) -> tuple[int, int]:
    totals = scheduler(llm).spec_totals
    before = totals.num_draft_tokens, totals.num_accepted_tokens
    run()
    return totals.num_draft_tokens - before[0], totals.num_accepted_tokens - before[1]


def test_greedy_and_seeded_tokens_are_the_same_with_a_draft_model(llm):
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(3, 250, 10 + 3 * i).tolist()} for i in range(12)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=20 + i, ignore_eos=True,
                             min_tokens=i % 4) for i in range(12)]
    want = generate(llm, prompts, params, speculate=False)
    preemptions = scheduler(llm).num_preemptions
    num_drafts, num_taken = drafts_taken(llm, lambda: want.append(generate(llm, prompts, params)))
    assert want.pop() == want
    assert all(len(w) == p.max_tokens for w, p in zip(want, params))  # max_tokens, never more
    assert scheduler(llm).num_preemptions > preemptions and 0 < num_taken < num_drafts


def test_penalties_bias_and_logprobs_are_the_same_with_a_draft_model(llm):
    """The draft guesses without penalties, so the target rejects some of its drafts; the counts the
    penalties read include the drafts before each row, which the step reads on the device."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [40, 41, 40, 41, 40]}]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4, presence_penalty=0.2, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={41: 2.0, 40: 1.5},
                             min_tokens=4, n=2, logprobs=2)]
    want, got = completions(llm, prompts, params, speculate=False), []
    num_drafts, num_taken = drafts_taken(llm, lambda: got.extend(completions(llm, prompts, params)))
    assert_same_completions(want, got)
    assert 0 < num_taken < num_drafts


def test_stops_and_lengths_are_the_same_with_a_draft_model(llm):
    check_stops_are_the_same_with_drafts(llm)


def test_the_target_as_its_own_draft_has_every_greedy_draft_taken(llm):
    """The draft's KV is right wherever the target's is: after a preemption and in blocks
    found in the prefix cache (the second run), its greedy drafts are the target's tokens."""
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(3, 250, 20 + 5 * i).tolist()} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for _ in range(2):
        num_drafts, num_taken = drafts_taken(llm, lambda: generate(llm, prompts, params))
        assert num_taken >= 0.95 * num_drafts and num_drafts > 100, (num_taken, num_drafts)
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0


def test_no_compilation_and_every_block_back_after_200_requests_with_aborts(llm):
    check_200_requests_with_aborts(llm.llm_engine, np.random.default_rng(3),
                                   lambda rng: rng.integers(3, 250, int(rng.integers(2, 60))).tolist())


def _model_with(tmp_path, name: str, **changes) -> str:
    """A tiny model's config.json with `changes` (resolving a config reads no weights)."""
    folder = tmp_path / f"{name}-{'-'.join(changes)}"
    folder.mkdir()
    with open(f"{tiny_model(name)}/config.json") as f:
        config = json.load(f)
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return str(folder)


@pytest.mark.parametrize("target, spec, message", [
    ("llama", {"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model must name"),
    ("llama", {"method": "ngram", "model": "m", "num_speculative_tokens": 2}, "speculative_config.model is for"),
    ("llama", {"model": "llama", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, "prompt_lookup_min is for"),
    ("llama", {"model": "/no/such/draft", "num_speculative_tokens": 2}, "speculative_config.model: model"),
    ("llama", {"model": ("llama", {"vocab_size": 300}), "num_speculative_tokens": 2}, "vocabulary has 300 tokens"),
    ("llama", {"model": ("llama", {"max_position_embeddings": 64}), "num_speculative_tokens": 2},
     "max_position_embeddings \\(64\\)"),
    (("mistral", {"sliding_window": 8}), {"model": "llama", "num_speculative_tokens": 2}, "sliding window \\(8\\)"),
])
def test_a_bad_draft_model_config_names_its_field(tmp_path, target, spec, message):
    def path(model):
        if isinstance(model, tuple):
            return _model_with(tmp_path, model[0], **model[1])
        return tiny_model(model) if model in ("llama", "mistral") else model

    spec = {**spec, **({"model": path(spec["model"])} if "model" in spec else {})}
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=path(target), max_model_len=128, speculative_config=spec).create_config()
