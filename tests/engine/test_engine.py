"""The whole engine on a tiny random Llama: batching, preemption, compilation, KV accounting."""
import re

import numpy as np
import pytest

from jaxllm import LLM, RequestOutputKind, SamplingParams, compilation
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("warm_up_every_engine")

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def llm():
    # 40 blocks of 16 tokens: 640 tokens, far fewer than 64 requests need at once.
    # In this process (the tests below look inside the core), asynchronous scheduling on.
    with LLM(tiny_model("llama"), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, max_num_seqs=32,
             max_num_batched_tokens=128, num_gpu_blocks_override=40, block_size=16, show_progress=False,
             enable_multiprocessing=False) as llm:
        yield llm


def workload(n, seed, max_prompt=60, max_out=40):
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, rng.integers(1, max_prompt)).tolist()} for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, max_out)), ignore_eos=True)
              for _ in range(n)]
    return prompts, params


def stats(llm) -> dict:
    return llm.llm_engine.get_stats()


def test_batched_outputs_equal_each_request_run_alone_despite_preemption(llm):
    prompts, params = workload(64, seed=0)
    before = stats(llm)["num_preemptions"]
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert stats(llm)["num_preemptions"] > before
    for prompt, p, out in zip(prompts, params, batched):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == p.max_tokens
        assert out.outputs[0].finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    prompts, _ = workload(12, seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(12)]
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, batched):
        assert out.outputs[0].token_ids == llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids


def test_the_engine_reports_its_start_up_split_into_weights_kv_cache_and_compile(llm):
    description = llm.llm_engine.engine_core.description
    assert re.search(r"start-up: weights \d+\.\d s, kv_cache \d+\.\d s, compile \d+\.\d s \(\d+ executables, ", description)


def test_no_compilation_after_warm_up(llm):
    count = compilation.num_compilations()
    for n, seed, max_prompt in [(1, 2, 5), (7, 3, 120), (33, 4, 30), (64, 5, 90)]:
        prompts, params = workload(n, seed, max_prompt=max_prompt)
        llm.generate(prompts, params, use_tqdm=False)
    greedy_and_sampled = [SamplingParams(temperature=t, top_p=0.8, max_tokens=5) for t in (0.0, 1.0)]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, greedy_and_sampled, use_tqdm=False)
    assert compilation.num_compilations() == count


def test_every_block_returns_to_the_pool(llm):
    prompts, params = workload(40, seed=6)
    llm.generate(prompts, params, use_tqdm=False)
    s = stats(llm)
    assert s["num_free_blocks"] == s["num_blocks"] and s["num_requests"] == 0
    assert not any(m.req_to_blocks for m in llm.llm_engine.engine_core.core.scheduler.kv.coordinator.managers)


def test_stop_token_ids_end_a_request(llm):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    stop_at = free.outputs[0].token_ids[3]
    first = free.outputs[0].token_ids.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free.outputs[0].token_ids[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_prompt_filling_max_model_len_finishes_with_length(llm):
    out = llm.generate({"prompt_token_ids": [3] * MAX_MODEL_LEN}, SamplingParams(max_tokens=10), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [1] * (MAX_MODEL_LEN + 1)}, "longer than max_model_len"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [1, 256]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1, -1]}, "outside the vocabulary"),
    ("text needs a tokenizer", "skip_tokenizer_init"),
])
def test_bad_prompt_raises_naming_the_problem(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert stats(llm)["num_requests"] == 0 and not llm.llm_engine.has_unfinished_requests()


def test_one_bad_request_leaves_the_others_running(llm):
    engine = llm.llm_engine
    engine.add_request("good-1", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", {"prompt_token_ids": [999]}, SamplingParams(max_tokens=3))
    engine.add_request("good-2", {"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["good-1", "good-2"]
    assert all(len(o.outputs[0].token_ids) == 3 for o in finished.values())


def test_kv_cache_that_cannot_hold_one_full_request_is_rejected_at_start():
    with pytest.raises(ValueError, match="fewer than one request of max_model_len"):
        LLM(tiny_model("llama"), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
            num_gpu_blocks_override=MAX_MODEL_LEN // 16 - 1, block_size=16, show_progress=False)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_output_kinds_add_up_to_the_same_tokens(llm, kind):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=kind)
    engine.add_request(f"kind-{kind.name}", {"prompt_token_ids": [4, 5, 6]}, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    expected = llm.generate({"prompt_token_ids": [4, 5, 6]}, params, use_tqdm=False)[0].outputs[0].token_ids
    steps = [o.outputs[0].token_ids for o in outs]
    if kind == RequestOutputKind.DELTA:
        assert sum(steps, []) == expected and all(len(s) == 1 for s in steps)
    elif kind == RequestOutputKind.CUMULATIVE:
        assert steps[-1] == expected and len(steps) == 6
    else:
        assert steps == [expected] and outs[0].finished
    assert params.output_kind == kind  # generate() copied, did not mutate, the caller's params


def test_a_failed_step_ends_running_requests_with_an_error_and_the_engine_serves_on(llm, monkeypatch):
    engine, runner = llm.llm_engine, llm.llm_engine.engine_core.core.executor.runner
    engine.add_request("doomed", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5))
    monkeypatch.setattr(runner, "_forward", lambda *args: (_ for _ in ()).throw(RuntimeError("device fell over")))
    outs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("doomed", "error")]
    assert "device fell over" in outs[0].error and not engine.has_unfinished_requests()
    monkeypatch.undo()
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    s = stats(llm)
    assert s["num_free_blocks"] == s["num_blocks"]


def test_without_warm_up_each_executable_compiles_when_first_used_and_gives_the_same_tokens(llm, monkeypatch):
    """JAXLLM_WARM_UP=0: nothing compiles at start-up, the first steps compile what they need, and
    the tokens are those of the warmed-up engine."""
    prompts, params = workload(6, 7, max_prompt=60)
    want = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("JAXLLM_WARM_UP", "0")
    with LLM(tiny_model("llama"), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, max_num_seqs=32,
             max_num_batched_tokens=128, num_gpu_blocks_override=40, block_size=16, show_progress=False,
             enable_multiprocessing=False) as lazy:
        assert "compile 0.0 s (skipped (JAXLLM_WARM_UP=0" in lazy.llm_engine.engine_core.description
        started = compilation.num_compilations()
        got = [out.outputs[0].token_ids for out in lazy.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert compilation.num_compilations() > started
