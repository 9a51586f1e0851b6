"""A draft model for speculative decoding (speculative_config method "draft_model"): a smaller
model with the target's tokenizer, on the same mesh, whose KV tensors share the target's
block ids: it reads the block tables of the target's first KV cache group (config.py checks
that its attention fits them), and its own KV cache groups, which share tensors, each take
the same block ids in a range of their own (group g's block b is b + g * num_blocks).
After each step's sampling, one executable per token bucket:

1. the draft runs over the step's tokens as the target did, for its KV (a rejected draft's
   slots too: the next step writes them again, as the target's);
2. each sampling request's accepted run is found on the device, by the comparison
   StepOutput.get_output makes on the host, and so the token sampled after it;
3. from that token, k steps of one token per request (a lax.scan), each the argmax of the
   draft's logits, each writing its KV one position further (the scheduler holds k slots
   per request past its step's tokens for them).

The drafts, with the last token each request took and how many of its drafts the model
rejected, are the step's drafter table (worker/draft_inputs.py): the next step's forward reads it
on the device, and it comes back with the step's output, the drafts scheduled with the request's
next token. Each is one guess, which verification keeps with the probability the target gives
it (model_runner.py): exact for any draft model. An EAGLE head (worker/eagle.py) is built
the same way, and shares the helpers below.
"""
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import Config
from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.models.kv_layout import KVCacheSpec, model_kv_layout, model_kv_spec, model_kv_specs
from jaxllm.sample.sampler import COLUMN
from jaxllm.sharding import replicated
from jaxllm.worker import input_batch as batching, kv_heads
from jaxllm.worker.draft_inputs import drafter_table
from jaxllm.worker.model_loader import ModelWeights, load_weights

_POSITION, _DRAFT = COLUMN["position"], COLUMN["draft_token"]


class DraftModel:
    """The draft's weights and its jitted proposer (`propose`)."""

    def __init__(self, config: Config, mesh: jax.sharding.Mesh, attn_fn, layouts: dict[int, batching.BatchLayout]):
        mc = config.speculative.draft
        self.model_config = mc
        self._repeat = kv_heads.kv_head_repeat(mc.arch, config.parallel.tensor_parallel_size)
        self.arch = kv_heads.replicated_arch(mc.arch, self._repeat)  # what runs (worker/kv_heads.py)
        self.kv_layout = model_kv_layout(self.arch)
        self._mesh, self._seed = mesh, config.seed
        self.weights = load_weights(mc, self.arch, mesh, self._repeat, config.seed)
        self.table_rows = max(layout.num_reqs for layout in layouts.values())  # the drafter table's
        kv_shardings = [model_kv_spec(self.arch, config.cache.block_size).shardings(mesh)] * self.kv_layout.num_tensors
        self.propose = jax.jit(self._propose_fn(config, attn_fn, layouts), donate_argnums=(1,), static_argnums=(5,),
                               out_shardings=(replicated(mesh), kv_shardings))

    def _propose_fn(self, config: Config, attn_fn, layouts: dict[int, batching.BatchLayout]):
        return make_propose_fn(self.weights.graphdef, self.weights.treedef, attn_fn, layouts,
                               config.num_speculative_tokens, config.cache.block_size, self.model_config.max_model_len,
                               len(self.kv_layout.groups), self.table_rows)

    def params(self, target: ModelWeights) -> list[jax.Array]:
        """The propose executable's params: the draft's own (`target`'s weights are the runner's)."""
        return self.weights.params

    def kv_tensors(self, block_size: int) -> tuple[tuple[KVCacheSpec, ...], int]:
        """The draft's KV tensors in the cache (KVCache's `draft`): their specs, and the blocks each holds
        per block id (one per KV cache group of the draft)."""
        return model_kv_specs(self.arch, block_size), len(self.kv_layout.groups)

    def reload(self) -> None:
        """The weights again from the checkpoint, after a sleep that freed them."""
        self.weights = load_weights(self.model_config, self.arch, self._mesh, self._repeat, self._seed)


