"""OutputProcessor: incremental detokenization, stop strings, RequestOutputs."""
from tokenizers.decoders import DecodeStream

from jaxllm.engine import EngineCoreOutput, LogprobsArrays
from jaxllm.engine.parallel_sampling import ParentRequest
from jaxllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SampleLogprobs
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

_PROMPT_CONTEXT_TOKENS = 6  # enough prompt context for the first output token's spacing


class RequestState:
    """One request the core runs: a request of its own, or child `index` of a parent (n > 1)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, arrival_time: float,
                 parent: ParentRequest | None = None, index: int = 0):
        self.request_id = request_id
        self.parent, self.index = parent, index
        self.metrics = RequestMetrics(arrival_time) if parent is None else parent.metrics
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        # One dict per output token, and their sum: when the request asked for logprobs (vLLM's None otherwise).
        self.logprobs: SampleLogprobs | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self._sent_tokens = self._sent_text = 0  # what DELTA outputs already carried
        self._backend = tokenizer.backend_tokenizer if tokenizer is not None else None  # a tokenizers.Tokenizer
        self._stream = None
        if tokenizer is not None:
            self._stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:],
                                        skip_special_tokens=params.skip_special_tokens)

    def append(self, token_ids: list[int], stop_terminated: bool) -> bool:
        """Add new tokens; True if a stop string ended the request. A token that
        stopped the request (EOS, a stop token id) stays out of the text, as in vLLM,
        unless include_stop_str_in_output."""
        self.token_ids.extend(token_ids)
        if self._stream is None:
            return False
        if stop_terminated and not self.params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        start = len(self.text)
        pieces = [self._stream.step(self._backend, t) for t in token_ids]
        self.text += "".join(p for p in pieces if p)
        return bool(self.params.stop) and not stop_terminated and self._check_stop_strings(start)

    def append_logprobs(self, new: LogprobsArrays) -> None:
        """Add the new tokens' logprobs as vLLM's dicts: the sampled token with its rank,
        then the top tokens with ranks 1, 2, ... (a sampled token among them keeps its top rank)."""
        ranks = range(1, self.params.logprobs + 1)
        for logprobs, token_ids, rank in zip(new.logprobs.tolist(), new.token_ids.tolist(), new.ranks.tolist()):
            self.cumulative_logprob += logprobs[0]
            decoded = self._decode_each(token_ids)
            self.logprobs.append({token_id: Logprob(logprob, r, text) for token_id, logprob, r, text
                                  in zip(token_ids, logprobs, (rank, *ranks), decoded)})

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
        if kind == RequestOutputKind.DELTA:
            self._sent_text, text = len(text), text[self._sent_text:]
            logprobs = None if self.logprobs is None else self.logprobs[self._sent_tokens:]
            self._sent_tokens, token_ids = len(token_ids), token_ids[self._sent_tokens:]
        else:
            logprobs = None if self.logprobs is None else list(self.logprobs)
        completion = CompletionOutput(self.index, text, list(token_ids), self.cumulative_logprob, logprobs,
                                      finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        request_id, outputs, error = self.request_id, [completion], self.error
        if self.parent is not None:  # the output is the parent's
            outputs = self.parent.add_output(completion, self.error)
            if not outputs:
                return None
            request_id, finished, error = self.parent.request_id, self.parent.finished, self.parent.error
        m = self.metrics
        metrics = RequestMetrics(m.arrival_time, m.first_token_time, m.last_token_time)
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished=finished, error=error, metrics=metrics)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # by the core's request ids (a parent's children)
        self.parents: dict[str, ParentRequest] = {}

    def in_use(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.parents

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float,
                    parent: ParentRequest | None = None, index: int = 0) -> None:
        """Track one request the core runs; a parent's children are added one by one."""
        if parent is not None:
            self.parents[parent.request_id] = parent
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer,
                                               arrival_time, parent, index)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(self, core_outputs: list[EngineCoreOutput],
                        timestamp: float) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs of the updated requests, and the ids a stop string finished
        (the engine core must abort those). `timestamp`: when the core made these."""
        outputs, stopped = [], []
        for co in core_outputs:
            state = self.states.get(co.request_id)
            if state is None:
                continue  # aborted here, or ended by a stop string, while the core ran on
            if co.new_token_ids:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = timestamp
                state.metrics.last_token_time = timestamp
            if co.new_logprobs is not None:
                state.append_logprobs(co.new_logprobs)
            if co.new_token_ids and state.append(co.new_token_ids, stop_terminated=co.finish_reason == "stop"):
                stopped.append(co.request_id)
            elif co.finish_reason is not None:
                state.finish_reason, state.stop_reason, state.error = co.finish_reason, co.stop_reason, co.error
            out = state.output()
            if out is not None:
                outputs.append(out)
            if state.finish_reason is not None:
                del self.states[co.request_id]
                if state.parent is not None and state.parent.finished:
                    del self.parents[state.parent.request_id]
        return outputs, stopped

    def abort(self, request_ids: list[str]) -> list[str]:
        """Forget the requests; returns the ids the core must abort (a parent's: its children's)."""
        core_ids = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            for core_id in parent.child_ids if parent is not None else [request_id]:
                self.states.pop(core_id, None)
                core_ids.append(core_id)
        return core_ids
