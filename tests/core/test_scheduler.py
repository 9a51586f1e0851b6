"""Scheduler and KV cache manager behaviour, without a model."""
import pytest

from jaxllm.config import SchedulerConfig
from jaxllm.core.block_pool import BlockPool
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.contracts.step import DRAFT_ON_DEVICE, ModelRunnerOutput
from jaxllm.core.scheduler import Scheduler
from jaxllm.spec_decode.draft_model import RunnerDrafts
from jaxllm.request import Request, RequestStatus
from jaxllm.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=64, enable_caching=False,
                   policy="max_utilization", layout=None):
    """Without the prefix cache unless asked: these prompts share their prefixes."""
    kv = KVCacheManager(num_blocks, block_size, layout, enable_caching=enable_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, async_scheduling=False,
                                     capacity_scheduler_policy=policy), kv)


def make_request(i, prompt_len, max_tokens=4):
    return Request(str(i), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   eos_token_ids=(), seed=hash(i) & 0xFFFF)


def held_blocks(scheduler) -> dict:
    """request id -> its blocks, in the one KV cache group of these schedulers."""
    return scheduler.kv.coordinator.managers[0].req_to_blocks


def run_step(scheduler, token=7):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, ModelRunnerOutput([[token]] * len(out.scheduled)))


def test_long_prompt_is_chunked_under_the_token_budget():
    s = make_scheduler(budget=16)
    s.add_request(make_request(0, 40))
    sizes = [run_step(s)[0].scheduled[0].num_new_tokens for _ in range(3)]
    assert sizes == [16, 16, 8]
    assert s.running[0].output_token_ids == [7]  # a token only once the prompt is done


def test_decodes_and_prefill_chunks_share_a_step():
    s = make_scheduler(budget=16)
    s.add_request(make_request(0, 3))
    run_step(s)
    s.add_request(make_request(1, 30))
    out, _ = run_step(s)
    assert [(r.req_id, r.num_new_tokens) for r in out.scheduled] == [("0", 1), ("1", 15)]


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(i, 2))
    out, _ = run_step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_newest_running_request_is_preempted_when_blocks_run_out():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, max_model_len=24)
    for i in range(3):
        s.add_request(make_request(i, 8, max_tokens=16))  # two blocks each: the pool is full
    run_step(s)
    out, _ = run_step(s)  # each needs a third block: the newest goes back to waiting
    assert out.num_preempted >= 1
    assert s.waiting[0].request_id == "2" and s.waiting[0].num_computed_tokens == 0
    assert s.waiting[0].status == RequestStatus.PREEMPTED


def preempting_scheduler():
    """Requests 0 and 1 fill the 4 blocks with 8 tokens each; 2 waits (max_num_seqs). The next
    step, 0 needs a third block and takes 1's: 1 is preempted."""
    s = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, budget=64)
    for i, prompt_len in enumerate([8, 8, 4]):
        s.add_request(make_request(i, prompt_len, max_tokens=16))
    run_step(s)
    return s


def test_preempted_request_goes_back_ahead_of_the_requests_that_never_ran():
    s = preempting_scheduler()
    run_step(s)
    assert [r.request_id for r in s.waiting] == ["1", "2"]


def test_preemption_frees_every_block_of_the_preempted_request():
    s = preempting_scheduler()
    run_step(s)
    assert list(held_blocks(s)) == ["0"] and s.kv.pool.num_free_blocks == 1  # 0 holds the other 3


def test_a_step_that_preempts_admits_no_waiting_request():
    # Budget 5: 0 prefills 4 tokens and 1 a chunk of 1. Next step 0's decode takes the last block,
    # 1's chunk of 4 finds none and 1 is preempted; the block 1 frees would hold that chunk again.
    s = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2, budget=5)
    s.add_request(make_request(0, 4, max_tokens=16))
    s.add_request(make_request(1, 8, max_tokens=16))
    run_step(s)
    out, _ = run_step(s)
    assert out.num_preempted == 1
    assert [r.req_id for r in out.scheduled] == ["0"] and [r.request_id for r in s.waiting] == ["1"]


def test_preempted_request_recomputes_prompt_and_outputs():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, max_model_len=24)
    for i in range(3):
        s.add_request(make_request(i, 8, max_tokens=16))
    recomputed = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        for r in out.scheduled:
            if r.num_computed_tokens == 0 and s.requests[r.req_id].num_output_tokens > 0:
                assert r.num_new_tokens == s.requests[r.req_id].num_tokens  # prompt + outputs so far, again
                recomputed += 1
        s.update_from_output(out, ModelRunnerOutput([[7]] * len(out.scheduled)))
    assert s.num_preemptions > 0 and recomputed > 0


def test_waiting_requests_are_admitted_in_arrival_order():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(i, 2))
    out, _ = run_step(s)
    assert [r.req_id for r in out.scheduled] == ["0", "1"]


def test_a_decode_is_scheduled_while_the_previous_steps_token_is_in_flight():
    s = make_scheduler()
    s.add_request(make_request(0, 3, max_tokens=8))
    s.schedule()
    decode = s.schedule().scheduled[0]  # asynchronous scheduling: the prefill's token is not back yet
    assert (decode.num_computed_tokens, decode.num_new_tokens, decode.samples) == (3, 1, True)


