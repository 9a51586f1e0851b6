"""The engine core in its own process, asynchronous scheduling, and AsyncLLM, on the
tiny Llama with a character tokenizer (so outputs are text and stop strings match)."""
import asyncio
import gc
import os
import signal
import time

import jax
import numpy as np
import pytest

from jaxllm import LLM, AsyncLLM, EngineArgs, EngineDeadError, LLMEngine, RequestOutputKind, SamplingParams
from tests.conftest import child_pids, kill_core_and_expect_engine_dead, tiny_model

pytestmark = pytest.mark.timeout(300)  # a hung core or client fails the test, never the CI run

MAX_MODEL_LEN = 128


def engine_args(model: str, **kwargs) -> EngineArgs:
    # 40 blocks of 16 tokens: far fewer than the workload needs at once, so requests are preempted.
    defaults = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=32, max_num_batched_tokens=128,
                    num_gpu_blocks_override=40, block_size=16)
    return EngineArgs(model=model, **{**defaults, **kwargs})


def workload(tokenizer, free_texts: list[str] | None = None, n: int = 48, seed: int = 0):
    """(request id, prompt, params) of mixed requests: greedy and seeded sampling, text
    and token prompts, stop strings and stop token ids picked from a free run's text
    (`free_texts`), ignore_eos or not. Every output is DELTA, so a driver sees each step."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(n):
        kind = i % 4
        params = dict(max_tokens=int(rng.integers(4, 40)), output_kind=RequestOutputKind.DELTA,
                      ignore_eos=bool(i % 3))
        if kind in (1, 3):
            params.update(temperature=0.9, top_p=0.9, top_k=50, seed=1000 + i)
        else:
            params.update(temperature=0.0)
        if free_texts is not None and kind == 2 and len(free_texts[i]) > 8:
            params["stop"] = [free_texts[i][5:7]]
        if free_texts is not None and kind == 3 and len(free_texts[i]) > 6:
            params["stop_token_ids"] = tokenizer.encode(free_texts[i][4])
        if i % 2:
            prompt = {"prompt_token_ids": rng.integers(3, 256, int(rng.integers(1, 60))).tolist()}
        else:
            prompt = "".join(chr(c) for c in rng.integers(97, 123, int(rng.integers(1, 60))))
        requests.append((f"req-{i}", prompt, SamplingParams(**params)))
    return requests


ABORTED = {"req-5", "req-12", "req-21", "req-30"}  # each aborted once it has given 3 tokens


def drive_engine(engine: LLMEngine, requests, aborts=()) -> dict:
    """Run the requests through engine.step(); request id -> (token ids, text, finish, stop reason)."""
    got = {rid: ([], [], None, None) for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, texts, _, _ = got[out.request_id]
            tokens += out.outputs[0].token_ids
            texts.append(out.outputs[0].text)
            got[out.request_id] = (tokens, texts, out.outputs[0].finish_reason, out.outputs[0].stop_reason)
            if out.request_id in aborts and not out.finished and len(tokens) >= 3:
                engine.abort_request(out.request_id)
    return {rid: (t, "".join(x), f, s) for rid, (t, x, f, s) in got.items()}


async def drive_async(llm: AsyncLLM, requests, aborts=()) -> dict:
    async def consume(rid, prompt, params):
        tokens, texts, finish, stop = [], [], None, None
        async for out in llm.generate(prompt, params, rid):
            tokens += out.outputs[0].token_ids
            texts.append(out.outputs[0].text)
            finish, stop = out.outputs[0].finish_reason, out.outputs[0].stop_reason
            if rid in aborts and len(tokens) >= 3:
                break  # leaving generate aborts the request
        return rid, (tokens, "".join(texts), finish, stop)
    return dict(await asyncio.gather(*(consume(*r) for r in requests)))


@pytest.fixture(scope="module")
def expected(char_llama):
    """The in-process, synchronous engine's outputs: what every other path must give."""
    with LLM(**vars(engine_args(char_llama, enable_multiprocessing=False, async_scheduling=False)),
             show_progress=False) as llm:
        engine = llm.llm_engine
        free = drive_engine(engine, workload(engine.tokenizer))
        requests = workload(engine.tokenizer, [free[rid][1] for rid, _, _ in workload(engine.tokenizer)])
        before = engine.get_stats()["num_preemptions"]
        reference = drive_engine(engine, requests)
        assert engine.get_stats()["num_preemptions"] > before
        return requests, reference


def check_against(expected, got) -> None:
    requests, reference = expected
    stopped = [rid for rid, (_, _, finish, stop) in reference.items() if isinstance(stop, str)]
    assert len(stopped) >= 3  # the stop strings did end requests
    for rid, _, _ in requests:
        tokens, text, finish, stop = got[rid]
        if rid in ABORTED:
            assert len(tokens) >= 3 and tokens == reference[rid][0][:len(tokens)], rid
        else:
            assert (tokens, text, finish, stop) == reference[rid], rid


