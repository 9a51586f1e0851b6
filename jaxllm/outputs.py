"""What a user gets back: vLLM's RequestOutput / CompletionOutput, and for pooling requests its
PoolingRequestOutput, EmbeddingRequestOutput and ScoringRequestOutput."""
import dataclasses

import numpy as np


@dataclasses.dataclass
class Logprob:
    """One token's log probability at one position (vLLM's Logprob)."""
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None  # the token alone, decoded (None without a tokenizer)


# Per generated token: {token id: Logprob} for the sampled token and the top `logprobs` tokens
# (vLLM's SampleLogprobs; `logprobs` or `logprobs` + 1 entries, as the sampled one may be in the top).
SampleLogprobs = list[dict[int, Logprob]]

# Per prompt token: None for the first (nothing precedes it), then {token id: Logprob} for the
# prompt token and the top `prompt_logprobs` tokens at that position (vLLM's PromptLogprobs).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # the sampled tokens' logprobs summed; None unless logprobs were asked
    logprobs: SampleLogprobs | None = None   # one dict per token of token_ids, if SamplingParams.logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # SamplingParams.return_routed_experts: per token of token_ids, the experts each MoE layer's router chose
    # in the forward that sampled it, [len(token_ids), num_moe_layers, top_k] int32 (layers in model order)
    routed_experts: np.ndarray | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """When things happened to a request, in time.monotonic() seconds (one clock for the
    front end and the engine core: they share a machine)."""
    arrival_time: float
    first_scheduled_time: float | None = None  # when the engine core's scheduler first scheduled it
    time_in_queue: float | None = None         # first_scheduled_time - arrival_time, in seconds
    first_token_time: float | None = None  # when the engine core applied the first output token
    last_token_time: float | None = None   # ... and the newest one
    finished_time: float | None = None     # when the front end saw it finish


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when the engine failed the request
    prompt_logprobs: PromptLogprobs | None = None  # if SamplingParams.prompt_logprobs, once the prompt is done
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Merge a later output of this request into this one (vLLM's RequestOutput.add): each
        of its samples replaces the one with the same index, or with `aggregate` (DELTA
        outputs) extends it."""
        self.finished, self.error, self.metrics = next_output.finished, next_output.error, next_output.metrics
        positions = {o.index: i for i, o in enumerate(self.outputs)}
        for new in next_output.outputs:
            i = positions.get(new.index)
            if i is None:
                positions[new.index] = len(self.outputs)
                self.outputs.append(new)
            elif aggregate:
                old = self.outputs[i]
                old.text += new.text
                old.token_ids.extend(new.token_ids)
                if old.logprobs is not None:
                    old.logprobs.extend(new.logprobs)
                old.cumulative_logprob = new.cumulative_logprob
                old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
            else:
                self.outputs[i] = new


@dataclasses.dataclass
class PoolingOutput:
    data: np.ndarray  # [dimensions or hidden_size] float32: the prompt's pooled hidden state


@dataclasses.dataclass
class PoolingRequestOutput:
    """A pooling request's one output (vLLM's), when its prompt has run."""
    request_id: str
    outputs: PoolingOutput | None  # None when the engine failed or aborted the request: `error` says why
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """What LLM.embed gives per prompt (vLLM's): outputs.embedding."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """What LLM.score gives per pair (vLLM's): outputs.score; the request id and prompt token ids are the
    pair's, joined (with the tokenizer's pad token between, if it has one)."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
