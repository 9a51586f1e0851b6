"""OutputProcessor: incremental detokenization, stop strings, RequestOutputs (and pooling requests'
PoolingRequestOutputs)."""
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
from tokenizers.decoders import DecodeStream

from jaxllm.contracts.engine_core import EngineCoreOutput, LogprobsArrays
from jaxllm.engine.parallel_sampling import ParentRequest
from jaxllm.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, PromptLogprobs,
                            RequestMetrics, RequestOutput, SampleLogprobs)
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
_PROMPT_CONTEXT_TOKENS = 6  # enough prompt context for the first output token's spacing

DecodeEach = Callable[[list[int]], list[str | None]]


def logprob_dicts(rows: LogprobsArrays, num_top: int, decode_each: DecodeEach) -> list[dict[int, Logprob]]:
    """One {token id: Logprob} per row, vLLM's: column 0's token (sampled, or the prompt's own) with
    its rank, then the top `num_top` with ranks 1, 2, ... (column 0's token among them keeps its top rank)."""
    ranks = range(1, num_top + 1)
    return [{token_id: Logprob(logprob, r, text) for token_id, logprob, r, text
             in zip(token_ids, logprobs, (rank, *ranks), decode_each(token_ids))}
            for logprobs, token_ids, rank in zip(rows.logprobs.tolist(), rows.token_ids.tolist(), rows.ranks.tolist())]


class PromptLogprobsBuilder:
    """A request's prompt logprobs (vLLM's PromptLogprobs), from the core's rows for prompt
    positions 1, 2, ..., in order over one or more outputs (one per prefill chunk). They go out
    once all have come: in every output after, or with DELTA in the first one only."""

    def __init__(self, num_prompt_tokens: int, num_top: int, decode_each: DecodeEach):
        self.num_prompt_tokens, self.num_top, self.decode_each = num_prompt_tokens, num_top, decode_each
        self.logprobs: PromptLogprobs = [None]  # the first prompt token has nothing before it
        self._sent = False

    @property
    def complete(self) -> bool:
        return len(self.logprobs) == self.num_prompt_tokens

    def append(self, rows: LogprobsArrays) -> None:
        self.logprobs.extend(logprob_dicts(rows, self.num_top, self.decode_each))
        if len(self.logprobs) > self.num_prompt_tokens:
            raise RuntimeError(f"the engine core sent logprobs for {len(self.logprobs)} prompt positions "
                               f"of a {self.num_prompt_tokens}-token prompt")

    def for_output(self, delta: bool) -> PromptLogprobs | None:
        if not self.complete or (delta and self._sent):
            return None
        self._sent = True
        return self.logprobs if delta else list(self.logprobs)


