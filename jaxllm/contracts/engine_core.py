"""What crosses between the front end and the engine core: small msgspec structs,
encoded as msgpack (serial.py). No live Request leaves the core; the core
builds its own from an EngineCoreRequest."""
import enum
from typing import Any

import msgspec
import numpy as np

from jaxllm.lora.request import LoRARequest
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams


# Messages of the core process's protocol that are not msgpack structs: the first frame of its
# start-up answer, and what its output socket says when it dies.
READY, STARTUP_FAILED, ENGINE_CORE_DEAD = b"READY", b"STARTUP_FAILED", b"ENGINE_CORE_DEAD"
DP_RANK_ENV = "JAXLLM_DATA_PARALLEL_RANK"  # a data-parallel replica's index, in its core process's environment


class EngineCoreRequestType(enum.Enum):
    """The first frame of each message on the core's input socket."""
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    seed: int            # the request's sampling seed (the front end derives one if the user gave none)
    arrival_time: float  # time.monotonic() in the front end
    # SamplingParams.bad_words as token ids (the front end tokenizes them): never generated
    bad_words_token_ids: list[list[int]] = []
    # A pooling request's (its sampling_params are then pooling_params.POOLING_SAMPLING_PARAMS): it ends
    # at its prompt's end with the prompt's pooled hidden state, and samples nothing
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs on (an engine with enable_lora)


class LogprobsArrays(msgspec.Struct, array_like=True, gc=False):
    """Sample logprobs of a request's new tokens, one row each (vLLM's LogprobsLists, as
    arrays: they cross the process boundary as raw bytes)."""
    logprobs: np.ndarray   # [num_new_tokens, 1 + logprobs] float32: the sampled token's, then the top ones
    token_ids: np.ndarray  # [num_new_tokens, 1 + logprobs] int32
    ranks: np.ndarray      # [num_new_tokens] int32: the sampled token's rank (1 = most likely)

    def head(self, n: int) -> "LogprobsArrays":
        """The first n rows."""
        return LogprobsArrays(self.logprobs[:n], self.token_ids[:n], self.ranks[:n])


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's news from one step."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id that ended it
    error: str | None = None
    new_logprobs: LogprobsArrays | None = None  # only for a request that asked (SamplingParams.logprobs)
    # SamplingParams.prompt_logprobs: rows for prompt positions 1, 2, ... in order (a long prompt's
    # come in several steps' outputs, one per prefill chunk); column 0 is the prompt token's own.
    new_prompt_logprobs: LogprobsArrays | None = None
    # The first output of a request says when the scheduler first scheduled it (time.monotonic())
    # and how many of its prompt tokens the prefix cache held then.
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    # A pooling request's vector [dimensions or hidden_size] float32, with finish_reason "stop"
    pooling_output: np.ndarray | None = None
    # SamplingParams.return_routed_experts: the new tokens' expert ids [len(new_token_ids), moe_layers, k] int32
    routed_experts: np.ndarray | None = None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Speculative decoding since the last stats (vLLM's): requests' steps with drafts, their
    draft tokens, the drafts accepted, and how often the draft at each position was."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    @classmethod
    def empty(cls, num_speculative_tokens: int) -> "SpecDecodingStats":
        return cls(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's drafts of one step, of which the first num_accepted were taken."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # share of the KV cache's blocks in use
    num_preemptions: int = 0     # since start-up
    # The prefix cache since the last stats: prompt tokens looked up at admission, and those it held.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decoding: SpecDecodingStats | None = None  # None: no drafts since the last stats
    # A MoE model's tokens routed to each expert of each MoE layer since the last stats [moe_layers, num_experts]
    expert_tokens: np.ndarray | None = None
    # With LoRA (vLLM's lora_requests_info): the adapters of the running and of the waiting requests, by name
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    result: Any = None
    failure: str | None = None  # the exception the call raised, as "Type: message"


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the core sends after a step (or a utility call)."""
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0  # time.monotonic() in the core when the step's tokens were applied
    scheduler_stats: SchedulerStats | None = None
    utility_output: UtilityOutput | None = None
    engine_index: int = 0  # the data-parallel replica that sent it (dp_client.py)