@pytest.mark.parametrize("max_tokens, max_model_len", [(2, 64), (16, 5)])
def test_a_request_whose_in_flight_tokens_end_it_by_length_is_not_scheduled_again(max_tokens, max_model_len):
    s = make_scheduler(max_model_len=max_model_len)
    s.add_request(make_request(0, 3, max_tokens=max_tokens))
    in_flight = [s.schedule(), s.schedule()]  # they will sample the 4th and 5th tokens: the last allowed
    assert s.schedule().is_empty
    results = [s.update_from_output(out, ModelRunnerOutput([[7]])) for out in in_flight]
    assert results[-1][0].finish_reason == "length" and s.kv.pool.num_free_blocks == 64


def test_every_block_returns_to_the_pool():
    s = make_scheduler(num_blocks=10, block_size=4, budget=16, max_model_len=32)
    for i in range(6):
        s.add_request(make_request(i, 5 + i, max_tokens=3 + i))
    while s.has_unfinished_requests():
        run_step(s)
    assert s.kv.pool.num_free_blocks == 10 and not held_blocks(s)


def test_aborted_request_frees_its_blocks():
    s = make_scheduler(num_blocks=10)
    s.add_request(make_request(0, 9))
    run_step(s)
    s.finish_requests(["0"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_free_blocks == 10 and not s.has_unfinished_requests()


def test_stop_token_and_length_finish_reasons():
    s = make_scheduler()
    r = Request("a", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[9]), eos_token_ids=(3,), seed=0)
    s.add_request(r)
    out, results = run_step(s, token=9)
    assert results[0].finish_reason == "stop" and results[0].stop_reason == 9
    r2 = make_request("b", 2, max_tokens=2)
    s.add_request(r2)
    run_step(s)
    _, results = run_step(s)
    assert results[0].finish_reason == "length" and r2.num_output_tokens == 2


def test_block_pool_rejects_double_free():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free_blocks(blocks)


def test_scheduler_output_carries_only_new_blocks_and_finished_ids():
    s = make_scheduler(block_size=4, budget=16)
    s.add_request(make_request(0, 6, max_tokens=4))
    new_blocks = [len(run_step(s)[0].scheduled[0].new_block_ids[0]) for _ in range(4)]
    assert new_blocks == [2, 0, 0, 1]  # tokens 1-6, 7, 8, then 9 opens a third block
    assert not s.has_unfinished_requests()
    s.add_request(make_request(1, 2))
    out = s.schedule()
    assert out.finished_req_ids == ["0"] and s.schedule().finished_req_ids == []


def drafting_scheduler(**kwargs) -> Scheduler:
    """A scheduler of 3 drafts a step made on the device (a draft model's: 3 lookahead slots)."""
    s = make_scheduler(**kwargs)
    return Scheduler(s.config, s.kv, RunnerDrafts(3), num_speculative_tokens=3)


def land(s: Scheduler, out, taken: list[int]):
    """Step `out`'s one request took `taken`; the drafter made [50, 51, 52] for after them."""
    return s.update_from_output(out, ModelRunnerOutput([taken], draft_token_ids=[[50, 51, 52]]))


def test_a_step_in_flight_counts_as_taking_every_draft_and_falls_back_when_it_lands():
    s = drafting_scheduler()
    request = make_request(0, 5, max_tokens=20)
    s.add_request(request)
    steps = [s.schedule(), s.schedule()]  # the prefill, and its next token with drafts made after it
    first = steps[1].scheduled[0]
    assert (first.num_computed_tokens, first.num_new_tokens, first.draft_token_ids) == (5, 4, [DRAFT_ON_DEVICE] * 3)
    land(s, steps[0], [10])
    steps.append(s.schedule())  # as if the step in flight takes its 3 drafts and the token after them
    second = steps[2].scheduled[0]
    assert (second.num_computed_tokens, second.num_new_tokens, second.token_ids) == (9, 4, [])
    land(s, steps[1], [11, 12])  # one draft taken, two rejected: the step in flight runs 2 positions back
    assert (request.num_tokens, request.num_computed_tokens, request.num_output_placeholders) == (8, 11, 4)
    land(s, steps[2], [13])
    assert (request.num_tokens, request.num_computed_tokens, request.num_output_placeholders) == (9, 8, 0)
    assert s.spec_totals.num_draft_tokens == 6 and s.spec_totals.num_accepted_tokens == 1


def test_drafts_in_flight_never_take_a_request_past_max_tokens():
    s = drafting_scheduler()
    request = make_request(0, 5, max_tokens=6)
    s.add_request(request)
    prefill, drafted = s.schedule(), s.schedule()
    assert len(drafted.scheduled[0].draft_token_ids) == 3
    land(s, prefill, [60])
    last = s.schedule()  # 1 token out and 4 in flight: room for one more, with no draft
    assert (last.scheduled[0].num_new_tokens, last.scheduled[0].draft_token_ids) == (1, [])
    land(s, drafted, [61, 62, 63, 64])  # every draft taken
    assert s.schedule().is_empty  # the token in flight is the 6th
    outputs = land(s, last, [65])
    assert outputs[0].finish_reason == "length" and request.num_output_tokens == 6
    assert s.kv.pool.num_free_blocks == 64


def test_running_requests_use_at_most_max_loras_adapters_and_the_others_wait_in_place():
    from jaxllm.lora.request import LoRARequest
    s = make_scheduler()
    s.max_loras = 2
    adapters = [LoRARequest(f"a{i}", i, "/adapters") for i in (1, 2, 3)]
    requests = []
    for i, lora in enumerate([adapters[0], adapters[1], adapters[2], None, adapters[0]]):
        requests.append(Request(str(i), [1, 2, 3], SamplingParams(max_tokens=2 if i == 0 else 4, temperature=0),
                                eos_token_ids=(), seed=i, lora_request=lora))
        s.add_request(requests[-1])
    out, _ = run_step(s)
    assert [r.req_id for r in out.scheduled] == ["0", "1", "3", "4"]  # adapter 3 would be a third
    assert [r.lora_request for r in out.new_requests] == [adapters[0], adapters[1], None, adapters[0]]
    assert [r.request_id for r in s.waiting] == ["2"]
    while "2" not in [r.req_id for r in out.scheduled]:
        assert len({r.lora_int_id for r in s.running} - {0}) <= 2
        out, _ = run_step(s)
    assert requests[0].is_finished and requests[4].is_finished  # adapter 3 waited for adapter 1's last request


@pytest.mark.parametrize("policy, preempts", [("max_utilization", True), ("guaranteed_no_evict", False)])
def test_guaranteed_no_evict_admits_only_what_the_cache_holds_to_max_tokens(policy, preempts):
    # 16 blocks of 4; each request reaches 8 + 8 tokens: 4 blocks, so 4 of them fit to the end.
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, policy=policy)
    requests = [make_request(i, 8, max_tokens=8) for i in range(8)]
    for r in requests:
        s.add_request(r)
    most = 0
    while s.has_unfinished_requests():
        run_step(s)
        most = max(most, len(s.running))
    assert (s.num_preemptions > 0) == preempts
    if not preempts:
        assert most == 4
    assert all(len(r.output_token_ids) == 8 and r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert s.kv.pool.num_free_blocks == 16 and not held_blocks(s)


def test_guaranteed_no_evict_keeps_what_the_running_requests_may_take_and_counts_prefix_hits_as_held():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, policy="guaranteed_no_evict",
                       enable_caching=True)
    s.add_request(make_request(0, 8, max_tokens=8))
    run_step(s)  # 0 holds its 8 prompt tokens' 2 blocks, and may take 2 more (16 tokens in all)
    assert s._blocks_to_finish(s.running[0]) == 2
    # Another such prompt finds 0's first block cached (a hit stops short of its last token) and held by
    # 0: it takes no free block, so the newcomer may take 3, not 4.
    newcomer = make_request(1, 8, max_tokens=8)
    hit, num_cached = s.kv.get_computed_blocks(newcomer)
    assert num_cached == 4 and s._blocks_to_finish(newcomer, hit) == 3 and s._blocks_to_finish(newcomer) == 4
    for i in range(1, 8):
        s.add_request(make_request(i, 8, max_tokens=8))
    while s.has_unfinished_requests():
        run_step(s)
        assert sum(s._blocks_to_finish(r) for r in s.running) <= s.kv.pool.num_free_blocks
    assert s.num_preemptions == 0 and not held_blocks(s)