class RequestState:
    """One request the core runs: a request of its own, or child `index` of a parent (n > 1)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, arrival_time: float,
                 parent: ParentRequest | None = None, index: int = 0,
                 prompt_logprobs: PromptLogprobsBuilder | None = None, added_tokens: dict[int, str] | None = None):
        """`prompt_logprobs`: shared by a parent's children (child 0 fills it), else this request's own.
        `added_tokens`: the tokenizer's added tokens, {id: content}."""
        self.request_id = request_id
        self.parent, self.index = parent, index
        self.metrics = RequestMetrics(arrival_time) if parent is None else parent.metrics
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.num_cached_tokens = 0
        self.token_ids: list[int] = []
        self.text = ""
        # One dict per output token, and their sum: when the request asked for logprobs (vLLM's None otherwise).
        self.logprobs: SampleLogprobs | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        # The output tokens' expert ids, as they came ([n, moe_layers, k] each): when the request asked.
        self.routed_experts: list[np.ndarray] | None = [] if params.return_routed_experts else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self._sent_tokens = self._sent_text = 0  # what DELTA outputs already carried
        # A tokenizers.Tokenizer; None without a tokenizer or with detokenize=False (token ids only, no text).
        self._backend = tokenizer.backend_tokenizer if tokenizer is not None and params.detokenize else None
        self._stream = None
        if self._backend is not None:
            self._stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:],
                                        skip_special_tokens=params.skip_special_tokens)
        # spaces_between_special_tokens=False, as vLLM does it for fast tokenizers: an added token
        # right after another is its bare content, without the space a decoder (WordPiece's, say) puts
        # before it. It matters only when special tokens are in the text.
        self._added_tokens = None
        if not params.spaces_between_special_tokens and not params.skip_special_tokens and added_tokens:
            self._added_tokens = added_tokens
        self._last_added = False
        if prompt_logprobs is None and params.prompt_logprobs is not None:
            prompt_logprobs = PromptLogprobsBuilder(len(prompt_token_ids), params.prompt_logprobs, self._decode_each)
        self.prompt_logprobs = prompt_logprobs

    def append(self, token_ids: list[int], stop_terminated: bool) -> bool:
        """Add new tokens; True if a stop string ended the request. A token that
        stopped the request (EOS, a stop token id) stays out of the text, as in vLLM,
        unless include_stop_str_in_output. Several new tokens (speculative decoding)
        are checked one by one: those after the one that completed a stop string are
        dropped, as if they had come alone."""
        if self._stream is None:
            self.token_ids.extend(token_ids)
            return False
        hidden = stop_terminated and not self.params.include_stop_str_in_output
        checked = bool(self.params.stop)
        for i, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            last = i == len(token_ids) - 1
            if last and hidden:
                break
            start = len(self.text)
            self.text += self._decode_next(token_id)
            if checked and not (last and stop_terminated) and self._check_stop_strings(start):
                return True
        return False

    def _decode_next(self, token_id: int) -> str:
        piece = self._stream.step(self._backend, token_id) or ""
        if self._added_tokens is not None:
            content = self._added_tokens.get(token_id)
            if content is not None and self._last_added:
                piece = content
            self._last_added = content is not None
        return piece

    def append_logprobs(self, new: LogprobsArrays) -> None:
        """Add the new tokens' logprobs (logprob_dicts) and their sampled tokens' to the sum."""
        self.logprobs.extend(logprob_dicts(new, self.params.logprobs, self._decode_each))
        for logprob in new.logprobs[:, 0].tolist():
            self.cumulative_logprob += logprob

    def _decode_each(self, token_ids: list[int]) -> list[str | None]:
        """Each token decoded alone (vLLM's convert_ids_list_to_tokens), one tokenizer call for all."""
        if self._backend is None:
            return [None] * len(token_ids)
        return self._backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False)

    def _check_stop_strings(self, new_text_start: int) -> bool:
        longest = max(len(s) for s in self.params.stop)
        search_from = max(0, new_text_start - longest + 1)
        for stop in self.params.stop:
            at = self.text.find(stop, search_from)
            if at >= 0:
                end = at + len(stop) if self.params.include_stop_str_in_output else at
                self.text = self.text[:end]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        return False

    def aborted(self) -> RequestOutput | None:
        """Its last output, with finish_reason "abort" (None when the output kind has nothing to say)."""
        self.finish_reason = "abort"
        return self.output()

    def output(self) -> RequestOutput | None:
        """This step's RequestOutput, or None when the output kind has nothing to say."""
        finished = self.finish_reason is not None
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text, token_ids = self.text, self.token_ids
        if not finished and self.params.stop and not self.params.include_stop_str_in_output:
            # Hold back what could be the start of a stop string until it is known not to be.
            text = text[:max(len(text) - max(len(s) for s in self.params.stop) + 1, self._sent_text)]
        routed = None if self.routed_experts is None else _stacked(self.routed_experts)
        if kind == RequestOutputKind.DELTA:
            self._sent_text, text = len(text), text[self._sent_text:]
            logprobs = None if self.logprobs is None else self.logprobs[self._sent_tokens:]
            routed = None if routed is None else routed[self._sent_tokens:]
            self._sent_tokens, token_ids = len(token_ids), token_ids[self._sent_tokens:]
        else:
            logprobs = None if self.logprobs is None else list(self.logprobs)
        completion = CompletionOutput(self.index, text, list(token_ids), self.cumulative_logprob, logprobs,
                                      finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                      routed_experts=routed)
        request_id, outputs, error = self.request_id, [completion], self.error
        if self.parent is not None:  # the output is the parent's
            outputs = self.parent.add_output(completion, self.error)
            if not outputs:
                return None
            request_id, finished, error = self.parent.request_id, self.parent.finished, self.parent.error
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs.for_output(delta=kind == RequestOutputKind.DELTA)
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.monotonic()
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, outputs, finished=finished,
                             error=error, prompt_logprobs=prompt_logprobs, metrics=dataclasses.replace(self.metrics),
                             num_cached_tokens=self.num_cached_tokens)


