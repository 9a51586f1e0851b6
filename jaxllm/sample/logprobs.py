"""Sample logprobs on device: the sampled token's log probability, its rank, and the
top-K tokens', from the step's logits, as vLLM's Sampler.gather_logprobs.

They are of the model's raw distribution, log_softmax of the logits before temperature
and filters (vLLM's default logprobs_mode, raw_logprobs). K is at least the most any
request of the step asked for, from a few buckets (StepSampling.logprob_buckets), so the
executables are one per request bucket and K; each request keeps its first `logprobs` columns. The step runs it only
when a request of the batch asked for logprobs (decided on the host, as SampleMode).
"""
import jax
import jax.numpy as jnp

from jaxllm.kernels import batch_invariant


def compute_logprobs(logits: jax.Array, sampled: jax.Array, num_logprobs: int
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [R, vocab] float32; sampled [>= R] int32, the step's ids (padded to max_num_seqs);
    num_logprobs K (static, <= vocab). Returns
      logprobs  [R, 1 + K] float32: the sampled token's, then the top K tokens' in descending order;
      token_ids [R, 1 + K] int32: the same tokens' ids;
      ranks     [R] int32: the sampled token's rank, the number of tokens whose logprob is >= its
                own (vLLM's: 1 = most likely; a tie counts the tied tokens ahead of it).
    Ties in the top K put the lower token id first (a stable top_k), so the order is deterministic."""
    num_reqs = logits.shape[0]
    sampled = sampled[:num_reqs]
    logprobs = batch_invariant.log_softmax(logits) if batch_invariant.enabled() else jax.nn.log_softmax(logits, -1)
    sampled_logprobs = jnp.take_along_axis(logprobs, sampled[:, None], axis=-1)  # [R, 1]
    ranks = (logprobs >= sampled_logprobs).sum(-1, dtype=jnp.int32)
    if num_logprobs == 0:
        return sampled_logprobs, sampled[:, None], ranks
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return (jnp.concatenate([sampled_logprobs, top_logprobs], axis=-1),
            jnp.concatenate([sampled[:, None], top_ids.astype(jnp.int32)], axis=-1), ranks)
