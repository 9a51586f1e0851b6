"""Sample logprobs end to end: SamplingParams.logprobs on the tiny
Llama in fp32, against HF transformers' logits (golden.npz) and the model's own forward
(itself checked against HF in tests/models/test_llama.py), through every output kind,
n > 1 and the process boundary, with no compilation after warm-up."""
import numpy as np
import pytest

from jaxllm import LLM, RequestOutputKind, SamplingParams
from jaxllm.contracts.engine_core import LogprobsArrays
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from tests.conftest import tiny_model
from tests.engine.test_core_process import engine_args
from tests.models.test_llama import TOKEN_BUCKET, golden_prompts, load_fixture, make_step, run_prompt

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("warm_up_every_engine")]

NUM_LOGPROBS = 5
MAX_TOKENS = 4


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                             "logprobs": NUM_LOGPROBS, **kwargs})


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def llm(char_llama):
    # The shapes of tests/engine/test_core_process.py's engines: their executables are cached.
    with LLM(**vars(engine_args(char_llama, dtype="float32", enable_multiprocessing=False)),
             show_progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def golden():
    _, _, golden = load_fixture("llama")
    return golden_prompts(golden)


@pytest.fixture(scope="module")
def model_logprobs():
    """log_softmax of the model's fp32 logits at every position of a token sequence."""
    config, model, _ = load_fixture("llama")
    step = make_step(model)

    def run(token_ids: list[int]) -> np.ndarray:
        assert len(token_ids) <= TOKEN_BUCKET
        return log_softmax(run_prompt(step, config, np.asarray(token_ids, np.int32), [len(token_ids)]))
    return run


def generate(llm, prompt_ids, params):
    return llm.generate({"prompt_token_ids": [int(t) for t in prompt_ids]}, params, use_tqdm=False)[0].outputs[0]


def assert_entry(entry: Logprob, logprob: float, rank: int) -> None:
    assert entry.rank == rank
    assert abs(entry.logprob - logprob) < 1e-4, (entry.logprob, logprob)


def test_first_token_logprobs_are_the_log_softmax_of_hf_transformers_logits(llm, golden):
    tokenizer = llm.get_tokenizer()
    for prompt, hf_logits in golden:
        out = generate(llm, prompt, greedy())
        assert len(out.logprobs) == len(out.token_ids) == MAX_TOKENS
        ref = log_softmax(hf_logits[-1])
        top = np.argsort(-ref, kind="stable")[:NUM_LOGPROBS].tolist()
        first = out.logprobs[0]
        assert out.token_ids[0] == top[0]
        assert list(first) == top  # greedy: the sampled token is the top one, so it is there once
        for rank, token_id in enumerate(top, start=1):
            assert_entry(first[token_id], ref[token_id], rank)
            assert first[token_id].decoded_token == tokenizer.decode([token_id])


def test_every_token_logprobs_match_the_model_over_prompt_and_output(llm, golden, model_logprobs):
    for prompt, _ in golden:
        out = generate(llm, prompt, greedy())
        tokens = [*prompt.tolist(), *out.token_ids]
        ref = model_logprobs(tokens[:-1])[len(prompt) - 1:]  # the distribution each output token came from
        for token_id, entry, row in zip(out.token_ids, out.logprobs, ref):
            top = np.argsort(-row, kind="stable")[:NUM_LOGPROBS].tolist()
            assert list(entry) == top and token_id == top[0]
            assert entry[token_id].logprob == max(e.logprob for e in entry.values())
            for rank, t in enumerate(top, start=1):
                assert_entry(entry[t], row[t], rank)


def test_cumulative_logprob_is_the_sum_of_the_sampled_tokens_logprobs(llm):
    out = generate(llm, [5, 17, 42], greedy(max_tokens=10))
    sampled = [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]
    assert out.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-9) and out.cumulative_logprob < 0
    plain = generate(llm, [5, 17, 42], greedy(max_tokens=10, logprobs=None))
    assert plain.token_ids == out.token_ids
    assert plain.logprobs is None and plain.cumulative_logprob is None  # as vLLM: none unless asked


def test_logprobs_are_of_the_raw_distribution_before_temperature_and_filters(llm):
    prompt = [9, 8, 7, 6]
    (raw,) = generate(llm, prompt, greedy(max_tokens=1)).logprobs
    (filtered,) = generate(llm, prompt, greedy(max_tokens=1, temperature=0.3, top_k=3, seed=5)).logprobs
    assert {t: filtered[t] for t in raw} == raw  # the same top tokens, logprobs and ranks


