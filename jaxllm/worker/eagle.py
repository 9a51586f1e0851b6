"""An EAGLE head for speculative decoding (speculative_config method "eagle" or "eagle3";
models/eagle.py): a decoder layer on the target's mesh that reads the target's hidden states
of the step, its KV tensors on the target's block ids as a draft model's (worker/draft_model.py).
After each step's sampling, one executable per token bucket:

1. the head runs over the step's tokens, each position p with the target's hidden state at p
   and the token at p + 1: the step's next token; at the last position a request accepted,
   the token it sampled there; after a prefill chunk that does not sample, the prompt's next
   token, which the host packs (BatchLayout's next_token_ids):
       tokens [x d1 d2], d1 accepted, d2 not, s sampled after d1  -> the head reads [d1 s -]
       a prefill chunk [p0 p1 p2] of a longer prompt             -> the head reads [p1 p2 p3]
   ("-": a rejected position, written again by the next step). That writes the head's KV, and
   its output at each request's last accepted position gives the first draft (the argmax);
2. k - 1 steps of one token per request (a lax.scan), each feeding the head's own state of the
   step before (EAGLE's feature) with the draft before, each writing its KV one position
   further (the scheduler holds k - 1 slots per request past the step's tokens for them).

The drafts are greedy, each one guess that verification keeps with the target's probability
(model_runner.py): outputs are exact.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import Config
from jaxllm.sample.sampler import COLUMN
from jaxllm.worker import input_batch as batching
from jaxllm.worker.draft_inputs import drafter_table
from jaxllm.worker.draft_model import DraftModel, drafter_groups, one_token_metadata, taken_rows
from jaxllm.worker.model_loader import ModelWeights

_POSITION = COLUMN["position"]
# What a head reads of the target's weights: its embedding, and its LM head (none when tied).
_TARGET_PATHS = (("embed_tokens", "embedding"), ("lm_head", "kernel"))


class EagleProposer(DraftModel):
    """The head's weights and its jitted proposer (`propose`), with the target's embedding and LM head."""

    def _propose_fn(self, config: Config, attn_fn, layouts: dict[int, batching.BatchLayout]):
        return make_propose_fn(self.weights.graphdef, self.weights.treedef, len(self.weights.params), attn_fn,
                               layouts, config.num_speculative_tokens, config.cache.block_size,
                               self.model_config.max_model_len, len(self.kv_layout.groups), self.table_rows)

    def params(self, target: ModelWeights) -> list[jax.Array]:
        """The head's params, then the target's embedding and LM head (read again each step: update_weights
        replaces them)."""
        return self.weights.params + [target.params[target.index[p]] for p in _TARGET_PATHS if p in target.index]


def make_propose_fn(graphdef, params_treedef, num_head_params: int, attn_fn, layouts: dict[int, batching.BatchLayout],
                    num_drafts: int, block_size: int, max_model_len: int, num_groups: int, table_rows: int):
    """The EAGLE executable's function (a closure: the runner is not kept alive by it)."""
    def propose(params, kv_caches, buffer, sampled, hidden, token_bucket: int):
        """params: the head's flat weights, then the target's embedding [V, H] and LM head [H, V] (absent
        when tied); kv_caches: the head's KV tensors; buffer: the step's inputs as the forward ran them
        (`token_bucket`'s BatchLayout, every token id and position in it); sampled [num_sampled] int32: the
        step's samples, a row per row of logits; hidden: the target's final hidden states [T, H] (EAGLE-1)
        or the states entering its three layers [T, 3H] (EAGLE-3). Returns (the drafter table [table_rows,
        2 + num_drafts] int32 (draft_inputs.py): of each request that sampled, the token it took last, the
        drafts for after it, its drafts rejected; kv_caches)."""
        batch = layouts[token_bucket].unpack(buffer)
        head = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, params[:num_head_params]))
        embedding, *lm_head = params[num_head_params:]
        target_head = lm_head[0] if lm_head else embedding.T
        if head.embed_tokens is not None:
            embedding = head.embed_tokens.embedding[...]

        def draft(x):  # the head's greedy token, as a target id
            return head.target_ids(jnp.argmax(head.compute_logits(x, target_head), axis=-1).astype(jnp.int32))

        last, num_rejected = taken_rows(batch, sampled, num_drafts)
        token, position, taken_at = sampled[last], batch.sampling[last, _POSITION], batch.logits_indices[last]
        active = batch.first_rows >= 0
        num_tokens = batch.input_ids.shape[0]
        ends = batch.attention.query_start_loc[1:] - 1  # each request's last token (padding's: dropped below)
        next_ids = jnp.roll(batch.input_ids, -1)
        next_ids = next_ids.at[jnp.where(batch.next_token_ids >= 0, ends, num_tokens)].set(batch.next_token_ids,
                                                                                            mode="drop")
        next_ids = next_ids.at[jnp.where(active, taken_at, num_tokens)].set(token, mode="drop")
        md = batch.attention
        blocks_per_group = kv_caches[0][0].shape[0] // num_groups
        step_md = drafter_groups(md, md.slot_mapping[0], md.block_tables[0], num_groups, blocks_per_group, block_size)
        logit_states, states, kv_caches = head(jnp.take(embedding, next_ids, axis=0), head.combine(hidden),
                                               batch.positions, kv_caches, step_md, attn_fn)
        first = draft(logit_states[taken_at])
        if num_drafts == 1:
            return drafter_table(token, first[:, None], num_rejected, table_rows), kv_caches
        table = md.block_tables[0]  # [R, max_blocks_per_seq]

        def draft_step(carry, _):
            token, state, position, kv_caches = carry
            step_md, run_at = one_token_metadata(table, position, active, max_model_len, num_groups, blocks_per_group,
                                                 block_size)
            logit_state, state, kv_caches = head(jnp.take(embedding, token, axis=0), state, run_at, kv_caches,
                                                 step_md, attn_fn)
            token = draft(logit_state)
            return (token, state, position + 1, kv_caches), token

        # From the token it took last (at `position`) with the head's state at the position before;
        # unrolled: the k - 1 steps are one straight program, which XLA schedules across steps.
        (*_, kv_caches), rest = jax.lax.scan(draft_step, (first, states[taken_at], position, kv_caches),
                                             length=num_drafts - 1, unroll=True)
        drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
        return drafter_table(token, drafts, num_rejected, table_rows), kv_caches
    return propose
