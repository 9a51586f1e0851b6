"""Scheduler: which requests run this step, and with how many new tokens.

vLLM v1's policy: running requests first (decodes and unfinished prefill chunks),
then waiting ones in arrival order, all under one token budget
(`max_num_batched_tokens`) and `max_num_seqs`. A request's new tokens are simply
`num_tokens - num_computed_tokens`, so prefill chunks, decodes and recomputation
after preemption are one case. When blocks run out, the newest running request
is preempted (its blocks freed, its progress reset) back to the head of waiting.
A request admitted from waiting starts after the longest prefix the KV cache holds
(prefix caching: KVCacheManager.get_computed_blocks), a resumed one included.

Asynchronous scheduling: step N+1 is scheduled while step N runs, so a token that
step N samples is not known yet. It counts as a placeholder
(`num_output_placeholders`): its KV slot can be scheduled (the runner feeds it
from step N's sampled ids on the device) and it is appended when step N's
output lands. A request whose in-flight token will end it by length is not
scheduled again, so the only waste is one step of a request that an EOS, a stop
token or a stop string ends.
"""
import collections
import dataclasses
import logging
import time

from jaxllm.config import SchedulerConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.engine import EngineCoreOutput, LogprobsArrays, SchedulerStats
from jaxllm.request import FINISH_REASONS, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    # Per KV cache group, the block ids added to the request's table this step (0: a position the
    # group holds no block for); all of them when the request is admitted (its table starts empty).
    new_block_ids: list[list[int]]
    samples: bool  # the step reaches the request's last token, so it samples the next one
    # SamplingParams.prompt_logprobs: the prompt positions [start, end) whose logprobs this step computes
    prompt_logprobs: tuple[int, int] | None = None