def test_zero_logprobs_gives_the_sampled_token_only_with_its_rank(llm):
    out = generate(llm, [1, 2, 3], SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                                    logprobs=0))
    assert [list(entry) for entry in out.logprobs] == [[t] for t in out.token_ids]
    assert all(entry[t].rank >= 1 for t, entry in zip(out.token_ids, out.logprobs))


def test_max_logprobs_itself_is_allowed(llm):
    out = generate(llm, [4, 5, 6], greedy(max_tokens=2, logprobs=20))
    assert [len(entry) for entry in out.logprobs] == [20, 20]  # greedy: the sampled token is the top one


def test_more_logprobs_than_max_logprobs_is_rejected_naming_both_and_the_engine_serves_on(llm):
    reference = generate(llm, [4, 5, 6], greedy())
    with pytest.raises(ValueError, match=r"logprobs must be <= max_logprobs \(20, an engine arg\), got 21"):
        llm.llm_engine.add_request("too-many", {"prompt_token_ids": [4, 5, 6]}, greedy(logprobs=21))
    assert not llm.llm_engine.has_unfinished_requests()
    again = generate(llm, [4, 5, 6], greedy())
    assert again.token_ids == reference.token_ids and again.logprobs == reference.logprobs


def test_a_lower_max_logprobs_engine_arg_lowers_the_limit():
    with LLM(tiny_model("llama"), skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4,
             max_num_batched_tokens=16, num_gpu_blocks_override=8, max_logprobs=2, show_progress=False,
             enable_multiprocessing=False) as small:
        with pytest.raises(ValueError, match=r"logprobs must be <= max_logprobs \(2, an engine arg\), got 3"):
            small.generate({"prompt_token_ids": [1, 2]}, greedy(logprobs=3), use_tqdm=False)
        out = generate(small, [1, 2], greedy(logprobs=2))
        assert all(len(entry) == 2 and entry[t].rank == 1 for t, entry in zip(out.token_ids, out.logprobs))
        assert all(e.decoded_token is None for entry in out.logprobs for e in entry.values())  # no tokenizer


@pytest.mark.parametrize("value, error, message", [
    (-1, ValueError, r"logprobs must be None or >= 0 \(-1, the whole vocabulary, is not supported\), got -1"),
    (-3, ValueError, "logprobs must be None or >= 0"),
    (True, TypeError, "logprobs must be an int or None, got True"),
    (2.0, TypeError, "logprobs must be an int or None, got 2.0"),
    ("5", TypeError, "logprobs must be an int or None, got '5'"),
])
def test_bad_logprobs_are_clear_errors_at_sampling_params(value, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(logprobs=value)


def test_a_changed_logprobs_is_caught_at_add_request(llm):
    params = greedy()
    params.logprobs = -1
    with pytest.raises(ValueError, match="logprobs must be None or >= 0"):
        llm.llm_engine.add_request("changed", {"prompt_token_ids": [1, 2]}, params)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("value, error, message", [
    (-1, ValueError, "max_logprobs must be >= 0, got -1"),
    (1.5, TypeError, "max_logprobs must be an int, got 1.5"),
])
def test_bad_max_logprobs_is_a_clear_error_at_engine_args(value, error, message):
    with pytest.raises(error, match=message):
        engine_args(tiny_model("llama"), max_logprobs=value).create_config()


def test_a_batch_mixing_logprobs_gives_the_same_tokens_and_compiles_nothing(llm):
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, 256, rng.integers(1, 90)).tolist()} for _ in range(40)]
    plain = [SamplingParams(temperature=float(i % 2), top_p=0.9 if i % 4 == 1 else 1.0, seed=i, ignore_eos=True,
                            max_tokens=int(rng.integers(1, 20))) for i in range(40)]
    mixed = [SamplingParams(**{**vars(p), "logprobs": int(rng.integers(0, 8)) if i % 3 else None})
             for i, p in enumerate(plain)]
    before = llm.llm_engine.get_stats()["num_compilations"]
    without = llm.generate(prompts, plain, use_tqdm=False)
    with_logprobs = llm.generate(prompts, mixed, use_tqdm=False)
    assert llm.llm_engine.get_stats()["num_compilations"] == before
    for p, a, b in zip(mixed, without, with_logprobs):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        if p.logprobs is None:
            assert b.logprobs is None and b.cumulative_logprob is None
        else:
            assert len(b.logprobs) == len(b.token_ids)
            for t, entry in zip(b.token_ids, b.logprobs):
                assert t in entry and len(entry) in (p.logprobs, p.logprobs + 1)
                assert entry[t].rank >= 1


