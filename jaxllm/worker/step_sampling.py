"""A step's second half: the logits of a dispatched forward to sampled ids, unless the batch is
greedy with no logits processors (the sampler, one executable per request bucket, SampleMode and
whether it runs the processors of jaxllm/sample/processors.py under the core's token masks), and,
when a request asks for them, the logprobs of the sampled ids (per request bucket and number of
top tokens; jaxllm/sample/logprobs.py) and of its prompt (per token bucket)."""
from typing import NamedTuple

import jax
import numpy as np
from jax.profiler import TraceAnnotation

from jaxllm.contracts.step import ScheduledRequest, TokenMasks
from jaxllm.sample.sampler import SampleMode
from jaxllm.sharding import replicated
from jaxllm.utils import cdiv
from jaxllm.worker.executables import LOGPROBS, PROMPT_LOGPROBS, SAMPLER, ExecutableKey, Executables
from jaxllm.worker.processor_state import ProcessorRows
from jaxllm.worker.step_functions import StepFunctions
from jaxllm.worker.step_output import Logprobs


class Forward(NamedTuple):
    """A dispatched forward pass, on the device."""
    token_bucket: int
    greedy: jax.Array  # [num_sampled] int32: the argmax of each row of logits
    logits: jax.Array  # [L, vocab] float32
    words: jax.Array   # [L, NUM_SAMPLING_WORDS] int32: the sampler's inputs
    hidden: jax.Array  # [T, hidden_size]: for prompt logprobs
    draft_inputs: jax.Array | None  # with a drafter, the step's inputs as the forward ran them (draft_inputs.py)
    draft_hidden: jax.Array  # what an EAGLE head reads: `hidden`, or an EAGLE-3 head's [T, 3 * hidden_size]
    # A MoE model's (expert ids [L, moe_layers, k] at each row of logits, counts [moe_layers, E]); else ()
    routing: tuple


class StepSampling:
    def __init__(self, executables: Executables, fns: StepFunctions, processor_rows: ProcessorRows, mesh,
                 vocab_size: int, num_logprobs: int):
        """num_logprobs: the most top tokens a request gets."""
        self.executables, self.fns, self.processor_rows, self.mesh = executables, fns, processor_rows, mesh
        self.bitmask_words = cdiv(vocab_size, 32)
        # Per request bucket: a bitmask allowing every token, on the device, and two host buffers for masks.
        self._all_allowed: dict[int, jax.Array] = {}
        self._host_bitmasks: dict[int, list[np.ndarray]] = {}
        self.num_logprobs = num_logprobs
        # A step computes the top K of the bucket that holds its requests' most: a top-k of 8
        # costs a fifth of one of 20 at [256, 128k] on an H200 (above 16, XLA sorts the rows).
        self.logprob_buckets = sorted({0, min(8, self.num_logprobs), self.num_logprobs})

    def logprob_bucket(self, most: int) -> int | None:
        """The top tokens a step computes when its requests ask for at most `most` (-1: none asks)."""
        return None if most < 0 else next(k for k in self.logprob_buckets if k >= most)

    def masked_bitmask(self, num_rows: int, scheduled: list[ScheduledRequest], first_rows: list[int],
                       masks: TokenMasks) -> np.ndarray:
        """The core's token masks as a bitmask over the step's rows of logits [num_rows, bitmask_words],
        every other row allowing every token. `first_rows`: each scheduled request's first row."""
        # Two buffers in turn, as the step's inputs: the step before may not have read its mask yet
        # (a CPU device reads a numpy argument in place).
        buffers = self._host_bitmasks.setdefault(
            num_rows, [np.empty((num_rows, self.bitmask_words), np.int32) for _ in range(2)])
        buffers.reverse()
        bitmask = buffers[0]
        bitmask[:] = -1
        index = {s.req_id: row for s, row in zip(scheduled, first_rows)}  # a masked request has no drafts
        bitmask[[index[r] for r in masks.req_ids]] = masks.bitmask
        return bitmask

    def all_allowed_bitmask(self, num_rows: int) -> jax.Array:
        if num_rows not in self._all_allowed:
            self._all_allowed[num_rows] = jax.device_put(np.full((num_rows, self.bitmask_words), -1, np.int32),
                                                         replicated(self.mesh))
        return self._all_allowed[num_rows]

    def delete(self) -> None:
        """Free the device's bitmasks (made again when next needed)."""
        for array in self._all_allowed.values():
            array.delete()
        self._all_allowed.clear()

    def sample(self, fwd: Forward, mode: SampleMode, processed: bool, num_logprobs: int | None,
               bitmask: np.ndarray | None, prompt_inputs, user_rows: np.ndarray | None, head_params: list[jax.Array]
               ) -> tuple[jax.Array, Logprobs | None, list[Logprobs]]:
        """Sample a dispatched forward: unless the batch is greedy with no logits processors, its
        sampler (with `processed`, the processors', under `bitmask` [R, bitmask_words] or none);
        if asked, the logprobs of its sampled ids, and the prompt logprobs of `prompt_inputs`
        [(token indices [C], target ids [C])] through `head_params` (what computes logits from the
        forward's hidden states). `user_rows`: the step's rows, for the users' processors' states.
        Returns (the sampled ids, their Logprobs or None, the prompt inputs' Logprobs)."""
        num_rows = fwd.logits.shape[0]
        if processed:
            bitmask = self.all_allowed_bitmask(num_rows) if bitmask is None else bitmask
            rows = self.processor_rows
            state, user_states = rows.state, rows.user_states(user_rows, num_rows)
            sampler = self.executables.get(ExecutableKey(SAMPLER, num_rows, mode, True), lambda: (
                self.fns.sample_processed.lower(fwd.logits, fwd.words, state, bitmask, user_states, mode)))
            with TraceAnnotation("dispatch"):
                sampled, rows.state = sampler(fwd.logits, fwd.words, state, bitmask, user_states)
        elif mode == SampleMode.GREEDY:
            sampled = fwd.greedy
        else:
            sampler = self.executables.get(ExecutableKey(SAMPLER, num_rows, mode, False),
                                           lambda: self.fns.sample.lower(fwd.logits, fwd.words, mode))
            with TraceAnnotation("dispatch"):
                sampled = sampler(fwd.logits, fwd.words)
        logprobs = None
        if num_logprobs is not None:
            fn = self.executables.get(ExecutableKey(LOGPROBS, num_rows, num_logprobs=num_logprobs), lambda: (
                self.fns.logprobs.lower(fwd.logits, sampled, num_logprobs)))
            with TraceAnnotation("dispatch"):
                logprobs = Logprobs(*fn(fwd.logits, sampled))
        prompt_logprobs = []
        for indices, targets in prompt_inputs:
            fn = self.executables.get(ExecutableKey(PROMPT_LOGPROBS, fwd.token_bucket), lambda: (
                self.fns.prompt_logprobs.lower(head_params, fwd.hidden, indices, targets)))
            with TraceAnnotation("dispatch"):
                prompt_logprobs.append(Logprobs(*fn(head_params, fwd.hidden, indices, targets)))
        return sampled, logprobs, prompt_logprobs