@dataclasses.dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest]
    num_scheduled_tokens: int
    num_preempted: int
    finished_req_ids: list[str]  # ended since the last step: the runner drops their state
    preempted_req_ids: list[str] = dataclasses.field(default_factory=list)  # ... and of these too, until they resume

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_totals = [0, 0]  # tokens since start-up: looked up, found
        self._totals_at_last_stats = (0, 0)  # SchedulerStats carry the increments since
        self._finished_req_ids: list[str] = []
        self._preempted_req_ids: list[str] = []

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledRequest] = []
        preempted = 0

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_output_placeholders and self._awaits_last_token(request):
                i += 1
                continue
            num_new = min(self._num_pending_tokens(request), budget)
            while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            else:
                out.append(self._schedule(request, num_new, new_blocks))
                budget -= num_new
                i += 1

        # Admit waiting requests only in a step that preempted nothing: blocks are short.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(self._num_pending_tokens(request) - num_cached, budget)
            new_blocks = self.kv.allocate_slots(request, num_new, num_cached, computed_blocks)
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
            out.append(self._schedule(request, num_new, new_blocks))
            budget -= num_new

        self.num_preemptions += preempted
        finished, preempted_ids = [], []
        if out:  # an empty output never reaches the runner: keep the ids for the next one
            finished, self._finished_req_ids = self._finished_req_ids, []
            preempted_ids, self._preempted_req_ids = self._preempted_req_ids, []
        return SchedulerOutput(out, self.config.max_num_batched_tokens - budget, preempted, finished, preempted_ids)

    @staticmethod
    def _schedule(request: Request, num_new: int, new_blocks: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        samples = num_new == request.num_tokens + request.num_output_placeholders - start
        scheduled = ScheduledRequest(request, start, num_new, new_blocks, samples)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        if request.sampling_params.prompt_logprobs is not None:
            # Position p's logprobs come from token p - 1's logits; a recomputed prompt sends none twice.
            lo, hi = max(start + 1, request.next_prompt_logprob), min(start + num_new + 1, request.num_prompt_tokens)
            if lo < hi:
                scheduled.prompt_logprobs = (lo, hi)
                request.next_prompt_logprob = hi
        request.num_computed_tokens += num_new
        request.num_output_placeholders += samples
        return scheduled

    @staticmethod
    def _num_pending_tokens(request: Request) -> int:
        """Tokens whose KV is still to compute, an in-flight one included."""
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    def _awaits_last_token(self, request: Request) -> bool:
        """True when a token still on the device will end the request by length."""
        n = request.num_output_placeholders
        out_of_tokens = request.max_tokens is not None and len(request.output_token_ids) + n >= request.max_tokens
        return out_of_tokens or request.num_tokens + n >= self.config.max_model_len

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self._preempted_req_ids.append(request.request_id)

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled_token_ids: list[int],
                           logprobs: LogprobsArrays | None = None,
                           prompt_logprobs: list[LogprobsArrays | None] | None = None,
                           failed: dict[str, str] | None = None) -> list[EngineCoreOutput]:
        """Append the token each sampling request drew and finish the ones that stop.
        Requests that ended while the step ran (abort, stop, error) drop theirs.
        `logprobs`: the step's, row i for scheduled request i; `prompt_logprobs`: for
        scheduled request i, its prompt positions' (or None). A request gets them cut
        to its own number of top logprobs. `failed`: {request id: error} of the requests
        whose host work failed in the step; they end with the error, as does one whose
        update here raises, and the others go on."""
        outputs, failed = [], failed or {}
        for i, (sched, token_id) in enumerate(zip(scheduler_output.requests, sampled_token_ids)):
            request = sched.request
            if sched.samples:
                request.num_output_placeholders -= 1
            error = failed.get(request.request_id)
            if error is None:
                try:
                    output = self._update_request(sched, i, token_id, logprobs, prompt_logprobs)
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

    def _update_request(self, sched: ScheduledRequest, i: int, token_id: int, logprobs: LogprobsArrays | None,
                        prompt_logprobs: list[LogprobsArrays | None] | None) -> EngineCoreOutput | None:
        """Scheduled request i's news from the step (None: nothing to tell)."""
        request = sched.request
        new_prompt_logprobs = None
        if prompt_logprobs is not None and prompt_logprobs[i] is not None and not request.is_finished:
            new_prompt_logprobs = _columns(prompt_logprobs[i], request.sampling_params.prompt_logprobs)
        if not sched.samples:  # a prefill chunk short of the prompt's end
            if new_prompt_logprobs is not None:
                return EngineCoreOutput(request.request_id, [], new_prompt_logprobs=new_prompt_logprobs)
            return None
        if request.is_finished:
            return None
        request.append_token(token_id)
        output = EngineCoreOutput(request.request_id, [token_id], new_prompt_logprobs=new_prompt_logprobs)
        if request.num_output_tokens == 1:
            output.first_scheduled_time = request.first_scheduled_time
            output.num_cached_tokens = request.num_cached_tokens
        num_logprobs = request.sampling_params.logprobs
        if num_logprobs is not None and logprobs is not None:
            output.new_logprobs = _columns(logprobs, num_logprobs, row=i)
        if request.check_stop(self.config.max_model_len):
            self._free(request)
            output.finish_reason, output.stop_reason = FINISH_REASONS[request.status], request.stop_reason
        return output

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
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.num_preemptions,
                              queries - last_queries, hits - last_hits)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (vLLM's reset_prefix_cache): False while a request holds blocks."""
        return self.kv.reset_prefix_cache()

    def _free(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:  # preempted, or never scheduled
            self.waiting.remove(request)
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)


def _columns(arrays: LogprobsArrays, num_logprobs: int, row: int | None = None) -> LogprobsArrays:
    """The first 1 + num_logprobs columns (the token's own, then the top ones), of one row or all."""
    rows = slice(None) if row is None else slice(row, row + 1)
    return LogprobsArrays(arrays.logprobs[rows, :num_logprobs + 1], arrays.token_ids[rows, :num_logprobs + 1],
                          arrays.ranks[rows])
