"""Scheduler: which requests run this step, and with how many new tokens.

vLLM v1's policy: running requests first (decodes and unfinished prefill chunks),
then waiting ones in arrival order, all under one token budget
(`max_num_batched_tokens`) and `max_num_seqs`. A request's new tokens are simply
`num_tokens - num_computed_tokens`, so prefill chunks, decodes and recomputation
after preemption are one case. When blocks run out, the newest running request
is preempted (its blocks freed, its progress reset) back to the head of waiting.
A request admitted from waiting starts after the longest prefix the KV cache holds
(prefix caching: KVCacheManager.get_computed_blocks), a resumed one included.

LoRA (max_loras > 0): the running requests use at most max_loras distinct adapters, so every
step's adapters fit the runner's device slots. A waiting request whose adapter would be one
too many stays waiting, in its place, and those behind it may be admitted.

Capacity (`capacity_scheduler_policy`, TensorRT-LLM's names): under "max_utilization" (the
default, vLLM's) a waiting request is admitted when its next tokens' blocks are free, and a
running one is preempted when the blocks run out. Under "guaranteed_no_evict" it is admitted
only if the free blocks cover what every running request and it may still take until their
max_tokens (within the model length): none is preempted, and the batch is as large as the
cache holds to the end (the best batch for long outputs, where preemption recomputes). With
nothing running, a request is admitted as under "max_utilization", so none waits forever.

Asynchronous scheduling: step N+1 is scheduled while step N runs, so a token that
step N samples is not known yet. It counts as a placeholder
(`num_output_placeholders`): its KV slot can be scheduled (the runner feeds it
from step N's sampled ids on the device) and it is appended when step N's
output lands. A request whose in-flight token will end it by length is not
scheduled again, so the only waste is one step of a request that an EOS, a stop
token or a stop string ends.

Speculative decoding (a `proposer`, spec_decode/): a decoding request is scheduled with its
draft tokens after its next token, within the token budget, its max_tokens and the model
length; their KV slots are the request's like any others'. When the step lands, the
request takes the drafts the model agreed with and the token after them, one by one
until a stop, and `num_computed_tokens` falls back to what was accepted: the KV slots
of rejected drafts are written again by the next step. Requests under the core's token
masks get no drafts. A draft model's or EAGLE head's drafts come with the step's output (the
runner makes them on the device), and its KV is written past the step's tokens: each request
holds that many slots more. N-gram drafts are made here from the tokens of the step before under
synchronous scheduling, and by the runner too under asynchronous scheduling.

With drafts made by the runner scheduling stays asynchronous. A step in flight with d drafts of a
request counts 1 + d placeholders, as if the model took them all: the next step is scheduled from there,
its next token and drafts on the device (DRAFT_ON_DEVICE), its blocks held for that count, and
the runner moves its positions back over the drafts the model rejected. When the step lands,
`num_computed_tokens` falls back one step late; a request it ended drops the next step's tokens.

Pipeline parallelism (several steps in flight, one per stage) schedules no token of a request
whose sampled token is still on its way: a decoding request sits out until its step lands, so the
steps in flight hold other requests, or a long prompt's next chunks (their tokens are known).

A pooling request (an engine with runner="pooling") is a prompt that never samples, prefilled in
chunks like any other: the runner pools the hidden states of the step that reaches its prompt's
end, and when that step lands the request finishes with the vector, its blocks freed.
"""
import collections
import logging
import time

import numpy as np

