"""Speculative decoding: drafts change what a request samples in no way (greedy tokens, the
distribution of sampled ones, penalties, logprobs), and cost no compilation and no KV block."""
import numpy as np
import pytest
from scipy import stats

from jaxllm import LLM, SamplingParams, compilation
from jaxllm.config import EngineArgs
from jaxllm.spec_decode.ngram import NgramProposer, propose_ngram
from jaxllm.speculative_config import SpeculativeConfig
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("warm_up_every_engine")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = dict(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=128, max_num_seqs=16,
              max_num_batched_tokens=64, num_gpu_blocks_override=80, block_size=16)


@pytest.fixture(scope="module")
def llm():
    """N-gram drafts made on the host (synchronous scheduling), whose proposer the tests replace."""
    with LLM(**ENGINE, speculative_config=NGRAM, async_scheduling=False, enable_multiprocessing=False,
             show_progress=False) as llm:
        yield llm


def scheduler(llm):
    return llm.llm_engine.engine_core.core.scheduler


class ScriptedProposer:
    """Drafts along a tree of continuations (prefix of the output -> the tokens seen after it),
    each draft picked at random among those seen: wrong about as often as not."""

    def __init__(self, tree: dict[tuple, list[int]], seed: int = 0):
        self.tree, self.rng = tree, np.random.default_rng(seed)

    def propose(self, request, max_tokens: int) -> list[int]:
        prefix, drafts = tuple(request.output_token_ids), []
        while len(drafts) < max_tokens and (seen := self.tree.get(prefix)):
            drafts.append(int(self.rng.choice(seen)))
            prefix += (drafts[-1],)
        return drafts

    def forget(self, request_id: str) -> None:
        pass


def generate(llm, prompts, params, proposer=None) -> list[list[int]]:
    scheduler(llm).proposer = proposer
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_ngram_drafts_follow_the_latest_longest_earlier_match():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, int(rng.integers(1, 30))).astype(np.int32)
        low, high, k = int(rng.integers(1, 4)), 0, int(rng.integers(1, 5))
        high = low + int(rng.integers(0, 3))
        want = []
        for n in range(min(high, len(tokens) - 1), low - 1, -1):  # brute force: longest n, then the latest copy
            starts = [i for i in range(len(tokens) - n) if (tokens[i:i + n] == tokens[-n:]).all()]
            if starts:
                want = tokens[starts[-1] + n:starts[-1] + n + k].tolist()
                break
        assert propose_ngram(tokens, low, high, k) == want, (tokens.tolist(), low, high, k)


def test_the_ngram_proposer_keeps_each_requests_tokens_as_they_grow():
    class FakeRequest:
        request_id, prompt_token_ids, output_token_ids = "r", [1, 2, 3, 1, 2], []
        num_tokens = property(lambda self: len(self.prompt_token_ids) + len(self.output_token_ids))

        def token_ids(self, start, end):
            return (self.prompt_token_ids + self.output_token_ids)[start:end]

    proposer = NgramProposer(SpeculativeConfig("ngram", 3, 1, 3))
    request = FakeRequest()
    assert proposer.propose(request, 3) == [3, 1, 2]
    request.output_token_ids += [3, 7]
    assert proposer.propose(request, 3) == []  # 7 never came before
    request.output_token_ids += [1, 2, 3]
    assert proposer.propose(request, 2) == [7, 1]


def test_greedy_outputs_are_the_same_with_ngram_drafts(llm):
    rng = np.random.default_rng(1)
    pattern = rng.integers(3, 250, 6).tolist()
    prompts = [{"prompt_token_ids": (pattern * 8)[i:i + 20 + i]} for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True, min_tokens=i % 3)
              for i in range(12)]
    want = generate(llm, prompts, params)
    before = scheduler(llm).spec_totals.num_accepted_tokens
    assert generate(llm, prompts, params, NgramProposer(llm.llm_engine.config.speculative)) == want
    assert scheduler(llm).spec_totals.num_accepted_tokens > before
    assert all(len(w) == p.max_tokens for w, p in zip(want, params))  # max_tokens, never more


