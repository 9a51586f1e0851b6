"""The engine's model as a trainer sees it: one full sequence through the model's own
__call__, no engine state (a KV scratch of its own, the plain-JAX reference attention), a
pure function of the params that jax.grad can differentiate. In batch-invariant mode
(kernels/batch_invariant.py) its logprobs are bitwise the engine's, whatever batch the
engine ran the sequence in: its attention is then the engine's (on a GPU the Pallas kernel,
differentiated as the reference), and under tensor parallelism runs per device as the engine's does."""
import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels import batch_invariant, reference
from jaxllm.kernels.attention import AttentionMetadata, per_device_heads
from jaxllm.models.kv_layout import model_kv_specs
from jaxllm.models.params import flatten
from jaxllm.utils import cdiv


def make_logprobs_fn(runner):
    """fn(params, token_ids) -> logprobs: params in the engine's layout (LLM.get_params()),
    token_ids [S] or [B, S] int32 (B sequences of S tokens, run as one ragged batch, as the engine
    runs its steps: batching them with jax.vmap would change the numbers); logprobs [S - 1] or
    [B, S - 1] float32, log p(token_ids[..., i + 1] | token_ids[..., :i + 1])."""
    weights, layout = runner.weights, runner.kv_layout
    graphdef, treedef, paths = weights.graphdef, weights.treedef, list(weights.paths)
    block_size = runner.block_size
    specs = model_kv_specs(runner.arch, block_size)
    dtypes = runner.config.cache.cache_dtype, runner.config.model.dtype
    invariant, mesh = runner.config.batch_invariant, runner.mesh
    attention = _attention(invariant, runner.config.attention_backend)
    if invariant and mesh.shape["model"] > 1:  # as the engine attends: each device its own heads
        attention = per_device_heads(attention, mesh)

    def logprobs(params, token_ids):
        flat = flatten(params)
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, [flat[p] for p in paths]))
        batch = token_ids.reshape(-1, token_ids.shape[-1])
        num_seqs, n = batch.shape
        per_seq, num_groups = cdiv(n, block_size), len(layout.groups)
        # Per KV tensor: K and V, a latent, or states
        caches = [tuple(jnp.zeros(a.shape, a.dtype) for a in spec.arrays(num_seqs * per_seq, *dtypes))
                  for spec in specs]
        # Sequence b's blocks are b * per_seq .. (b + 1) * per_seq - 1, its tokens' slots from b * per_seq * block_size.
        slots = (jnp.arange(num_seqs, dtype=jnp.int32)[:, None] * per_seq * block_size
                 + jnp.arange(n, dtype=jnp.int32)[None, :]).reshape(-1)
        tables = jnp.arange(num_seqs * per_seq, dtype=jnp.int32).reshape(num_seqs, per_seq)
        md = AttentionMetadata(
            slot_mapping=jnp.tile(slots, (num_groups, 1)),
            query_start_loc=jnp.arange(num_seqs + 1, dtype=jnp.int32) * n,
            seq_lens=jnp.full((num_seqs,), n, jnp.int32), block_tables=jnp.tile(tables, (num_groups, 1, 1)),
            num_seqs=jnp.array([num_seqs], jnp.int32))
        positions = jnp.tile(jnp.arange(n, dtype=jnp.int32), num_seqs)
        with batch_invariant.tracing(invariant, mesh):
            hidden, _ = model(batch.reshape(-1), positions, caches, md, attention)
            hidden = hidden.reshape(num_seqs, n, -1)[:, :-1].reshape(num_seqs * (n - 1), -1)
            logits = model.compute_logits(hidden)
            lp = batch_invariant.log_softmax(logits) if invariant else jax.nn.log_softmax(logits, -1)
        picked = jnp.take_along_axis(lp, batch[:, 1:].reshape(-1, 1), axis=-1)
        return picked.reshape(*token_ids.shape[:-1], n - 1)

    return logprobs


def _attention(invariant: bool, backend: str):
    """The reference attention, walking every block: a loop of static length, which reverse-mode
    differentiation goes through. In batch-invariant mode the engine's own attention (the reference's
    blocks of tokens, or the Pallas kernel's one launch shape, kernels/attention.py) with the
    reference's gradient, so that the logprobs are bitwise the engine's on any backend."""
    if invariant and backend != "reference":
        return batch_invariant.with_reference_gradient(batch_invariant.pallas_attention)

    def attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs, **kwargs):
        if invariant:
            return batch_invariant.reference_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                                       num_seqs, every_block=True, **kwargs)
        req, pos, valid = reference.token_positions(query_start_loc, seq_lens, num_seqs, q.shape[0])
        return reference.attend(q, k_cache, v_cache, block_tables[req], pos, valid, every_block=True, **kwargs)
    return attention