def drive(engine, request_id: str, prompt, params: SamplingParams) -> list:
    engine.add_request(request_id, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_streamed_logprobs_add_up_to_the_final_ones(llm, kind):
    prompt = {"prompt_token_ids": [11, 12, 13]}
    final = llm.generate(prompt, greedy(max_tokens=9), use_tqdm=False)[0].outputs[0]
    outs = [o.outputs[0] for o in drive(llm.llm_engine, f"stream-{kind.name}", prompt,
                                        greedy(max_tokens=9, output_kind=kind))]
    assert len(outs) > 1
    for o in outs:
        assert len(o.logprobs) == len(o.token_ids)
    if kind == RequestOutputKind.DELTA:
        logprobs = [entry for o in outs for entry in o.logprobs]
    else:
        logprobs = outs[-1].logprobs
    assert logprobs == final.logprobs
    assert outs[-1].cumulative_logprob == pytest.approx(final.cumulative_logprob)


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_each_of_n_samples_has_the_logprobs_of_its_child_alone(llm, kind):
    prompt = {"prompt_token_ids": [20, 21, 22]}
    params = SamplingParams(n=3, seed=77, temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=2,
                            output_kind=kind)
    outs = drive(llm.llm_engine, f"parent-{kind.name}", prompt, params)
    samples = {}
    for out in outs:
        for c in out.outputs:
            entries = samples.setdefault(c.index, [[], [], None])
            if kind == RequestOutputKind.DELTA:
                entries[0] += c.token_ids
                entries[1] += c.logprobs
            else:
                entries[0], entries[1] = c.token_ids, c.logprobs
            entries[2] = c.cumulative_logprob
    assert sorted(samples) == [0, 1, 2]
    for index, (tokens, logprobs, cumulative) in samples.items():
        alone = llm.generate(prompt, SamplingParams(**{**vars(params), "n": 1, "seed": 77 + index,
                                                       "output_kind": RequestOutputKind.FINAL_ONLY}),
                             use_tqdm=False)[0].outputs[0]
        assert (tokens, logprobs) == (alone.token_ids, alone.logprobs)
        assert cumulative == pytest.approx(alone.cumulative_logprob)


def test_logprobs_cross_the_process_boundary_as_arrays(char_llama, llm):
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [30, 40]}]
    params = [greedy(max_tokens=6), greedy(max_tokens=6, logprobs=None)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    with LLM(**vars(engine_args(char_llama, dtype="float32", enable_multiprocessing=True)),
             show_progress=False) as mp_llm:
        processor = mp_llm.llm_engine.output_processor
        real_process = processor.process_outputs
        received = []

        def recording(core_outputs, timestamp):
            received.extend(co.new_logprobs for co in core_outputs)
            return real_process(core_outputs, timestamp)
        processor.process_outputs = recording
        got = mp_llm.generate(prompts, params, use_tqdm=False)
    arrays = [lp for lp in received if lp is not None]
    assert len(arrays) == 6 and len(received) == 12  # the request without logprobs got none
    for lp in arrays:
        assert isinstance(lp, LogprobsArrays)
        assert isinstance(lp.logprobs, np.ndarray) and lp.logprobs.dtype == np.float32
        assert lp.logprobs.shape == lp.token_ids.shape == (1, 1 + NUM_LOGPROBS)
        assert lp.token_ids.dtype == np.int32 and lp.ranks.dtype == np.int32 and lp.ranks.shape == (1,)
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob


def test_merged_delta_outputs_concatenate_their_logprobs_and_keep_the_latest_sum():
    def delta(token_id: int, logprob: float, cumulative: float) -> RequestOutput:
        completion = CompletionOutput(0, "", [token_id], cumulative, [{token_id: Logprob(logprob, 1)}])
        return RequestOutput("r", None, [1], [completion], finished=False)
    merged = delta(7, -0.5, -0.5)
    merged.add(delta(8, -0.25, -0.75), aggregate=True)  # what AsyncLLM does when a consumer falls behind
    (out,) = merged.outputs
    assert out.token_ids == [7, 8] and out.cumulative_logprob == -0.75
    assert out.logprobs == [{7: Logprob(-0.5, 1)}, {8: Logprob(-0.25, 1)}]