def test_penalties_bias_logprobs_and_n_are_the_same_with_drafts(llm):
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [40, 41, 40, 41, 40]}]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4, presence_penalty=0.2, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={41: 2.0, 40: 1.5},
                             min_tokens=4, n=2, logprobs=2)]
    tree = {}  # drafts: the greedy run's own next tokens (all right), then some wrong ones
    scheduler(llm).proposer = None
    want = llm.generate(prompts, params, use_tqdm=False)
    for out in want:
        tokens = out.outputs[0].token_ids
        for i in range(len(tokens)):
            tree.setdefault(tuple(tokens[:i]), []).extend([tokens[i], tokens[i], 3])
    scheduler(llm).proposer = ScriptedProposer(tree)
    before = scheduler(llm).spec_totals.num_accepted_tokens
    got = llm.generate(prompts, params, use_tqdm=False)
    assert scheduler(llm).spec_totals.num_accepted_tokens - before > 10
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for wc, gc in zip(w.outputs, g.outputs):
            for wl, gl in zip(wc.logprobs, gc.logprobs):
                assert wl.keys() == gl.keys()
                np.testing.assert_allclose([v.logprob for v in gl.values()], [v.logprob for v in wl.values()],
                                           atol=1e-4)


def test_sampling_with_drafts_wrong_half_the_time_keeps_the_distribution(llm):
    """Four tokens of top_k=2 sampling: 16 continuations. Their counts over 1200 seeds with drafts
    and 1200 other seeds without are one distribution (chi-square test of homogeneity)."""
    prompt = [{"prompt_token_ids": [17, 83, 5, 201]}]
    n = 1200
    params = lambda seeds: [SamplingParams(temperature=1.0, top_k=2, max_tokens=4, ignore_eos=True, seed=s)
                            for s in seeds]
    plain = generate(llm, prompt * n, params(range(n)))
    tree = {}
    for tokens in plain:
        for i in range(4):
            seen = tree.setdefault(tuple(tokens[:i]), [])
            if tokens[i] not in seen:
                seen.append(tokens[i])
    totals = scheduler(llm).spec_totals
    drafts_before, accepted_before = totals.num_draft_tokens, totals.num_accepted_tokens
    speculative = generate(llm, prompt * n, params(range(n, 2 * n)), ScriptedProposer(tree))
    num_drafts, num_accepted = totals.num_draft_tokens - drafts_before, totals.num_accepted_tokens - accepted_before
    assert 0.2 < num_accepted / num_drafts < 0.8, (num_accepted, num_drafts)
    cells = sorted({tuple(t) for t in plain + speculative})
    table = np.array([[sum(tuple(t) == c for t in run) for c in cells] for run in (plain, speculative)])
    assert stats.chi2_contingency(table).pvalue > 1e-3, table
    # A seeded request draws the same tokens again, drafts or not.
    again = generate(llm, prompt * 8, params(range(n, n + 8)), ScriptedProposer(tree, seed=7))
    assert again == speculative[:8]


def test_no_compilation_and_every_block_back_after_200_requests_with_aborts(llm):
    scheduler(llm).proposer = NgramProposer(llm.llm_engine.config.speculative)

    def repeating(rng):
        pattern = rng.integers(3, 250, int(rng.integers(1, 5))).tolist()
        return (pattern * 20)[:int(rng.integers(2, 60))]
    check_200_requests_with_aborts(llm.llm_engine, np.random.default_rng(2), repeating)


def check_200_requests_with_aborts(engine, rng, prompt) -> None:
    """200 requests of prompts `prompt(rng)`, greedy or sampled, a twentieth of the outputs not
    finished aborting theirs: nothing compiles, every block is back, and drafts were taken."""
    before = compilation.num_compilations()
    aborted = set()
    for i in range(200):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt(rng)}, SamplingParams(
            temperature=float(rng.choice([0.0, 0.8])), seed=i, max_tokens=int(rng.integers(1, 40)), ignore_eos=True))
    finished = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished += out.finished
            if not out.finished and rng.random() < 0.05:
                engine.abort_request(out.request_id)
                aborted.add(out.request_id)
    stats_now = engine.get_stats()
    assert stats_now["num_free_blocks"] == stats_now["num_blocks"] and stats_now["num_requests"] == 0
    assert compilation.num_compilations() == before
    assert aborted and finished + len(aborted) >= 200
    assert stats_now["spec_decode_num_accepted_tokens"] > 0