class PoolingRequestState:
    """A pooling request: its one output comes with its vector, or when it ends without one."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids

    def finished(self, co: EngineCoreOutput) -> PoolingRequestOutput:
        if co.pooling_output is not None:
            return PoolingRequestOutput(self.request_id, PoolingOutput(co.pooling_output), self.prompt_token_ids)
        error = co.error or f"the request ended with finish_reason {co.finish_reason!r} and no vector"
        return PoolingRequestOutput(self.request_id, None, self.prompt_token_ids, error=error)

    def aborted(self) -> PoolingRequestOutput:
        return PoolingRequestOutput(self.request_id, None, self.prompt_token_ids, error="the request was aborted")


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState | PoolingRequestState] = {}  # by the core's ids (a parent's children)
        self.parents: dict[str, ParentRequest] = {}
        self._added_tokens: dict[int, str] = {}  # for spaces_between_special_tokens
        if tokenizer is not None:
            self._added_tokens = {token_id: token.content for token_id, token
                                  in tokenizer.backend_tokenizer.get_added_tokens_decoder().items()}

    def in_use(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.parents

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float,
                    parent: ParentRequest | None = None, index: int = 0) -> None:
        """Track one request the core runs; a parent's children are added one by one, in index order."""
        prompt_logprobs = None
        if parent is not None:
            self.parents[parent.request_id] = parent
            if index > 0:  # the children share the prompt, and child 0's prompt logprobs
                prompt_logprobs = self.states[parent.child_ids[0]].prompt_logprobs
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer,
                                               arrival_time, parent, index, prompt_logprobs, self._added_tokens)

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.states[request_id] = PoolingRequestState(request_id, prompt_token_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(self, core_outputs: list[EngineCoreOutput],
                        timestamp: float) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """RequestOutputs of the updated requests (PoolingRequestOutputs of the finished pooling ones),
        and the ids a stop string finished (the engine core must abort those). `timestamp`: when the core
        made these."""
        outputs, stopped = [], []
        for co in core_outputs:
            state = self.states.get(co.request_id)
            if state is None:
                continue  # aborted here, or ended by a stop string, while the core ran on
            if isinstance(state, PoolingRequestState):
                if co.finish_reason is not None:
                    outputs.append(state.finished(co))
                    del self.states[co.request_id]
                continue
            try:
                out, stop = self._process(state, co, timestamp)
            except Exception as e:  # this request's text or logprobs: it alone ends, with the error
                logger.exception("request %s: processing its output failed", co.request_id)
                state.finish_reason, state.stop_reason = "error", None
                state.error = f"{type(e).__name__}: {e}"
                out, stop = state.output(), co.finish_reason is None
            if stop:
                stopped.append(co.request_id)
            if out is not None:
                outputs.append(out)
            if state.finish_reason is not None:
                del self.states[co.request_id]
                if state.parent is not None and state.parent.finished:
                    del self.parents[state.parent.request_id]
        return outputs, stopped

    @staticmethod
    def _process(state: RequestState, co: EngineCoreOutput, timestamp: float) -> tuple[RequestOutput | None, bool]:
        """One request's news: (its RequestOutput or None, whether a stop string ended it)."""
        metrics = state.metrics
        if co.first_scheduled_time is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = co.first_scheduled_time
            metrics.time_in_queue = co.first_scheduled_time - metrics.arrival_time
        if co.num_cached_tokens:
            state.num_cached_tokens = co.num_cached_tokens
        if co.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = timestamp
            metrics.last_token_time = timestamp
        prompt_done = False
        if co.new_prompt_logprobs is not None and state.index == 0 and state.prompt_logprobs is not None:
            state.prompt_logprobs.append(co.new_prompt_logprobs)
            prompt_done = state.prompt_logprobs.complete
        if not co.new_token_ids and co.finish_reason is None and not prompt_done:
            return None, False  # a prefill chunk's prompt logprobs: nothing to tell until the prompt is done
        num_tokens = len(state.token_ids)
        stopped = bool(co.new_token_ids) and state.append(co.new_token_ids, stop_terminated=co.finish_reason == "stop")
        if co.new_logprobs is not None:  # of the tokens kept
            state.append_logprobs(co.new_logprobs.head(len(state.token_ids) - num_tokens))
        if co.routed_experts is not None and state.routed_experts is not None:
            state.routed_experts.append(co.routed_experts[:len(state.token_ids) - num_tokens])
        if not stopped and co.finish_reason is not None:
            state.finish_reason, state.stop_reason, state.error = co.finish_reason, co.stop_reason, co.error
        return state.output(), stopped

    def abort(self, request_ids: list[str], outputs: list | None = None) -> list[str]:
        """Forget the requests; returns the ids the core must abort (a parent's: its children's).
        With `outputs`, each unfinished request's last RequestOutput (finish_reason "abort") goes there."""
        core_ids = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            last = None
            for core_id in parent.child_ids if parent is not None else [request_id]:
                state = self.states.pop(core_id, None)
                core_ids.append(core_id)
                if state is not None and outputs is not None:
                    last = state.aborted() or last  # a parent's FINAL_ONLY output comes with its last child
            if last is not None:
                outputs.append(last)
        return core_ids


def _stacked(parts: list[np.ndarray]) -> np.ndarray | None:
    """The parts' rows in one array, kept so (None before any token)."""
    if len(parts) > 1:
        parts[:] = [np.concatenate(parts)]
    return parts[0] if parts else None
