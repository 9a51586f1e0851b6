"""Pooling: a pooling request's vector, from the final hidden states of its prompt (vLLM's pooling
runner, with a decoder used as an embedding model).

The engine's PoolerConfig says which prompt tokens pool: the last (LAST), the first (CLS) or all of
them (MEAN). A step that runs pooling tokens dispatches, after its forward, the POOL executable of
its token bucket (compiled at warm-up): a segment sum of the forward's hidden states (the model's
final norm applied) into one float32 row per scheduled request, [R, hidden_size], the row of each
token given by `token_rows` [T] (-1: none). A long prompt comes in several prefill chunks: the host
keeps each request's running sum (PooledRequest) and adds the step's row to it as the step lands
(R rows of hidden_size floats cross to the host per such step, never the hidden states). At the
prompt's end it applies vLLM's head to those few floats: the mean (MEAN), the first `dimensions`
values (Matryoshka), then the L2 normalization.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.contracts.step import SchedulerOutput
from jaxllm.pooling_params import PoolerConfig


def pool_hidden(hidden, token_rows, num_rows: int):
    """hidden [T, hidden_size]; token_rows [T] int32: the row each token's hidden state adds to (-1: none).
    Returns [num_rows, hidden_size] float32: each row's sum."""
    return jax.ops.segment_sum(hidden.astype(jnp.float32), token_rows, num_segments=num_rows)


class PooledRequest:
    """A pooling request's sum of hidden states over the steps that ran its prompt, and its head."""

    def __init__(self, num_prompt_tokens: int, mean: bool, dimensions: int | None, normalize: bool):
        self.num_prompt_tokens = num_prompt_tokens
        self.mean, self.dimensions, self.normalize = mean, dimensions, normalize
        self.sum: np.ndarray | None = None  # [hidden_size] float32
        self.count = 0  # the hidden states summed

    def add(self, row: np.ndarray, count: int) -> None:
        self.sum = row.copy() if self.sum is None else self.sum + row
        self.count += count

    def vector(self) -> np.ndarray:
        """[dimensions or hidden_size] float32."""
        vector = (self.sum / self.count if self.mean else self.sum)[:self.dimensions]
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # torch's F.normalize: eps 1e-12
        return vector.astype(np.float32)


class StepPooling(NamedTuple):
    """A dispatched step's pooling: its rows on the device, and each pooling request's part in them."""
    sums: jax.Array  # [R, hidden_size] float32: row i is scheduled request i's
    # (scheduled index, its request, hidden states summed into its row, whether its prompt ended)
    parts: list[tuple[int, PooledRequest, int, bool]]

    def outputs(self, num_reqs: int) -> list[np.ndarray | None]:
        """Per scheduled request, its vector if its prompt ended in this step, else None; the other rows
        join their requests' sums. Once per step, in step order: it blocks until the rows are on the host."""
        sums = np.asarray(self.sums)
        vectors: list[np.ndarray | None] = [None] * num_reqs
        for i, request, count, ended in self.parts:
            request.add(sums[i], count)
            if ended:
                vectors[i] = request.vector()
        return vectors


class Pooler:
    """The runner's pooling requests, by id, and each step's pooling inputs. A step in flight keeps
    references to its requests: one aborted or preempted meanwhile (or an id given again) is no matter."""

    def __init__(self, config: PoolerConfig):
        self.config = config
        self.requests: dict[str, PooledRequest] = {}

    def update(self, sched: SchedulerOutput) -> None:
        """Forget the step's finished and preempted requests, take its new pooling ones."""
        for request_id in (*sched.finished_req_ids, *sched.preempted_req_ids):
            self.requests.pop(request_id, None)
        for new in sched.new_requests:
            params = new.pooling_params
            if params is not None:
                normalize = self.config.normalize if params.normalize is None else params.normalize
                self.requests[new.req_id] = PooledRequest(len(new.prompt_token_ids),
                                                          self.config.pooling_type == "MEAN",
                                                          params.dimensions, normalize)

    def token_rows(self, sched: SchedulerOutput, views: dict[str, np.ndarray]) -> tuple[np.ndarray, list] | None:
        """The step's token_rows [T] int32 (a fresh array: the device may read it after this returns) and
        StepPooling's parts; None if the step pools nothing. views: the step's packed inputs
        (input_batch.pack), T tokens long."""
        query_start_loc = views["query_start_loc"]  # where each scheduled request's tokens start
        rows, parts = np.full(len(views["input_ids"]), -1, np.int32), []
        for i, s in enumerate(sched.scheduled):
            request = self.requests.get(s.req_id)
            if request is None:
                continue
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            ended = end == request.num_prompt_tokens
            pooled = self._pooled_positions(start, end, ended)
            offset = int(query_start_loc[i]) - start  # position p is token p + offset of the step
            rows[pooled.start + offset:pooled.stop + offset] = i
            if pooled or ended:
                parts.append((i, request, len(pooled), ended))
        return (rows, parts) if parts else None

    def _pooled_positions(self, start: int, end: int, ended: bool) -> range:
        """The prompt positions of a chunk [start, end) whose hidden states pool."""
        if self.config.pooling_type == "MEAN":
            return range(start, end)
        if self.config.pooling_type == "LAST":
            return range(end - 1, end) if ended else range(0)
        return range(0, 1) if start == 0 else range(0)  # CLS

    def clear(self) -> None:
        self.requests.clear()