def check_stops_are_the_same_with_drafts(llm) -> None:
    """Stop strings, stop ids with min_tokens, and max_tokens from 1 to past the drafts (greedy and
    seeded): with the drafter's drafts each request gives the text, tokens and finish reason it
    gives without (`llm`: an engine with a character tokenizer)."""
    sched = llm.llm_engine.engine_core.core.scheduler
    prompts = ["abcabcabc", "hello hello", "xyz", "0123456789"]
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    params = []
    for i, out in enumerate(free):
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        params += [SamplingParams(temperature=0.0, max_tokens=30, stop=[text[8:10]], ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[ids[5]], min_tokens=3),
                   SamplingParams(temperature=0.8, seed=i, max_tokens=30, stop=[text[4]], ignore_eos=True,
                                  include_stop_str_in_output=True),
                   SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True)]
    prompts = [p for p in prompts for _ in range(4)]

    def run():
        return [(c.text, c.token_ids, c.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)
                for c in o.outputs]
    proposer, sched.proposer = sched.proposer, None
    try:
        want = run()
    finally:
        sched.proposer = proposer
    accepted = sched.spec_totals.num_accepted_tokens
    assert run() == want
    assert sched.spec_totals.num_accepted_tokens > accepted
    assert sum(reason == "stop" for _, _, reason in want) >= 6 and [len(w[1]) for w in want[3::4]] == [1, 2, 3, 4]


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle7", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "2"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, "unknown keys"),
])
def test_a_bad_speculative_config_names_its_field(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_model("llama"), speculative_config=spec).create_config()


def test_scheduling_is_asynchronous_with_every_method_unless_turned_off():
    def scheduling(spec, **kwargs):
        return EngineArgs(model=tiny_model("llama"), speculative_config=spec, **kwargs).create_config().scheduler
    draft_model = {"method": "draft_model", "model": tiny_model("llama"), "num_speculative_tokens": 2}
    assert all(scheduling(spec).async_scheduling for spec in (None, NGRAM, draft_model))
    assert not any(scheduling(spec, async_scheduling=False).async_scheduling for spec in (NGRAM, draft_model))


def test_a_request_under_token_masks_beside_drafted_requests_keeps_to_them(char_llama):
    """A request whose token masks the core makes each step (here multi-token bad words, as
    structured outputs) gets no drafts and never says a bad word, while the free requests of
    its batch take drafts (made on the device) and give their tokens."""
    with LLM(char_llama, max_model_len=128, max_num_seqs=8, speculative_config=NGRAM, enable_multiprocessing=False,
             show_progress=False) as llm:
        prompts = ["abcabcabcabc", "xyzxyzxyz", "hello hello hello"]
        free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        plain = [o.outputs[0].text for o in llm.generate(prompts, [free] * 3, use_tqdm=False)]
        bad = [[text[1:3], text[4:6]] for text in plain]  # two-token words the free runs say
        masked = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=words) for words in bad]
        outs = llm.generate(prompts + prompts, [free] * 3 + masked, use_tqdm=False)
        assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    assert [o.outputs[0].text for o in outs[:3]] == plain
    for out, words in zip(outs[3:], bad):
        assert not any(w in out.outputs[0].text for w in words), (out.outputs[0].text, words)


def test_a_sliding_window_model_gives_the_same_greedy_tokens_with_drafts():
    """Gemma 3's hybrid cache (a window of 8 beside full attention): drafts move past the
    window's edge and back when rejected, and the window's blocks are freed as it moves. The
    drafts are made on the device, from the token ids kept on the full-attention group's blocks."""
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": (rng.integers(3, 250, 5).tolist() * 10)[:int(n)]} for n in (9, 17, 30, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(tiny_model("gemma3"), skip_tokenizer_init=True, max_model_len=128, max_num_seqs=8, block_size=16,
             num_gpu_blocks_override=48, speculative_config=NGRAM, enable_multiprocessing=False,
             show_progress=False) as llm:
        proposer = scheduler(llm).proposer
        want = generate(llm, prompts, params)
        got = generate(llm, prompts, params, proposer)
        stats_now = llm.llm_engine.get_stats()
    assert got == want
    assert stats_now["spec_decode_num_accepted_tokens"] > 0 and stats_now["num_free_blocks"] == stats_now["num_blocks"]
