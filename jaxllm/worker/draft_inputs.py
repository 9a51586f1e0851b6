"""With a drafter (a draft model or an EAGLE head) and asynchronous scheduling, step N+1 is packed
while step N runs: the host does not know which of step N's drafts the model takes. It packs
each request as if every one were taken; the step's forward then reads, on the device, what
step N's drafter left in its table, one row per request of step N (`drafter_table`):

    [the token it took last, its k drafts for after it, the number of its drafts the model rejected]

(an n-gram drafter's NO_DRAFT where it has none: such a draft is fed as token 0, a guess like any other)

and moves the request's tokens back by that number: a request that had drafts [a b c] at
positions 11-13 after its token at 10, took a and sampled x, so rejected 2, is packed for
step N+1 at 14 (x) and 15-17 (its next drafts) and runs at 12 and 13-15. Its positions, its
KV slots (from its block table, on the device), its sequence length, the positions its samples
are keyed by and the drafts its rows are checked against all follow. The scheduler holds blocks
for the packed positions (every draft taken), so the moved ones are the request's too, and
corrects its own count when step N lands.
"""
import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.contracts.step import DRAFT_ON_DEVICE
from jaxllm.sample.sampler import COLUMN
from jaxllm.worker.input_batch import StepBatch

_POSITION, _DRAFT = COLUMN["position"], COLUMN["draft_token"]


def drafter_table(last_token: jax.Array, drafts: jax.Array, num_rejected: jax.Array, num_rows: int) -> jax.Array:
    """The drafter's table [num_rows, 2 + k] int32 of a step's R requests: last_token [R], drafts
    [R, k], num_rejected [R], then rows of zeros (its shape is every step's: the next forward's input)."""
    table = jnp.concatenate([last_token[:, None], drafts, num_rejected[:, None]], axis=1)
    return jnp.pad(table, ((0, num_rows - table.shape[0]), (0, 0)))


def read_previous_step(batch: StepBatch, table: jax.Array, block_size: int) -> StepBatch:
    """`batch` with the tokens at its prev_rows read from the previous step's drafter table [rows,
    2 + k] (a request's tokens start at its row's first word: prev_rows = row * (2 + k) + j), and
    each such request moved back over the drafts it rejected in that step."""
    width = table.shape[1]
    words = table.reshape(-1)
    on_device = batch.prev_rows >= 0  # [T]
    at = jnp.maximum(batch.prev_rows, 0)
    input_ids = jnp.where(on_device, jnp.maximum(words[at], 0), batch.input_ids)
    shift = jnp.where(on_device, words[at // width * width + width - 1], 0)  # [T]
    positions = batch.positions - shift
    md = batch.attention
    num_tokens, num_reqs = input_ids.shape[0], md.seq_lens.shape[0]
    # [2, 3] tokens -> query_start_loc [0, 2, 5] -> requests [0, 0, 1, 1, 1] (padding tokens: past the last)
    request = jnp.minimum(jnp.searchsorted(md.query_start_loc[1:], jnp.arange(num_tokens), side="right"),
                          num_reqs - 1)
    blocks = md.block_tables[:, request, positions // block_size]  # [G, T]
    slot_mapping = jnp.where(on_device, blocks * block_size + positions % block_size, md.slot_mapping)
    # A request's tokens move together: its sequence ends its last token's shift earlier.
    is_request = jnp.arange(num_reqs) < md.num_seqs[0]
    seq_lens = md.seq_lens - jnp.where(is_request, shift[jnp.maximum(md.query_start_loc[1:] - 1, 0)], 0)
    # A row of logits samples the token after its own (logits_indices): keyed by that position, and
    # checked against the draft fed after it.
    row_token = batch.logits_indices
    draft = batch.sampling[:, _DRAFT]
    draft = jnp.where(draft == DRAFT_ON_DEVICE, input_ids[jnp.minimum(row_token + 1, num_tokens - 1)], draft)
    sampling = batch.sampling.at[:, _POSITION].add(-shift[row_token]).at[:, _DRAFT].set(draft)
    return dataclasses.replace(batch, input_ids=input_ids, positions=positions, sampling=sampling,
                               attention=dataclasses.replace(md, slot_mapping=slot_mapping, seq_lens=seq_lens))