@pytest.mark.parametrize("client", ["inproc", "sync_mp", "async_llm"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_client_gives_the_same_outputs_with_async_scheduling_on_and_off(
        char_llama, expected, client, async_scheduling):
    args = engine_args(char_llama, async_scheduling=async_scheduling, enable_multiprocessing=client != "inproc")
    got, stats = run_client(client, args, expected[0])
    check_against(expected, got)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def run_client(client: str, args: EngineArgs, requests) -> tuple[dict, dict]:
    """The requests' outputs (ABORTED aborted) through LLMEngine.step ("inproc", "sync_mp") or
    AsyncLLM ("async_llm"), and the core's stats once it holds no request."""
    if client == "async_llm":
        async def run():
            with AsyncLLM.from_engine_args(args, show_progress=False) as llm:
                got = await drive_async(llm, requests, ABORTED)
                return got, await wait_for_idle_core(llm)
        return asyncio.run(run())
    with LLM(**vars(args), show_progress=False) as llm:
        return drive_engine(llm.llm_engine, requests, ABORTED), llm.llm_engine.get_stats()


async def wait_for_idle_core(llm: AsyncLLM, timeout_s: float = 5.0) -> dict:
    """The core's stats once it holds no request (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while (stats := await llm.get_stats())["num_requests"] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return stats


def test_async_llm_streams_deltas_that_add_up_and_cancelled_tasks_free_their_blocks(char_llama):
    kinds = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(24)]

    async def collect(llm, i, kind, request_id, stop=None):
        params = SamplingParams(temperature=0.0, max_tokens=30, stop=stop, output_kind=kind)
        return [out async for out in llm.generate(prompts[i], params, request_id)]

    async def cancelled_mid_stream(llm, i, started):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=100, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        async for _ in llm.generate(f"long {i}", params, f"long-{i}"):
            started.set()

    async def run():
        with AsyncLLM.from_engine_args(engine_args(char_llama, num_gpu_blocks_override=200),
                                       show_progress=False) as llm:
            free = await asyncio.gather(*(collect(llm, i, kinds[2], f"free-{i}") for i in range(24)))
            # Every other prompt stops at two characters of its free output (held back while streaming).
            stops = [f[0].outputs[0].text[3:5] if i % 2 and len(f[0].outputs[0].text) > 6 else None
                     for i, f in enumerate(free)]
            started = [asyncio.Event() for _ in range(16)]
            doomed = [asyncio.create_task(cancelled_mid_stream(llm, i, started[i])) for i in range(16)]
            streams = [collect(llm, i % 24, kinds[i % 3], f"r{i}", stops[i % 24]) for i in range(48)]
            finals = [collect(llm, i, kinds[2], f"final-{i}", stops[i]) for i in range(24)]
            results = await asyncio.gather(*streams, *finals)
            await asyncio.gather(*(e.wait() for e in started))
            for task in doomed:
                task.cancel()
            await asyncio.gather(*doomed, return_exceptions=True)
            return results, stops, await wait_for_idle_core(llm)

    results, stops, stats = asyncio.run(run())
    streams, finals = results[:48], results[48:]
    for i, outs in enumerate(streams):
        assert len(finals[i % 24]) == 1 and finals[i % 24][0].finished
        final = finals[i % 24][0].outputs[0]
        kind = kinds[i % 3]
        if kind == RequestOutputKind.DELTA:
            assert "".join(o.outputs[0].text for o in outs) == final.text
            assert sum((o.outputs[0].token_ids for o in outs), []) == final.token_ids
        elif kind == RequestOutputKind.CUMULATIVE:
            texts = [o.outputs[0].text for o in outs]
            assert texts[-1] == final.text and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        else:
            assert len(outs) == 1 and outs[0].outputs[0].text == final.text
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == final.finish_reason
    assert sum(f[0].outputs[0].stop_reason is not None for f in finals) >= sum(s is not None for s in stops) >= 6
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_killing_the_core_fails_every_pending_request_promptly(char_llama):
    async def run():
        llm = AsyncLLM.from_engine_args(engine_args(char_llama, max_model_len=512, num_gpu_blocks_override=300),
                                        show_progress=False)
        pid = llm.engine_core.proc.pid
        params = SamplingParams(max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        started = [asyncio.Event() for _ in range(8)]

        async def consume(i):
            async for _ in llm.generate({"prompt_token_ids": [3 + i, 4, 5]}, params, f"k{i}"):
                started[i].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(8)]
        await asyncio.gather(*(e.wait() for e in started))
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
        elapsed = time.monotonic() - start
        assert all(isinstance(r, EngineDeadError) for r in results), results
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate("late", params, "late"):
                pass
        assert time.monotonic() - start < 0.5
        with pytest.raises(EngineDeadError):
            await llm.get_stats()
        llm.shutdown()
        return elapsed

    assert asyncio.run(run()) < 5.0
    assert child_pids() == []


def test_killing_the_core_under_llm_engine_raises_engine_dead_error(char_llama):
    engine = LLMEngine.from_engine_args(engine_args(char_llama, max_model_len=512, enable_multiprocessing=True),
                                        show_progress=False)
    engine.add_request("a", "hello", SamplingParams(max_tokens=500, ignore_eos=True))
    engine.step()
    kill_core_and_expect_engine_dead(engine)
    with pytest.raises(EngineDeadError):
        engine.add_request("b", "hello", SamplingParams(max_tokens=2))
    engine.shutdown()
    assert child_pids() == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="/nonexistent/model"), "not found"),
    (dict(model=tiny_model("llama"), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=2),
     "fewer than one request of max_model_len"),
])
def test_a_start_up_failure_in_the_core_raises_its_error_in_the_caller(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs, skip_tokenizer_init=True, enable_multiprocessing=True, show_progress=False)
    assert child_pids() == []


BAD_REQUESTS = [
    ({"prompt_token_ids": [1] * (MAX_MODEL_LEN + 1)}, SamplingParams(), "longer than max_model_len"),
    ({"prompt_token_ids": []}, SamplingParams(), "prompt is empty"),
    ({"prompt_token_ids": [1, 256]}, SamplingParams(), "outside the vocabulary"),
    ("hello", "not params", "sampling_params"),
]


def test_bad_input_is_rejected_in_the_front_end_and_the_engine_serves_on(char_llama):
    with LLM(**vars(engine_args(char_llama, enable_multiprocessing=True)), show_progress=False) as llm:
        engine = llm.llm_engine
        sent = []
        real_add = engine.engine_core.add_request
        engine.engine_core.add_request = lambda request: (sent.append(request.request_id), real_add(request))
        engine.add_request("good-1", "abc", SamplingParams(max_tokens=3, ignore_eos=True))
        for i, (prompt, params, message) in enumerate(BAD_REQUESTS):
            with pytest.raises((ValueError, TypeError), match=message):
                engine.add_request(f"bad-{i}", prompt, params)
        changed = SamplingParams(max_tokens=3)
        changed.max_tokens = -3
        with pytest.raises(ValueError, match="max_tokens"):
            engine.add_request("bad-changed", "abc", changed)
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("good-1", "abc", SamplingParams())
        engine.add_request("good-2", "abd", SamplingParams(max_tokens=3, ignore_eos=True))
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert sent == ["good-1", "good-2"] and sorted(finished) == ["good-1", "good-2"]
        assert all(len(o.outputs[0].token_ids) == 3 for o in finished.values())


@pytest.mark.usefixtures("warm_up")
def test_no_compilation_after_warm_up_in_the_core_process_with_async_scheduling(char_llama):
    with LLM(**vars(engine_args(char_llama, enable_multiprocessing=True, async_scheduling=True)),
             show_progress=False) as llm:
        before = llm.llm_engine.get_stats()["num_compilations"]
        rng = np.random.default_rng(7)
        for n, max_prompt in [(1, 5), (9, 120), (40, 60)]:
            prompts = [{"prompt_token_ids": rng.integers(3, 256, rng.integers(1, max_prompt)).tolist()}
                       for _ in range(n)]
            params = [SamplingParams(temperature=float(t % 2), max_tokens=int(rng.integers(1, 30)), seed=t)
                      for t in range(n)]
            llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.get_stats()["num_compilations"] == before


def test_del_frees_the_engine_without_the_garbage_collector(char_llama):
    gc.collect()
    gc.disable()
    try:
        arrays_before = len(jax.live_arrays())
        llm = LLM(**vars(engine_args(char_llama, enable_multiprocessing=False)), show_progress=False)
        assert len(jax.live_arrays()) > arrays_before
        del llm
        assert len(jax.live_arrays()) == arrays_before  # weights and KV cache freed at once

        llm = LLM(**vars(engine_args(char_llama, enable_multiprocessing=True)), show_progress=False)
        proc = llm.llm_engine.engine_core.proc
        del llm
        assert proc.poll() is not None and child_pids() == []
    finally:
        gc.enable()


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_speculative_decoding_gives_the_same_outputs(char_llama, expected):
    """n-gram drafts change no token: greedy and seeded requests, stop strings and stop ids,
    max_tokens, aborts and preemption under the small cache, through AsyncLLM and ZMQ (the drafts
    made on the device, under asynchronous scheduling)."""
    args = engine_args(char_llama, speculative_config=NGRAM, enable_multiprocessing=True)
    got, stats = run_client("async_llm", args, expected[0])
    check_against(expected, got)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_preemptions"] > 0
    # The drafts did take tokens (fewer than one step at a time: a request's drafts in flight count
    # against its max_tokens, and the random model's text seldom repeats).
    assert stats["spec_decode_num_accepted_tokens"] > 20, stats
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # and some were wrong


def test_guaranteed_no_evict_gives_the_same_outputs_without_preempting(char_llama, expected):
    """The admission that keeps every running request's blocks to its max_tokens: the workload that
    preempts under the default gives the same outputs, aborts included, and preempts nothing."""
    args = engine_args(char_llama, capacity_scheduler_policy="guaranteed_no_evict", enable_multiprocessing=False)
    got, stats = run_client("inproc", args, expected[0])
    check_against(expected, got)
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_preemptions"] == 0