def make_propose_fn(graphdef, params_treedef, attn_fn, layouts: dict[int, batching.BatchLayout],
                    num_drafts: int, block_size: int, max_model_len: int, num_groups: int, table_rows: int):
    """The draft executable's function (a closure: the runner is not kept alive by it)."""
    def propose(params, kv_caches, buffer, sampled, hidden, token_bucket: int):
        """params: the draft's flat weights; kv_caches: its KV tensors; buffer: the step's inputs as the
        forward ran them (`token_bucket`'s BatchLayout, every token id and position in it); sampled
        [num_sampled] int32: the step's samples, a row per row of logits; hidden: the target's hidden
        states, which an EAGLE head reads (not this one: jit drops it). Returns (the drafter table
        [table_rows, 2 + num_drafts] int32 (draft_inputs.py): of each request that sampled, the token it
        took last, the drafts for after it, its drafts rejected; kv_caches)."""
        batch = layouts[token_bucket].unpack(buffer)
        model = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, params))
        blocks_per_group = kv_caches[0][0].shape[0] // num_groups
        md = batch.attention
        _, kv_caches = model(batch.input_ids, batch.positions, kv_caches,
                             drafter_groups(md, md.slot_mapping[0], md.block_tables[0], num_groups, blocks_per_group,
                                            block_size), attn_fn)
        last, num_rejected = taken_rows(batch, sampled, num_drafts)
        token, position = sampled[last], batch.sampling[last, _POSITION]
        active = batch.first_rows >= 0
        table = batch.attention.block_tables[0]  # [R, max_blocks_per_seq]

        def draft_step(carry, _):
            token, position, kv_caches = carry
            md, run_at = one_token_metadata(table, position, active, max_model_len, num_groups, blocks_per_group,
                                            block_size)
            hidden, kv_caches = model(token, run_at, kv_caches, md, attn_fn)
            token = jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32)
            return (token, position + 1, kv_caches), token

        # Unrolled: the k steps are one straight program, which XLA schedules across steps.
        (_, _, kv_caches), drafts = jax.lax.scan(draft_step, (token, position, kv_caches), length=num_drafts,
                                                 unroll=True)
        return drafter_table(token, drafts.T, num_rejected, table_rows), kv_caches
    return propose


def taken_rows(batch: batching.StepBatch, sampled: jax.Array, num_drafts: int) -> tuple[jax.Array, jax.Array]:
    """Per request ([R] int32 each, garbage for one that does not sample): its row of logits whose sample
    is the last token it takes this step, the sample after the run of its drafts that agree with the
    samples before them (the row's position is that token's; its logits_indices the token before it);
    and the number of its drafts after that run, which the model rejected."""
    num_rows = batch.sampling.shape[0]
    rows = jnp.clip(batch.first_rows[:, None] + jnp.arange(num_drafts + 1), 0, num_rows - 1)  # [R, 1 + k]
    drafts = batch.sampling[rows, _DRAFT]  # -1 at a request's last row: the run ends there at the latest
    accepted = jnp.sum(jnp.cumprod((sampled[rows] == drafts).astype(jnp.int32), axis=1), axis=1)
    num_scheduled = jnp.argmax(drafts == -1, axis=1)  # its rows before its last
    return jnp.clip(batch.first_rows + accepted, 0, num_rows - 1), num_scheduled - accepted


def one_token_metadata(table: jax.Array, position: jax.Array, active: jax.Array, max_model_len: int,
                       num_groups: int, blocks_per_group: int, block_size: int) -> tuple[AttentionMetadata, jax.Array]:
    """A drafting step of one token per request at `position` [R] (table [R, max_blocks_per_seq]: the
    target's first group's block tables): the drafter's grouped metadata, and the positions to run
    (0 where nothing is written: a request that does not sample, or past max_model_len)."""
    num_reqs = table.shape[0]
    writes = active & (position < max_model_len)
    block = table[jnp.arange(num_reqs), jnp.minimum(position // block_size, table.shape[1] - 1)]
    # A request that does not sample attends to one slot it never writes (the result is dropped).
    md = AttentionMetadata(slot_mapping=jnp.where(writes, block * block_size + position % block_size, -1),
                           query_start_loc=jnp.arange(num_reqs + 1, dtype=jnp.int32),
                           seq_lens=jnp.where(writes, position + 1, 1), block_tables=None,
                           num_seqs=jnp.full((1,), num_reqs, jnp.int32))
    return (drafter_groups(md, md.slot_mapping, table, num_groups, blocks_per_group, block_size),
            jnp.where(writes, position, 0))


def drafter_groups(md: AttentionMetadata, slot_mapping: jax.Array, block_tables: jax.Array, num_groups: int,
                   blocks_per_group: int, block_size: int) -> AttentionMetadata:
    """`md` with the drafter's groups on one group's slots [T] and block tables [R, B], group g's
    moved to its own range of blocks."""
    offsets = jnp.arange(num_groups, dtype=jnp.int32)[:, None] * blocks_per_group
    return dataclasses.replace(
        md, block_tables=block_tables[None] + offsets[:, :, None],
        slot_mapping=jnp.where(slot_mapping[None] >= 0, slot_mapping[None] + offsets * block_size, -1))
