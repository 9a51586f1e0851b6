"""The logits processors' per-request state (sample/processors.py ProcessorState: output
token counts, prompt mask, bias and stop rows, one row per request row of the runner) on
the device, and the users' own processors (EngineArgs.logits_processors) on the host. A
request's rows are written once, when it takes a row; the processed sampler counts each
sampled token inside the step, so asynchronous scheduling never waits for the host."""
import logging

import jax
import numpy as np

from jaxllm.config import Config
from jaxllm.contracts.step import NewRequestData
from jaxllm.sample import processors
from jaxllm.sample.logits_processor import AddedRequest, BatchUpdate
from jaxllm.sample.processors import ProcessorState

logger = logging.getLogger(__name__)


class ProcessorRows:
    def __init__(self, config: Config, users: tuple, write_rows, sharding: ProcessorState):
        """users: the users' processors, made from config.logits_processors (every step runs them, in
        the processed sampler); write_rows: the jitted processors.write_rows; sharding: the state's."""
        self.num_rows, self.vocab_size = config.scheduler.max_num_seqs, config.model.arch.vocab_size
        self.users = users
        self._write_rows = write_rows
        self._write_rows_fn: jax.stages.Compiled | None = None
        num_rows, vocab_size = self.num_rows, self.vocab_size
        self._zeros = jax.jit(lambda: processors.zero_state(num_rows, vocab_size),  # compiled once: reset compiles nothing
                              out_shardings=sharding).lower().compile()
        self.state = self._zeros()

    def reset(self) -> None:
        self.state = self._zeros()

    def delete(self) -> None:
        for array in jax.tree.leaves(self.state):
            array.delete()
        self.state = None

    def write(self, new_rows: list[tuple[int, NewRequestData]], failed: dict[str, str]) -> None:
        """Write the rows of requests that took a row this step, WRITE_ROWS at a time (with none,
        one call that writes nothing: warm-up's). A request whose rows cannot be made goes into
        `failed`, its row left as it was."""
        for start in range(0, max(len(new_rows), 1), processors.WRITE_ROWS):
            chunk = new_rows[start:start + processors.WRITE_ROWS]
            rows = np.full(processors.WRITE_ROWS, self.num_rows, np.int32)  # out of range: skipped
            values = [np.zeros((processors.WRITE_ROWS, self.vocab_size), dtype)
                      for dtype in (np.int32, bool, np.float32, bool)]
            for i, (row, new) in enumerate(chunk):
                params = new.sampling_params
                try:
                    state_rows = processors.request_state_rows(
                        new.prompt_token_ids, new.output_token_ids, params.logit_bias, params.allowed_token_ids,
                        new.banned_token_ids, new.stop_token_ids, self.vocab_size)
                except Exception as e:
                    logger.exception("request %s: its logits processors' rows failed", new.req_id)
                    failed[new.req_id] = f"logits processors: {type(e).__name__}: {e}"
                    continue
                rows[i] = row
                for array, value in zip(values, state_rows):
                    array[i] = value
            if self._write_rows_fn is None:
                self._write_rows_fn = self._write_rows.lower(self.state, rows, *values).compile()
            self.state = self._write_rows_fn(self.state, rows, *values)

    def update_users(self, added: list[tuple[int, NewRequestData]], removed: list[int],
                     failed: dict[str, str]) -> None:
        """Tell the users' processors who left and who joined, one joining request at a time: a
        processor that fails on one request's arguments fails that request alone."""
        if removed:
            for processor in self.users:
                processor.update_state(BatchUpdate([], removed))
        for row, new in added:
            update = BatchUpdate([AddedRequest(row, new.sampling_params, new.prompt_token_ids,
                                               list(new.output_token_ids))], [])
            for processor in self.users:
                try:
                    processor.update_state(update)
                except Exception as e:
                    logger.exception("request %s: logits processor %s failed", new.req_id, type(processor).__name__)
                    failed[new.req_id] = f"logits processor {type(processor).__name__}: {type(e).__name__}: {e}"
                    break

    def user_states(self, rows: np.ndarray | None, num_reqs: int) -> tuple:
        """The users' processors' states for a step: rows [n] int32, padded with -1 to num_reqs."""
        if not self.users:
            return ()
        padded = np.full(num_reqs, -1, np.int32)
        if rows is not None:
            padded[:len(rows)] = rows
        return tuple(p.state(padded) for p in self.users)
