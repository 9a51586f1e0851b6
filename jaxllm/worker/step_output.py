"""What a dispatched step hands back: its sampled ids, logprobs and pooled hidden states, on the
device until the core asks for them as a ModelRunnerOutput."""
import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from jaxllm.contracts.engine_core import LogprobsArrays
from jaxllm.contracts.step import ModelRunnerOutput, ScheduledRequest
from jaxllm.worker.pooler import StepPooling


class Logprobs(NamedTuple):
    """A step's sample logprobs on the device (compute_logprobs), one per row of logits of its bucket."""
    logprobs: jax.Array   # [L, 1 + K] float32: the sampled token's, then the top K
    token_ids: jax.Array  # [L, 1 + K] int32
    ranks: jax.Array      # [L] int32: the sampled token's rank (1 = most likely)


_DEVICE_FIELDS = ("sampled", "logprobs", "prompt_logprobs", "drafter_table", "routed_experts", "expert_counts")


@dataclasses.dataclass
class StepOutput:
    """A dispatched step: its sampled ids (and logprobs, if a request asked) are on their way to the host."""
    sampled: jax.Array  # [num_sampled] int32, on the device: a sample per row of logits
    scheduled: list[ScheduledRequest]
    first_rows: np.ndarray | None = None  # with drafts, each request's first row (else row i is request i's)
    logprobs: Logprobs | None = None
    prompt_logprobs: list[Logprobs] = dataclasses.field(default_factory=list)  # chunks of [C] positions
    prompt_segments: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (request index, positions)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # request id -> why its host work failed
    # A draft model's or EAGLE head's table [rows, 2 + k] int32 (worker/draft_inputs.py): per request, the
    # token it took last, the drafts for after it, and how many of its drafts the model rejected.
    drafter_table: jax.Array | None = None
    pooling: StepPooling | None = None  # with pooling requests whose tokens pooled in the step
    # A MoE model's expert ids at each row of logits [L, moe_layers, k] (when a request asked), and its
    # step's tokens routed to each expert [moe_layers, num_experts]
    routed_experts: jax.Array | None = None
    expert_counts: jax.Array | None = None

    def device_fields(self) -> dict:
        """The fields get_output reads from the device, by name (each an array, a pytree of them, or None;
        the pooling's rows are its own outputs' to read)."""
        return {name: getattr(self, name) for name in _DEVICE_FIELDS}

    def device_arrays(self) -> list[jax.Array]:
        return jax.tree.leaves(self.device_fields())

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)

    def get_output(self) -> ModelRunnerOutput:
        """The step's results on the host; blocks until the step has finished."""
        samples = np.asarray(self.sampled)
        table = None if self.drafter_table is None else np.asarray(self.drafter_table)
        if self.first_rows is None:  # no drafts: row i is request i's
            ids = samples[:self.num_reqs].tolist()
            taken = [[t] if s.samples else [] for t, s in zip(ids, self.scheduled)]
        elif table is None:
            taken = [self._accepted(s, samples, int(first)) if s.samples else []
                     for s, first in zip(self.scheduled, self.first_rows)]
        else:  # the drafter's table counts them (the drafts may be ones only the device knows)
            taken = [samples[first:first + 1 + len(s.draft_token_ids) - rejected].tolist() if s.samples else []
                     for s, first, rejected in zip(self.scheduled, self.first_rows.tolist(), table[:, -1].tolist())]
        drafts = None
        if table is not None:
            drafts = [table[i, 1:-1].tolist() if s.samples else [] for i, s in enumerate(self.scheduled)]
        pooled = None if self.pooling is None else self.pooling.outputs(self.num_reqs)
        routed = None if self.routed_experts is None else np.asarray(self.routed_experts)[self._taken_rows(taken)]
        counts = None if self.expert_counts is None else np.asarray(self.expert_counts)
        return ModelRunnerOutput(taken, self._host_logprobs(taken), self._host_prompt_logprobs(), self.failed, drafts,
                                 pooled, routed, counts)

    @staticmethod
    def _accepted(s: ScheduledRequest, samples: np.ndarray, first: int) -> list[int]:
        """The request's samples from its first row on, while they agree with its (host) drafts, and the one after."""
        rows = samples[first:first + 1 + len(s.draft_token_ids)].tolist()
        n = 1
        while n < len(rows) and rows[n - 1] == s.draft_token_ids[n - 1]:
            n += 1
        return rows[:n]

    def _taken_rows(self, taken: list[list[int]]) -> list[int]:
        """The rows of logits of the tokens taken, in the requests' order."""
        first_rows = range(self.num_reqs) if self.first_rows is None else self.first_rows.tolist()
        return [row for first, tokens in zip(first_rows, taken) for row in range(first, first + len(tokens))]

    def _host_logprobs(self, taken: list[list[int]]) -> LogprobsArrays | None:
        """Those of the tokens taken, in the requests' order."""
        if self.logprobs is None:
            return None
        rows = self._taken_rows(taken)
        return LogprobsArrays(*(np.asarray(a)[rows] for a in self.logprobs))

    def _host_prompt_logprobs(self) -> list[LogprobsArrays | None] | None:
        """Per scheduled request, the logprobs of its prompt positions this step (or None);
        None if no request asked."""
        if not self.prompt_segments:
            return None
        chunks = [[np.asarray(a) for a in chunk] for chunk in self.prompt_logprobs]
        logprobs, token_ids, ranks = (np.concatenate(arrays) for arrays in zip(*chunks))
        per_request: list[LogprobsArrays | None] = [None] * self.num_reqs
        start = 0
        for i, count in self.prompt_segments:
            part = slice(start, start + count)
            per_request[i] = LogprobsArrays(logprobs[part], token_ids[part], ranks[part])
            start += count
        return per_request
