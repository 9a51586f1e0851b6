"""What a user gets back: vLLM's RequestOutput / CompletionOutput."""
import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """When things happened to a request, in time.monotonic() seconds (one clock for the
    front end and the engine core: they share a machine)."""
    arrival_time: float
    first_token_time: float | None = None  # when the engine core applied the first output token
    last_token_time: float | None = None   # ... and the newest one


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when the engine failed the request
    prompt_logprobs: None = None
    metrics: RequestMetrics | None = None
