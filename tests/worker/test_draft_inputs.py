"""A drafter's next step under asynchronous scheduling: packed as if the step before took every
draft, and moved back on the device over the ones it rejected, it is the step the host would
pack knowing that step's tokens."""
import functools

import jax.numpy as jnp
import numpy as np

from jaxllm.contracts.step import DRAFT_ON_DEVICE, NewRequestData, ScheduledRequest, SchedulerOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker import input_batch as batching
from jaxllm.worker.draft_inputs import drafter_table, read_previous_step

BLOCK_SIZE, NUM_DRAFTS = 4, 3
WIDTH = 2 + NUM_DRAFTS  # of the drafter's table


def packed(layout, state, scheduled, new_requests=()):
    """The step's batch as the forward unpacks it."""
    buffer = np.zeros(layout.size, np.int32)
    views = layout.host_views(buffer)
    batching.fill_padding(views)
    sched = SchedulerOutput(scheduled, sum(s.num_new_tokens for s in scheduled), list(new_requests))
    rows, _, _ = state.update(sched)
    batching.pack(sched, rows, state, views, BLOCK_SIZE, WIDTH)
    return layout.unpack(jnp.asarray(buffer))


def test_the_next_step_moves_back_over_the_drafts_the_step_before_rejected():
    layout = batching.BatchLayout(16, 4, 8, num_rows=16)
    state = batching.RequestRows(8, 4)
    new = [NewRequestData(i, [3] * 12, SamplingParams(temperature=1.0, seed=7), 7, []) for i in "ab"]
    # Step N: "a" at 9 with drafts for 10-12, "b" at 5 with none; both sample.
    packed(layout, state, [ScheduledRequest("a", 9, 4, [30], [[1, 2, 3, 4]], True, draft_token_ids=[40, 41, 42]),
                           ScheduledRequest("b", 5, 1, [50], [[5, 6, 7]], True)], new)
    # Step N's drafter: "a" took draft 40 and sampled 60 at 11 (2 rejected), "b" sampled 70 at 6.
    table = drafter_table(jnp.array([60, 70]), jnp.array([[61, 62, 63], [71, 72, 73]]), jnp.array([2, 0]), 4)
    # Step N+1, packed as if "a" had taken all three and the token after them (at 13).
    optimistic = packed(layout, state, [
        ScheduledRequest("a", 13, 3, [], [[]], True, draft_token_ids=[DRAFT_ON_DEVICE] * 2),
        ScheduledRequest("b", 6, 4, [], [[]], True, draft_token_ids=[DRAFT_ON_DEVICE] * 3)])
    got = read_previous_step(optimistic, table, BLOCK_SIZE)
    want = packed(layout, state, [ScheduledRequest("a", 11, 3, [60], [[]], True, draft_token_ids=[61, 62]),
                                  ScheduledRequest("b", 6, 4, [70], [[]], True, draft_token_ids=[71, 72, 73])])
    np.testing.assert_array_equal(got.input_ids[:7], [60, 61, 62, 70, 71, 72, 73])
    np.testing.assert_array_equal(got.positions[:7], [11, 12, 13, 6, 7, 8, 9])
    for field in ("input_ids", "positions", "attention.slot_mapping", "attention.seq_lens"):
        get = lambda batch: functools.reduce(getattr, field.split("."), batch)
        np.testing.assert_array_equal(get(got), get(want), err_msg=field)
    np.testing.assert_array_equal(got.sampling[:7], want.sampling[:7])  # its rows of logits (padding's are not read)
