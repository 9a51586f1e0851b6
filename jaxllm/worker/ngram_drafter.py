"""N-gram drafts made on the device: speculative_config method "ngram" under asynchronous
scheduling. The host's prompt lookup (spec_decode/ngram.py) needs each request's last token,
which is still on the device when the next step is scheduled; so the drafts are made where the
token is, after each step's sampling, into the drafter table the next step's forward reads
(worker/draft_inputs.py), as a draft model's are (worker/draft_model.py).

A request's tokens stay on the device beside its KV: one token id per KV slot (`token_ids`
[num_blocks, block_size] int32, the drafter's tensor of the cache), written at each step's slots
with the tokens it ran, read through the block tables of the target's first KV cache group (full
attention where the model has it). So a block found in the prefix cache holds its tokens as it
holds their KV, and a rejected draft's slot is written again by the next step; no lookup reads
past the token a request took last.

Per request that samples, in one executable per token bucket:
1. its tokens: the cache's at positions [0, p), and at p the token it took last;
2. for n = 1 .. prompt_lookup_max, the ends of earlier copies of its last n tokens (a comparison
   over its max_model_len positions per n; the copies of n + 1 tokens are among those of n);
3. the latest end of the longest n in [prompt_lookup_min, prompt_lookup_max] with a copy, and the
   k tokens after it; where those reach the request's last token, the run from the copy to the
   end again (the text repeats with that period: "x y x y" drafts "x y x"), and -1 without a copy.

Those are propose_ngram's drafts, except that the host's stop at the text's end: here the
scheduler has placed the drafts before the table is made (as many as the request's last table
held), and a draft slot left empty would be fed a dummy token, so a guess is better. A step reads and compares
every request row's max_model_len token ids a few times: at 256 rows of 2048 tokens, about 2 MB
each time.
"""
import jax
import jax.numpy as jnp

from jaxllm.config import Config
from jaxllm.contracts.step import NO_DRAFT
from jaxllm.models.kv_layout import KVCacheSpec
from jaxllm.sample.sampler import COLUMN
from jaxllm.sharding import replicated
from jaxllm.worker import input_batch as batching
from jaxllm.worker.draft_inputs import drafter_table
from jaxllm.worker.draft_model import taken_rows

_POSITION = COLUMN["position"]


class NgramDrafter:
    """The n-gram drafter's jitted proposer (`propose`), with a draft model's interface; no weights."""
    weights = None

    def __init__(self, config: Config, mesh: jax.sharding.Mesh, layouts: dict[int, batching.BatchLayout]):
        spec = config.speculative
        self.table_rows = max(layout.num_reqs for layout in layouts.values())  # the drafter table's
        fn = make_propose_fn(layouts, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                             config.cache.block_size, self.table_rows)
        rep = replicated(mesh)
        self.propose = jax.jit(fn, donate_argnums=(1,), static_argnums=(5,), out_shardings=(rep, [(rep,)]))

    def params(self, target) -> list:
        return []

    @staticmethod
    def kv_tensors(block_size: int) -> tuple[tuple[KVCacheSpec, ...], int]:
        """Its tensor in the cache (KVCache's `draft`): a token id per slot, one block per block id."""
        return (KVCacheSpec(((block_size,),), dtype="int32"),), 1


def make_propose_fn(layouts: dict[int, batching.BatchLayout], num_drafts: int, min_n: int, max_n: int,
                    block_size: int, table_rows: int):
    def propose(params, caches, buffer, sampled, hidden, token_bucket: int):
        """A draft model's arguments (worker/draft_model.py), of which the n-gram drafter reads the
        step's inputs as the forward ran them (`buffer`) and its samples; caches: [(token_ids,)].
        Returns (the drafter table [table_rows, 2 + num_drafts] int32, caches)."""
        batch = layouts[token_bucket].unpack(buffer)
        md = batch.attention
        ((token_ids,),) = caches
        flat = token_ids.reshape(-1)
        slots = md.slot_mapping[0]  # -1 for padding: past the end, dropped
        flat = flat.at[jnp.where(slots >= 0, slots, flat.shape[0])].set(batch.input_ids, mode="drop")
        last, num_rejected = taken_rows(batch, sampled, num_drafts)
        token, position = sampled[last], batch.sampling[last, _POSITION]
        drafts = ngram_drafts(flat, md.block_tables[0], token, position, min_n, max_n, num_drafts, block_size)
        drafts = jnp.where((batch.first_rows >= 0)[:, None], drafts, NO_DRAFT)
        return drafter_table(token, drafts, num_rejected, table_rows), [(flat.reshape(token_ids.shape),)]
    return propose


def ngram_drafts(token_ids: jax.Array, block_tables: jax.Array, token: jax.Array, position: jax.Array,
                 min_n: int, max_n: int, num_drafts: int, block_size: int) -> jax.Array:
    """token_ids [slots] int32: the token at each KV slot; block_tables [R, B]; token [R]: each request's
    last token, at `position` [R]. Returns [R, num_drafts] int32: the tokens after the latest earlier copy
    of the longest run of its last n tokens, n in [min_n, max_n], the run from there to its end repeating
    where it reaches the end; -1 without a copy."""
    length = block_tables.shape[1] * block_size
    at = jnp.arange(length, dtype=jnp.int32)
    slots = block_tables[:, at // block_size] * block_size + at % block_size  # [R, length]
    history = jnp.where(at == position[:, None], token[:, None], token_ids[slots])
    last = position[:, None]
    ends = at < last  # where an earlier copy may end: a token follows it
    best = jnp.full(position.shape, -1, jnp.int32)
    for j in range(max_n):  # the copies of the last j + 1 tokens: those of j tokens whose token j back matches
        back = jnp.take_along_axis(history, jnp.maximum(last - j, 0), axis=1)  # [R, 1]
        shifted = jnp.pad(history[:, :length - j], ((0, 0), (j, 0)))  # shifted[:, e] = history[:, e - j]
        ends &= (at >= j) & (shifted == back)
        if j + 1 >= min_n:  # a longer n's copy, where there is one, replaces a shorter one's
            latest = jnp.max(jnp.where(ends, at, -1), axis=1)
            best = jnp.where(latest >= 0, latest, best)
    # Past the text's end the copy repeats: the run from the copy to the end comes again (period p - end).
    period = jnp.maximum(last - best[:, None], 1)
    follow = best[:, None] + 1 + jnp.arange(num_drafts, dtype=jnp.int32) % period  # [R, num_drafts], <= p
    drafts = jnp.take_along_axis(history, jnp.clip(follow, 0, length - 1), axis=1)
    return jnp.where(best[:, None] >= 0, drafts, NO_DRAFT)
