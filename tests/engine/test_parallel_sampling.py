"""Parallel sampling: a request with n > 1 runs as n child requests that
share the prompt, and comes back as one RequestOutput with samples of index 0..n-1."""
import asyncio
import time

import pytest

from jaxllm import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from tests.engine.test_core_process import engine_args

pytestmark = pytest.mark.timeout(300)  # a hung step loop or core fails the test, never the CI run

PROMPT = "The sea"
SEED = 1234
# Many stop ids, so the seeded children stop after different numbers of tokens.
EARLY_STOPS = list(range(3, 60))


def sampled(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, **kwargs})


@pytest.fixture(scope="module")
def llm(char_llama):
    # The shapes of tests/engine/test_core_process.py's engines: their executables are cached.
    with LLM(**vars(engine_args(char_llama, enable_multiprocessing=False)), show_progress=False) as llm:
        yield llm


def samples(out) -> list[tuple[int, list[int], str, str | None]]:
    return [(c.index, c.token_ids, c.text, c.finish_reason) for c in out.outputs]


def alone(llm, **kwargs) -> list[int]:
    return llm.generate(PROMPT, sampled(**kwargs), use_tqdm=False)[0].outputs[0].token_ids


def drive(engine, request_id: str, params: SamplingParams) -> list:
    """Every RequestOutput LLMEngine.step gives for one request."""
    engine.add_request(request_id, PROMPT, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {request_id}
    return outs


def assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_n4_with_a_seed_gives_four_distinct_reproducible_samples_each_its_child_alone(llm):
    (out,) = llm.generate(PROMPT, sampled(n=4, seed=SEED), use_tqdm=False)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    tokens = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in tokens}) == 4
    assert tokens == [alone(llm, seed=SEED + i) for i in range(4)]  # vLLM's child seeds: seed + index
    again = llm.generate(PROMPT, sampled(n=4, seed=SEED), use_tqdm=False)[0]
    assert samples(again) == samples(out)
    assert_idle(llm.llm_engine)


