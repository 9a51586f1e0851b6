"""The engine core's view of one request: tokens, progress, and KV blocks."""
import enum

import numpy as np

from jaxllm.engine import EngineCoreRequest
from jaxllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...], seed: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_tokens = len(self.prompt_token_ids)  # prompt + output; kept, not derived: the step loop reads it often
        self.sampling_params = sampling_params
        self.eos_token_ids = () if sampling_params.ignore_eos else tuple(eos_token_ids)
        self.seed = seed  # sampling key of this request; its samples do not depend on the batch
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens sampled by a step still on the device: their KV slots are scheduled, their ids not yet known.
        self.num_output_placeholders = 0
        self.stop_reason: int | str | None = None
        self.max_tokens = sampling_params.max_tokens
        self.sampling_row = _sampling_row(sampling_params, seed)

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> "Request":
        return cls(request.request_id, request.prompt_token_ids, request.sampling_params,
                   request.eos_token_ids, request.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole history."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_tokens += 1

    def check_stop(self, max_model_len: int) -> bool:
        """Set a finished status if the last token ends the request (EOS, a stop
        token id, max_tokens, or the model length). Stop strings are checked by
        the OutputProcessor, which aborts the request through the engine."""
        n_out = self.num_output_tokens
        last = self.output_token_ids[-1]
        # Length first, as vLLM: an EOS that is also the last allowed token finishes with "length".
        if (self.max_tokens is not None and n_out >= self.max_tokens) or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in self.sampling_params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
            return True
        return False


def _sampling_row(params: SamplingParams, seed: int) -> tuple[int, ...]:
    """The request's row of the runner's sampling inputs, as int32 words (floats as their
    bits): temperature, top_k, top_p, min_p, seed high, seed low. Made once per request."""
    floats = np.array([params.temperature, params.top_p, params.min_p], np.float32).view(np.int32).tolist()
    top_k = min(params.top_k, np.iinfo(np.int32).max)
    seed_words = np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32).view(np.int32).tolist()
    return (floats[0], top_k, floats[1], floats[2], *seed_words)