def test_guaranteed_no_evict_runs_a_request_longer_than_the_cache_alone():
    # max_tokens=None: to the model length, 64 tokens, more than the 8 blocks of 4 hold; with nothing
    # running it is admitted anyway (and preempted as under max_utilization), and the next waits for it.
    s = make_scheduler(num_blocks=8, block_size=4, budget=64, policy="guaranteed_no_evict")
    s.add_request(make_request(0, 4, max_tokens=None))
    s.add_request(make_request(1, 4, max_tokens=4))
    run_step(s)
    assert [r.request_id for r in s.running] == ["0"] and s.waiting[0].request_id == "1"


def test_guaranteed_no_evict_reserves_a_sliding_window_groups_window_alone():
    from jaxllm.models.kv_layout import KVCacheGroup, KVCacheLayout
    layout = KVCacheLayout((KVCacheGroup(8, (0,)),), 1)  # a window of 8 tokens: at most 4 blocks of 4 at once
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, max_model_len=128,
                       policy="guaranteed_no_evict", layout=layout)
    requests = [make_request(i, 4, max_tokens=60) for i in range(8)]
    for r in requests:
        s.add_request(r)
    run_step(s)
    assert len(s.running) == 4  # 16 blocks, 4 a request: a full-attention reservation (16 each) would take one
    while s.has_unfinished_requests():
        run_step(s)
    assert s.num_preemptions == 0 and s.kv.pool.num_free_blocks == 16