def test_n_without_a_seed_still_gives_distinct_samples(llm):
    (out,) = llm.generate(PROMPT, sampled(n=4), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4


def test_n1_is_one_request_under_its_own_id_and_is_the_first_child(llm):
    outs = drive(llm.llm_engine, "solo", sampled(seed=SEED, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0]
    first_child = llm.generate(PROMPT, sampled(n=3, seed=SEED), use_tqdm=False)[0].outputs[0]
    assert outs[0].outputs[0].token_ids == first_child.token_ids


def test_generate_with_several_prompts_keeps_their_order_and_n_samples_each(llm):
    prompts = [PROMPT, "A cat", PROMPT]
    outs = llm.generate(prompts, sampled(n=2, seed=SEED), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert all([c.index for c in o.outputs] == [0, 1] for o in outs)
    assert samples(outs[0]) == samples(outs[2]) != samples(outs[1])


def test_final_only_gives_one_output_once_every_child_is_done(llm):
    params = sampled(n=4, seed=SEED, max_tokens=30, stop_token_ids=EARLY_STOPS,
                     output_kind=RequestOutputKind.FINAL_ONLY)
    outs = drive(llm.llm_engine, "final", params)
    assert len(outs) == 1 and outs[0].finished
    lengths = [len(c.token_ids) for c in outs[0].outputs]
    assert len(set(lengths)) > 1  # the children did finish in different steps
    assert [c.index for c in outs[0].outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in outs[0].outputs] == [
        alone(llm, seed=SEED + i, max_tokens=30, stop_token_ids=EARLY_STOPS) for i in range(4)]
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_streamed_outputs_carry_one_sample_each_and_add_up_to_the_final_ones(llm, kind):
    common = dict(n=4, seed=SEED, max_tokens=30, stop_token_ids=EARLY_STOPS)
    (final,) = llm.generate(PROMPT, sampled(**common), use_tqdm=False)
    outs = drive(llm.llm_engine, "stream", sampled(**common, output_kind=kind))
    # As vLLM: each output holds the one sample that moved; only the last is finished.
    assert all(len(o.outputs) == 1 for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    for c in final.outputs:
        mine = [o.outputs[0] for o in outs if o.outputs[0].index == c.index]
        assert [m.finish_reason is not None for m in mine] == [False] * (len(mine) - 1) + [True]
        if kind == RequestOutputKind.DELTA:
            assert sum((m.token_ids for m in mine), []) == c.token_ids
            assert "".join(m.text for m in mine) == c.text
        else:
            assert all(b.token_ids[:len(a.token_ids)] == a.token_ids for a, b in zip(mine, mine[1:]))
            assert (mine[-1].token_ids, mine[-1].text) == (c.token_ids, c.text)
        assert mine[-1].finish_reason == c.finish_reason
    assert_idle(llm.llm_engine)


def test_aborting_the_parent_aborts_every_child_and_frees_their_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("doomed", PROMPT, sampled(n=4, seed=SEED, max_tokens=100,
                                                 output_kind=RequestOutputKind.DELTA))
    seen = set()
    while len(seen) < 4:  # every child has run
        seen |= {o.outputs[0].index for o in engine.step()}
    assert engine.get_stats()["num_requests"] == 4
    engine.abort_request("doomed")
    assert_idle(engine)
    assert engine.step() == []


def test_a_request_id_a_parent_or_its_children_hold_is_in_use(llm):
    engine = llm.llm_engine
    engine.add_request("busy", PROMPT, sampled(n=2, max_tokens=100))
    try:
        for request_id, n in [("busy", 1), ("busy", 3), ("1_busy", 1)]:
            with pytest.raises(ValueError, match=f"request_id '{request_id}' is already in use"):
                engine.add_request(request_id, PROMPT, sampled(n=n))
    finally:
        engine.abort_request("busy")
    assert_idle(engine)


@pytest.mark.parametrize("n, error, message", [
    (0, ValueError, "n must be >= 1, got 0"),
    (-2, ValueError, "n must be >= 1, got -2"),
    (True, TypeError, "n must be an int, got True"),
    (2.0, TypeError, "n must be an int, got 2.0"),
])
def test_n_below_one_or_not_an_int_is_a_clear_error(n, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(n=n)


def test_async_llm_gathers_the_samples_of_each_output_kind_and_abort_frees_the_children(char_llama):
    kinds = [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE]
    common = dict(n=3, seed=SEED, max_tokens=30, stop_token_ids=EARLY_STOPS)

    async def collect(llm, kind):
        return [o async for o in llm.generate(PROMPT, sampled(**common, output_kind=kind), f"r-{kind.name}")]

    async def abandon(llm):
        params = sampled(n=3, max_tokens=100, output_kind=RequestOutputKind.DELTA)
        async for out in llm.generate(PROMPT, params, "abandoned"):
            break  # leaving generate aborts the parent, so every child

    async def run():
        with AsyncLLM.from_engine_args(engine_args(char_llama), show_progress=False) as llm:
            results = await asyncio.gather(*(collect(llm, kind) for kind in kinds))
            await abandon(llm)
            deadline = time.monotonic() + 5.0  # the abort reaches the core asynchronously
            while (stats := await llm.get_stats())["num_requests"] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return results, stats

    (finals, deltas, cumulatives), stats = asyncio.run(run())
    assert len(finals) == 1 and finals[0].finished
    expected = {c.index: (c.token_ids, c.text) for c in finals[0].outputs}
    assert sorted(expected) == [0, 1, 2]
    for outs, kind in [(deltas, RequestOutputKind.DELTA), (cumulatives, RequestOutputKind.CUMULATIVE)]:
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        got = {}
        for out in outs:
            for c in out.outputs:
                tokens, text = got.get(c.index, ([], "")) if kind == RequestOutputKind.DELTA else ([], "")
                got[c.index] = (tokens + c.token_ids, text + c.text)
        assert got == expected, kind
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
