"""Expanded latent attention (DeepSeek's MLA prefill, models/deepseek.py): the step part in plain JAX,
and the merge of two parts of one softmax by their log-sum-exps.

A token's attention splits at the start of its request's tokens in this step:

- the step part (step_attention): each token over its own request's tokens of this step, causally,
  as plain multi-head attention whose keys and values every head expands from the step's freshly
  computed latents, k_h = [c W_UK_h, k_pe], v_h = c W_UV_h (no cache read). Per (query, key) pair
  and head it costs nope + rope + v multiply-adds, 320 for V3, where the absorbed form costs
  2 x (kv_lora_rank + rope) = 1152. A decode token's step part is itself alone.
- the context part: each token over its request's positions cached before this step, absorbed over
  the latent cache (the latent backends' context_only and return_lse, kernels/reference.py).

merge_attention joins them. Both parts take the step's token bucket as it is, [num_tokens, ...], with
the request boundaries from the metadata; nothing has a per-request or per-context shape, so one
executable serves any mix of prompts, chunks and decodes. (Expanding the cached context too, vLLM's
form, would gather each request's context into buffers whose size follows its length.)

  q       [num_tokens, num_heads, nope + rope]   queries, rope applied, in the model's dtype
  k_nope  [num_tokens, num_heads, nope]          c W_UK per head
  k_pe    [num_tokens, rope]                     the rope key part every head shares
  v       [num_tokens, num_heads, v_dim]         c W_UV per head
  returns (out [num_tokens, num_heads, v_dim], lse [num_tokens, num_heads]), both float32; rows of
  padding tokens zeros and -inf

The reference walks the step's keys in tiles of KEY_TILE tokens with an online softmax, every query
at once (memory O(num_tokens * num_heads * KEY_TILE)), up to the last real token: the whole masked
[tokens x tokens] rectangle. The Pallas kernel (kernels/pallas_mla_prefill.py) skips the tiles
before each query block's earliest request; step_attention_fn picks between them.
"""
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.kernels.reference import log_sum_exp, token_requests
from jaxllm.utils import cdiv

_MASKED = -1e30
KEY_TILE = 64


def step_attention(q, k_nope, k_pe, v, query_start_loc, num_seqs, *, scale):
    """Each token over its request's tokens of this step up to itself (module docstring)."""
    num_tokens, num_heads, _ = q.shape
    nope = k_nope.shape[-1]
    req, valid = token_requests(query_start_loc, num_seqs, num_tokens)
    token = jnp.arange(num_tokens)
    first = query_start_loc[req]  # each token's request's first token in the step
    q = q.astype(jnp.float32) * scale
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    pad = cdiv(num_tokens, KEY_TILE) * KEY_TILE - num_tokens
    k_nope, k_pe, v = (jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (k_nope, k_pe, v))

    def body(j, carry):
        m, l, acc = carry
        start = j * KEY_TILE
        kn, kp, vt = (jax.lax.dynamic_slice_in_dim(a, start, KEY_TILE).astype(jnp.float32) for a in (k_nope, k_pe, v))
        s = jnp.einsum("thn,shn->ths", q_nope, kn) + jnp.einsum("thr,sr->ths", q_pe, kp)
        key = start + jnp.arange(KEY_TILE)
        mask = ((key[None, :] >= first[:, None]) & (key[None, :] <= token[:, None]) & valid[:, None])[:, None, :]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + jnp.einsum("ths,shv->thv", p, vt)

    init = (jnp.full((num_tokens, num_heads), _MASKED, jnp.float32), jnp.zeros((num_tokens, num_heads), jnp.float32),
            jnp.zeros((num_tokens, num_heads, v.shape[-1]), jnp.float32))
    num_real = query_start_loc[jnp.reshape(num_seqs, ())]
    m, l, acc = jax.lax.fori_loop(0, cdiv(num_real, KEY_TILE), body, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None], log_sum_exp(m, l)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Two parts of one softmax over disjoint keys, out [num_tokens, num_heads, dim] with their
    log-sum-exps lse [num_tokens, num_heads], as the softmax over all their keys (float32): each
    weighed by exp(lse - lse of both). A part of no keys (lse -inf) weighs exactly 0, so the other
    comes back as it is; a row of neither (padding) comes back as zeros, not NaN."""
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w_a, w_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = w_a + w_b
    merged = out_a.astype(jnp.float32) * w_a[..., None] + out_b.astype(jnp.float32) * w_b[..., None]
    return merged / jnp.where(total > 0, total, 1.0)[..., None]


def step_attention_fn(mesh=None):
    """The step part a model runs: the Pallas kernel on a GPU, the reference elsewhere. With a mesh
    whose "model" axis spans several devices, each device runs it on its own heads (k_pe whole)."""
    fn = step_attention
    if jax.default_backend() == "gpu":
        from jaxllm.kernels import pallas_mla_prefill
        fn = pallas_mla_prefill.step_attention
    if mesh is None or mesh.shape["model"] == 1:
        return fn
    heads = P(None, "model", None)

    def per_device_heads(q, k_nope, k_pe, v, query_start_loc, num_seqs, *, scale):
        return jax.shard_map(functools.partial(fn, scale=scale), mesh=mesh, check_vma=False,
                             in_specs=(heads, heads, P(), heads, P(), P()), out_specs=(heads, P(None, "model")))(
            q, k_nope, k_pe, v, query_start_loc, num_seqs)
    return per_device_heads