from jaxllm.config import SchedulerConfig
from jaxllm.contracts.engine_core import EngineCoreOutput, LogprobsArrays, SchedulerStats, SpecDecodingStats
from jaxllm.contracts.step import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.request import FINISH_REASONS, Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, proposer=None,
                 num_speculative_tokens: int = 0, max_loras: int = 0):
        """proposer: the drafts' (spec_decode/), up to num_speculative_tokens per request and step;
        max_loras: with LoRA, the most distinct adapters the running requests may use."""
        self.config = config
        self.kv = kv_cache_manager
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_loras = max_loras
        self.num_lookahead_tokens = proposer.num_lookahead_tokens if proposer else 0
        self._no_evict = config.capacity_scheduler_policy == "guaranteed_no_evict"
        # Under pipeline parallelism a request's next token is scheduled only once its last one has landed:
        # the first stage never waits for the last (the steps in flight are other requests').
        self._one_step_in_flight = config.pipeline_parallel_size > 1
        # Since the last stats, and since start-up.
        self.spec_stats = SpecDecodingStats.empty(num_speculative_tokens) if proposer else None
        self.spec_totals = SpecDecodingStats.empty(num_speculative_tokens) if proposer else None
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_totals = [0, 0]  # tokens since start-up: looked up, found
        self.expert_tokens: np.ndarray | None = None  # a MoE model's tokens per expert since the last stats
        self._totals_at_last_stats = (0, 0)  # SchedulerStats carry the increments since
        self._finished_req_ids: list[str] = []
        self._preempted_req_ids: list[str] = []
        self.paused = False  # admit no waiting request (EngineCore.pause, sleep): the running ones go on
        self._num_steps = 0
        # Per step not yet applied (SchedulerOutput.step_id), its requests: an id may name another
        # request by the time the step lands (the old one aborted, a new one given its id).
        self._in_flight: dict[int, list[Request]] = {}

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or (self.waiting and not self.paused))

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledRequest] = []
        requests: list[Request] = []  # of `out`
        new_requests: list[NewRequestData] = []
        preempted = 0

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = self._num_pending_tokens(request)
            # Nothing pending: a pooling request whose whole prompt is scheduled waits for its vector.
            if not pending or (request.num_output_placeholders and (self._one_step_in_flight
                                                                    or self._awaits_last_token(request))):
                i += 1
                continue
            num_new = min(pending, budget)
            drafts = self._drafts(request, budget) if num_new == 1 and self.proposer else []
            while (new_blocks := self._allocate(request, num_new + len(drafts))) is None:
                if drafts:  # short of blocks: the next token alone first
                    drafts = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            else:
                out.append(self._schedule(request, num_new, new_blocks, drafts))
                requests.append(request)
                budget -= num_new + len(drafts)
                i += 1

        # Admit waiting requests only in a step that preempted nothing: blocks are short.
        # Under guaranteed_no_evict, the free blocks the running requests may yet take are kept for them
        # (summed once a waiting request asks).
        reserved = None
        skipped: list[Request] = []  # waiting requests whose adapter would be one too many, in order
        running_loras = {r.lora_int_id for r in self.running} - {0} if self.max_loras else set()
        while (self.waiting and budget > 0 and not preempted and not self.paused
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.num_output_placeholders and self._one_step_in_flight:  # preempted while its step runs
                break
            if request.lora_int_id and request.lora_int_id not in running_loras:
                if len(running_loras) >= self.max_loras:
                    skipped.append(self.waiting.popleft())
                    continue
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            if self._no_evict and self.running:
                if reserved is None:
                    reserved = sum(self._blocks_to_finish(r) for r in self.running)
                if reserved + self._blocks_to_finish(request, computed_blocks) > self.kv.pool.num_free_blocks:
                    break
            num_new = min(self._num_pending_tokens(request) - num_cached, budget)
            new_blocks = self._allocate(request, num_new, num_cached, computed_blocks)
            if new_blocks is None:
                break
            self.waiting.popleft()
            if self.kv.enable_caching:
                self.prefix_cache_totals[0] += request.num_tokens
                self.prefix_cache_totals[1] += num_cached
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora_int_id:
                running_loras.add(request.lora_int_id)
            new_requests.append(NewRequestData(
                request.request_id, request.prompt_token_ids, request.sampling_params, request.seed,
                request.stop_token_ids, list(request.output_token_ids), request.banned_token_ids,
                request.needs_host_mask, request.pooling_params, request.lora_request))
            out.append(self._schedule(request, num_new, new_blocks))
            requests.append(request)
            budget -= num_new
            if reserved is not None:
                reserved += self._blocks_to_finish(request)
        self.waiting.extendleft(reversed(skipped))

        self.num_preemptions += preempted
        if not out:  # an empty output never reaches the runner: the ids wait for the next one
            return SchedulerOutput([], 0, num_preempted=preempted)
        self._num_steps += 1
        self._in_flight[self._num_steps] = requests
        finished, self._finished_req_ids = self._finished_req_ids, []
        preempted_ids, self._preempted_req_ids = self._preempted_req_ids, []
        return SchedulerOutput(out, self.config.max_num_batched_tokens - budget, new_requests, finished,
                               preempted_ids, preempted, self._num_steps)

    def _blocks_to_finish(self, request: Request, computed_blocks=None) -> int | float:
        """The free blocks `request` may yet take before it ends by length: its prompt and max_tokens
        within the model length, its drafts' slots and the proposer's lookahead after them."""
        max_tokens = request.max_tokens if request.max_tokens is not None else self.config.max_model_len
        final = (min(len(request.prompt_token_ids) + max_tokens, self.config.max_model_len)
                 + self.num_speculative_tokens + self.num_lookahead_tokens)
        return self.kv.num_blocks_to_reach(request, final, computed_blocks)

    def _allocate(self, request: Request, num_new: int, num_cached: int = 0, computed_blocks=None):
        """KVCacheManager.allocate_slots, with the proposer's lookahead slots within the model length."""
        end = request.num_computed_tokens + num_cached + num_new
        lookahead = min(self.num_lookahead_tokens, self.config.max_model_len - end)
        # The drafts of the step in flight (its placeholders but the sampled token) may yet be rejected.
        unverified = max(request.num_output_placeholders - 1, 0)
        return self.kv.allocate_slots(request, num_new, num_cached, computed_blocks, max(lookahead, 0), unverified)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The proposer's drafts for a decoding request: never more than the budget, its max_tokens
        and the model length leave room for after its next token, the step in flight counted as if
        it took every draft."""
        if request.needs_host_mask or request.pooling_params is not None:
            return []
        num_tokens = request.num_tokens + request.num_output_placeholders
        room = min(self.num_speculative_tokens, budget - 1, self.config.max_model_len - num_tokens - 1)
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - request.num_output_placeholders - 1)
        return self.proposer.propose(request, room) if room > 0 else []

    @staticmethod
    def _schedule(request: Request, num_new: int, new_blocks: list[list[int]],
                  drafts: list[int] = ()) -> ScheduledRequest:
        """num_new tokens of `request` (and its drafts after them) in this step."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        # A pooling request samples nothing: the step that reaches its prompt's end pools it.
        samples = request.pooling_params is None and end == request.num_tokens + request.num_output_placeholders
        known = request.token_ids(start, min(end, request.num_tokens)) if start < request.num_tokens else []
        scheduled = ScheduledRequest(request.request_id, start, num_new + len(drafts), known, new_blocks, samples,
                                     draft_token_ids=list(drafts))
        if end < request.num_tokens:  # a prefill chunk: the token after it is known
            scheduled.next_token_id = request.token_ids(end, end + 1)[0]
        num_new += len(drafts)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        if request.sampling_params.prompt_logprobs is not None:
            # Position p's logprobs come from token p - 1's logits; a recomputed prompt sends none twice.
            lo, hi = max(start + 1, request.next_prompt_logprob), min(start + num_new + 1, request.num_prompt_tokens)
            if lo < hi:
                scheduled.prompt_logprobs = (lo, hi)
                request.next_prompt_logprob = hi
        request.num_computed_tokens += num_new
        if samples:  # the tokens it may take: its next one, and each draft
            request.num_output_placeholders += 1 + len(drafts)
        return scheduled

    @staticmethod
    def _num_pending_tokens(request: Request) -> int:
        """Tokens whose KV is still to compute, an in-flight one included."""
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    def _awaits_last_token(self, request: Request) -> bool:
        """True when the tokens still on the device may end the request by length (every draft taken)."""
        n = request.num_output_placeholders
        out_of_tokens = request.max_tokens is not None and len(request.output_token_ids) + n >= request.max_tokens
        return out_of_tokens or request.num_tokens + n >= self.config.max_model_len

    def preempt_all(self) -> None:
        """Send every running request back to waiting, its KV freed and its tokens kept (it
        recomputes them when admitted again). No step may be in flight."""
        while self.running:
            self._preempt(self.running.pop())
            self.num_preemptions += 1

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self._preempted_req_ids.append(request.request_id)

    def scheduled_requests(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The requests of a step not yet applied, in its order."""
        return self._in_flight[scheduler_output.step_id]

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append the tokens each sampling request took (its grammar accepts them) and finish the
        ones that stop. Requests that ended while the step ran (abort, stop, error) drop theirs.
        A request gets the logprobs cut to its own number of top logprobs. A request whose host
        work failed in the runner (runner_output.failed), or whose update here raises, ends with
        the error; the others go on."""
        outputs, failed = [], runner_output.failed
        requests = self._in_flight.pop(scheduler_output.step_id, [])
        if runner_output.expert_counts is not None:
            counts = runner_output.expert_counts.astype(np.int64)
            self.expert_tokens = counts if self.expert_tokens is None else self.expert_tokens + counts
        logprob_row = 0  # runner_output.logprobs has a row per token taken, the requests' in order
        for i, (sched, request) in enumerate(zip(scheduler_output.scheduled, requests)):
            token_ids = runner_output.sampled_token_ids[i]
            if sched.samples:
                request.num_output_placeholders -= 1 + len(sched.draft_token_ids)
            if sched.draft_token_ids:
                self._count_drafts(sched, request, len(token_ids) - 1)
            row, logprob_row = logprob_row, logprob_row + len(token_ids)
            if (runner_output.draft_token_ids is not None and sched.samples and self.proposer
                    and not request.is_finished):  # (a prefill chunk that does not sample has no drafts)
                self.proposer.take(request.request_id, runner_output.draft_token_ids[i])
            error = failed.get(request.request_id)
            if error is None:
                try:
                    output = self._update_request(sched, request, i, token_ids, row, runner_output)
                    if output is not None:
                        outputs.append(output)
                    continue
                except Exception as e:
                    logger.exception("request %s: its update failed", request.request_id)
                    error = f"{type(e).__name__}: {e}"
            if not request.is_finished:
                request.status = RequestStatus.FINISHED_ERROR
                self._free(request)
                outputs.append(EngineCoreOutput(request.request_id, [], "error", error=error))
        return outputs

    def _count_drafts(self, sched: ScheduledRequest, request: Request, num_accepted: int) -> None:
        """A step's drafts of one request: the rejected ones' KV is not the request's (the next
        step writes it again), and the acceptance goes into the stats. A request preempted since
        holds no KV to take back."""
        num_drafts = len(sched.draft_token_ids)
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens -= num_drafts - num_accepted
        self.spec_stats.observe(num_drafts, num_accepted)
        self.spec_totals.observe(num_drafts, num_accepted)

    def _update_request(self, sched: ScheduledRequest, request: Request, i: int, token_ids: list[int],
                        logprob_row: int, runner_output: ModelRunnerOutput) -> EngineCoreOutput | None:
        """Scheduled request i's news from the step (None: nothing to tell): the tokens it took,
        one by one until one ends it; its logprobs are rows logprob_row.. of the runner's."""
        if request.pooling_params is not None:
            return self._pooled(sched, request, runner_output.pooler_output, i)
        new_prompt_logprobs = None
        prompt_logprobs = runner_output.prompt_logprobs
        if prompt_logprobs is not None and prompt_logprobs[i] is not None and not request.is_finished:
            new_prompt_logprobs = _columns(prompt_logprobs[i], request.sampling_params.prompt_logprobs)
        if not sched.samples:  # a prefill chunk short of the prompt's end
            if new_prompt_logprobs is not None:
                return EngineCoreOutput(request.request_id, [], new_prompt_logprobs=new_prompt_logprobs)
            return None
        if request.is_finished:
            return None
        taken, stopped = [], False
        for token_id in token_ids:
            request.append_token(token_id)
            taken.append(token_id)
            if stopped := request.check_stop(self.config.max_model_len):
                break
        if request.grammar is not None:
            request.advance_grammar()
        output = EngineCoreOutput(request.request_id, taken, new_prompt_logprobs=new_prompt_logprobs)
        if request.num_output_tokens == len(taken):
            output.first_scheduled_time = request.first_scheduled_time
            output.num_cached_tokens = request.num_cached_tokens
        num_logprobs = request.sampling_params.logprobs
        if num_logprobs is not None and runner_output.logprobs is not None:
            output.new_logprobs = _columns(runner_output.logprobs, num_logprobs,
                                           slice(logprob_row, logprob_row + len(taken)))
        if request.sampling_params.return_routed_experts and runner_output.routed_experts is not None:
            output.routed_experts = runner_output.routed_experts[logprob_row:logprob_row + len(taken)]
        if stopped:
            self._free(request)
            output.finish_reason, output.stop_reason = FINISH_REASONS[request.status], request.stop_reason
        return output

    def _pooled(self, sched: ScheduledRequest, request: Request, pooler_output: list | None,
                i: int) -> EngineCoreOutput | None:
        """A pooling request's news from a step: at its prompt's end, its vector, and it finishes (even if
        preempted since: the step computed its whole prompt)."""
        if request.is_finished or sched.num_computed_tokens + sched.num_new_tokens < request.num_prompt_tokens:
            return None
        if pooler_output is None or pooler_output[i] is None:
            raise RuntimeError("the runner pooled nothing for a prompt that ended")
        request.status = RequestStatus.FINISHED_STOPPED
        self._free(request)
        return EngineCoreOutput(request.request_id, [], FINISH_REASONS[request.status], pooling_output=pooler_output[i],
                                first_scheduled_time=request.first_scheduled_time,
                                num_cached_tokens=request.num_cached_tokens)

    def in_flight_requests(self) -> list[Request]:
        """Every request of a step not yet applied."""
        return [r for requests in self._in_flight.values() for r in requests]

    def drop_in_flight(self) -> None:
        """Forget the steps not yet applied (they failed): their placeholders will never land."""
        for request in self.in_flight_requests():
            request.num_output_placeholders = 0
        self._in_flight.clear()

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string, error): free their blocks."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            request.status = status
            self._free(request)

    def make_stats(self) -> SchedulerStats:
        (queries, hits), (last_queries, last_hits) = self.prefix_cache_totals, self._totals_at_last_stats
        self._totals_at_last_stats = (queries, hits)
        spec_stats = self.spec_stats
        if spec_stats is not None:
            self.spec_stats = SpecDecodingStats.empty(self.num_speculative_tokens)
        expert_tokens, self.expert_tokens = self.expert_tokens, None
        stats = SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.num_preemptions,
                               queries - last_queries, hits - last_hits,
                               spec_stats if spec_stats is not None and spec_stats.num_drafts else None, expert_tokens)
        if self.max_loras:
            stats.running_lora_adapters = _adapter_names(self.running)
            stats.waiting_lora_adapters = _adapter_names(self.waiting)
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (vLLM's reset_prefix_cache): False while a request holds blocks."""
        return self.kv.reset_prefix_cache()

    def _free(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:  # preempted, or never scheduled
            self.waiting.remove(request)
        self.kv.free(request)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)


def _adapter_names(requests) -> list[str]:
    """The distinct LoRA adapters of `requests`, by name, sorted."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})


def _columns(arrays: LogprobsArrays, num_logprobs: int, rows: slice = slice(None)) -> LogprobsArrays:
    """The first 1 + num_logprobs columns (the token's own, then the top ones), of `rows`."""
    return LogprobsArrays(arrays.logprobs[rows, :num_logprobs + 1], arrays.token_ids[rows, :num_logprobs + 1],
                          arrays.ranks[rows])
