"""For `jaxllm bench step`: the device's time for a step with no host work in between. Armed
by ModelRunner.record_widest_step, it keeps the inputs of the widest decoding step it sees
(every request with one token, or with its drafts at most `max_tokens_per_request`: the
most requests and, among those, the most tokens) and replays them back to back. Off, it
costs the step nothing."""
import time

import jax
import numpy as np


class StepReplay:
    def __init__(self, max_tokens_per_request: int = 1):
        self.max_tokens_per_request = max_tokens_per_request  # 1 + the most draft tokens a request has
        self.widest: tuple[tuple[int, int], tuple] | None = None  # (width, the dispatch's arguments)

    def offer(self, num_reqs: int, num_tokens: int, step: tuple) -> None:
        """step: (token bucket, its packed buffer, SampleMode, with processors, number of logprobs, decodes
        only): ModelRunner.dispatch's arguments."""
        width = (num_reqs, num_tokens)
        if num_tokens > num_reqs * self.max_tokens_per_request:  # a prefill
            return
        if self.widest is None or width > self.widest[0]:
            token_bucket, buffer, *rest = step
            self.widest = (width, (token_bucket, np.copy(buffer), *rest))

    def time(self, dispatch, num_iters: int) -> float:
        """Seconds per replay of the widest step through `dispatch(*step)`, on an idle engine:
        the replay rewrites the KV slots of that step's requests (finished by now)."""
        step = self.widest[1]
        jax.block_until_ready(dispatch(*step))
        start = time.perf_counter()
        for _ in range(num_iters):
            outputs = dispatch(*step)
        jax.block_until_ready(outputs)
        return (time.perf_counter() - start) / num_iters
