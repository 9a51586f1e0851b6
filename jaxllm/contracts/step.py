"""What the scheduler tells the model runner each step, and what the runner answers.

The runner sees a request's fixed data once (NewRequestData: when it is admitted, or
admitted again after preemption), then only each step's diff (ScheduledRequest: tokens
scheduled, the ids the core knows of them, blocks added) and the ids of requests that
finished or were preempted, whose rows it frees. It keeps its own per-request rows
(worker/input_batch.py). Token masks that depend on the tokens just generated
(structured outputs, multi-token bad words) are the core's: it makes them once the step
before has been applied and hands them over as TokenMasks (EngineCore.step).
"""
import msgspec
import numpy as np

from jaxllm.contracts.engine_core import LogprobsArrays
from jaxllm.lora.request import LoRARequest
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the request's sampling key: its samples depend on it and their position only
    # EOS (unless ignore_eos) and the params' stop ids: what min_tokens holds back
    stop_token_ids: list[int]
    output_token_ids: list[int] = []  # a request resumed after preemption has some
    banned_token_ids: list[int] = []  # one-token bad words: never sampled
    host_masked: bool = False  # its steps sample under TokenMasks from the core
    # A pooling request's: its steps sample nothing, and the one that reaches its prompt's end pools it
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # its LoRA adapter (jaxllm/lora); None: the base model


# A draft that the step in flight makes on the device: the next step reads it there. Not -1, which
# a row of sampling words holds for "no draft" (sample/sampler.py): the runner packs drafts as they are.
DRAFT_ON_DEVICE = -2
# In a drafter's table (ModelRunnerOutput.draft_token_ids): no draft here nor after (n-gram lookup found no copy).
NO_DRAFT = -1


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's part of one step."""
    req_id: str
    # Before this step; with drafts in the step in flight, as if the model took every one (the
    # runner moves the step back over those it rejected, on the device).
    num_computed_tokens: int
    num_new_tokens: int
    # The ids of positions num_computed_tokens .. + len(token_ids) - 1, as far as the core knows
    # them: a last token that the step in flight is still sampling is read on the device.
    token_ids: list[int]
    # Per KV cache group, the block ids added to the request's table this step (0: a position the
    # group holds no block for); all of them when the request is admitted (its table starts empty).
    new_block_ids: list[list[int]]
    samples: bool  # the step reaches the request's last token, so it samples the next one
    # A prefill chunk that does not sample: the id of the token after it (an EAGLE head reads it), else -1.
    next_token_id: int = -1
    # SamplingParams.prompt_logprobs: the prompt positions [start, end) whose logprobs this step computes
    prompt_logprobs: tuple[int, int] | None = None
    # Speculative decoding: the guesses of the tokens after the request's next one, the last
    # len(draft_token_ids) of num_new_tokens (their ids are not in token_ids). DRAFT_ON_DEVICE for
    # each when the drafter is still making them in the step in flight (asynchronous scheduling).
    draft_token_ids: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    scheduled: list[ScheduledRequest]  # in the step's batch order
    num_scheduled_tokens: int
    new_requests: list[NewRequestData] = []  # of scheduled requests the runner holds no row for
    finished_req_ids: list[str] = []  # ended since the last step: the runner frees their rows
    preempted_req_ids: list[str] = []  # ... and these, until they come back as new requests
    num_preempted: int = 0  # preemptions this step made
    step_id: int = 0  # the scheduler's count of its steps (it finds a step's requests by it)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class TokenMasks(msgspec.Struct, array_like=True, gc=False):
    """The token masks the core made for a step's host-masked requests that sample: row i is
    req_ids[i]'s, bit t % 32 of word t // 32 set where token t is allowed."""
    req_ids: list[str]
    bitmask: np.ndarray  # [len(req_ids), ceil(vocab_size / 32)] int32


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A step's results, item i for SchedulerOutput.scheduled[i]."""
    # The tokens each request took: none for a prefill chunk short of the prompt's end, else the one
    # it sampled, or with drafts the ones the model agreed with and the token it sampled after them.
    sampled_token_ids: list[list[int]]
    # When a request asked (SamplingParams.logprobs): a row per token taken, the requests' in order.
    logprobs: LogprobsArrays | None = None
    # Per scheduled request, its prompt positions' logprobs this step (or None); None if no request asked.
    prompt_logprobs: list[LogprobsArrays | None] | None = None
    failed: dict[str, str] = {}  # request id -> why its host work in the runner failed: it ends alone
    # A draft model's or EAGLE head's guesses of the tokens after each request's last one (none for a
    # request that took no token), for its next step; None without one.
    draft_token_ids: list[list[int]] | None = None
    # Per scheduled request, a pooling request's vector if this step reached its prompt's end (else
    # None); None if no step of a pooling request pooled.
    pooler_output: list[np.ndarray | None] | None = None
    # A MoE model's, when a request asked (SamplingParams.return_routed_experts): a row per token taken, the
    # requests' in order (as logprobs), each the expert ids [moe_layers, k] int32 of the forward that sampled it.
    routed_experts: np.ndarray | None = None
    # A MoE model's: the step's tokens routed to each expert of each MoE layer [moe_layers, num_experts] int32.
    expert_counts: np.ndarray | None = None
