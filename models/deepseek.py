"""DeepSeek-V2 and V3: Llama's outline with multi-head latent attention (MLA) and DeepSeek's experts.

    tokens -> embed -> N x [x + mla(norm(x)); x + mlp(norm(x))] -> norm -> head
    (the first first_k_dense_replace layers' MLP dense, the others' routed and shared experts)

Latent attention compresses a token's keys and values for every head into one latent c of
kv_lora_rank values, beside one rope key part k_pe that every head shares:

    q       = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x)))        [T, heads, nope + rope]
    c, k_pe = kv_a_proj_with_mqa(x): kv_a_layernorm(c), rope(k_pe)      [T, kv_lora_rank], [T, rope]
    head h: k_h = [c W_UK_h, k_pe], v_h = c W_UV_h, kv_b_proj's kernel [kv_lora_rank, heads, nope + v] = [W_UK | W_UV]

The KV cache holds [c, k_pe] (kv_lora_rank + rope values a token). Attention absorbs W_UK into
the query and W_UV into the output, so it reads only latents:

    q_lat_h = W_UK_h q_nope_h                                           [kv_lora_rank]
    score   = [q_lat_h, q_pe_h] . [c, k_pe] * scale,    o_h = (sum_s p_s c_s) W_UV_h

which is multi-query attention of `heads` query heads over one KV head of kv_lora_rank + rope
dimensions whose values are the latents themselves (their rope part's output is dropped): the
attention backends' interface, over the latent cache as both K and V. With JAXLLM_MLA_PREFILL=absorbed
every token takes this form, prefill chunks and decode tokens alike.

By default (JAXLLM_MLA_PREFILL=expanded, read when the model is built; prefill_form) each token's
attention splits in two parts of one softmax (kernels/mla_prefill.py): over its request's tokens of
this step, with every head's K and V expanded from the step's fresh latents (nope + rope + v FLOPs a
(query, key) pair and head where the absorbed form takes 2 x (kv_lora_rank + rope): 320 against 1152
for V3; a Pallas kernel on a GPU, kernels/pallas_mla_prefill.py), and over the context cached before
the step, absorbed as above (the latent backend's context_only). The context part's output goes
through W_UV, then the two merge by their log-sum-exps before o_proj. A decode token's step part is
itself alone, so its context part is the absorbed attention it had; the shapes are the step's, and
one executable serves any mix. On an H100 (docs/benchmarks.md) DeepSeek-V2-Lite's prefill-heavy
throughput is 1.17x the absorbed form's, its 128/128 throughput 0.97x.
"""
import os

import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels.attention import AttentionMetadata, write_slots
from jaxllm.kernels.mla_prefill import merge_attention, step_attention_fn
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.llama import MLP, DecoderLayer, Linear, RMSNorm, apply_rope, dot
from jaxllm.models.moe import Experts, MoeForCausalLM, Router, record_routing, route
from jaxllm.sharding import param_mesh

LORA_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (DeepSeek's and HF's default, not rms_norm_eps)
PREFILL_FORMS = ("absorbed", "expanded")


def prefill_form() -> str:
    """How latent attention runs a step's prompt tokens, JAXLLM_MLA_PREFILL: "expanded" (the default)
    or "absorbed" (the module docstring)."""
    form = os.environ.get("JAXLLM_MLA_PREFILL", "expanded")
    if form not in PREFILL_FORMS:
        raise ValueError(f"JAXLLM_MLA_PREFILL must be one of {PREFILL_FORMS}, got {form!r}")
    return form


def apply_rope_to_pairs(x, cos, sin):
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout): rotate-half on the
    evens then the odds. x [num_tokens, heads, dim]; the result in that de-interleaved order, which
    q and k share, so their products are the pairs' (as HF's rope_interleave)."""
    return apply_rope(jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1), cos, sin)


class MLAttention(nnx.Module):
    """Multi-head latent attention (the module's docstring), HF's names for its projections."""

    def __init__(self, config: ModelArchConfig, *, dtype, rngs, mesh=None):
        """mesh: where the expanded prefill's step part runs each device's heads (None: one device)."""
        c, mla = config, config.mla
        self.num_heads, self.mla, self.scale, self.mesh = c.num_heads, mla, c.attn_scale, mesh
        self.prefill = prefill_form()
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.rope = apply_rope_to_pairs if mla.rope_interleave else apply_rope
        if mla.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, c.num_heads * qk_dim, ("embed", "q_heads"), dtype=dtype, rngs=rngs)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(c.hidden_size, mla.q_lora_rank, ("embed", None), bias=c.attention_bias,
                                   dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS, dtype=dtype, rngs=rngs)
            self.q_b_proj = Linear(mla.q_lora_rank, c.num_heads * qk_dim, (None, "q_heads"), dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, mla.latent_dim, ("embed", None), bias=c.attention_bias,
                                         dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS, dtype=dtype, rngs=rngs)
        # [kv_lora_rank, heads * (nope + v)]: head h's W_UK then W_UV; a device's shard is whole heads
        self.kv_b_proj = Linear(mla.kv_lora_rank, c.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                (None, "q_heads"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(c.num_heads * mla.v_head_dim, c.hidden_size, ("q_heads", "embed"), bias=c.o_proj_bias,
                             dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, kv_cache, md: AttentionMetadata, attn_fn):
        """x [num_tokens, hidden] -> ([num_tokens, hidden], (latent_cache,)); kv_cache: (latent_cache,)
        [num_blocks, block_size, 1, kv_lora_rank + rope]; cos, sin [num_tokens, rope // 2]."""
        n, h, mla = x.shape[0], self.num_heads, self.mla
        rank, nope = mla.kv_lora_rank, mla.qk_nope_head_dim
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(n, h, -1)
        kv = self.kv_a_proj_with_mqa(x)
        c, k_pe = self.kv_a_layernorm(kv[:, :rank]), self.rope(kv[:, None, rank:], cos, sin)[:, 0]
        cache = write_slots(kv_cache[0], jnp.concatenate([c, k_pe], axis=-1)[:, None, :], md.slot_mapping)
        w_kv = self.kv_b_proj.kernel[...].reshape(rank, h, -1)  # [kv_lora_rank, heads, nope + v]
        w_uk, w_uv = w_kv[..., :nope], w_kv[..., nope:]
        q_pe = self.rope(q[..., nope:], cos, sin)
        q_abs = jnp.concatenate([jnp.einsum("thn,rhn->thr", q[..., :nope], w_uk), q_pe], -1)  # [T, heads, latent_dim]
        metadata = (md.query_start_loc, md.seq_lens, md.block_tables, md.num_seqs)
        if self.prefill == "absorbed":
            o = attn_fn(q_abs, cache, cache, *metadata, scale=self.scale)
            o = jnp.einsum("thr,rhv->thv", o[..., :rank], w_uv)
        else:  # the step's own tokens expanded, the cached context absorbed, one softmax
            context, context_lse = attn_fn(q_abs, cache, cache, *metadata, scale=self.scale, context_only=True,
                                           return_lse=True)
            k_nope, v = jnp.einsum("tr,rhn->thn", c, w_uk), jnp.einsum("tr,rhv->thv", c, w_uv)
            step, step_lse = step_attention_fn(self.mesh)(jnp.concatenate([q[..., :nope], q_pe], -1), k_nope, k_pe,
                                                          v, md.query_start_loc, md.num_seqs, scale=self.scale)
            context = jnp.einsum("thr,rhv->thv", context[..., :rank], w_uv)
            o = merge_attention(step, step_lse, context, context_lse).astype(x.dtype)
        return self.o_proj(o.reshape(n, h * mla.v_head_dim)), (cache,)


class DeepseekMoeBlock(nnx.Module):
    """DeepSeek's MoE layer: the router (`gate`) in fp32 (as HF), the routed experts, and the shared
    experts (one MLP of n_shared_experts experts' width) that every token takes, ungated."""

    def __init__(self, config: ModelArchConfig, *, dtype, rngs, mesh=None):
        moe = config.moe
        self.moe = moe
        self.gate = Router(moe, config.hidden_size, dtype=dtype, rngs=rngs)
        self.experts = Experts(moe, config.hidden_size, dtype=dtype, rngs=rngs, mesh=mesh)
        shared = moe.shared_expert_intermediate_size
        self.shared_experts = MLP(config, dtype=dtype, rngs=rngs, intermediate_size=shared) if shared else None

    def __call__(self, x):
        """x [T, hidden] -> [T, hidden]."""
        moe, bias = self.moe, self.gate.e_score_correction_bias
        weights, ids = route(dot(x, self.gate.kernel[...], jnp.float32), moe.top_k, moe.renormalize,
                             None if bias is None else bias[...], sigmoid=moe.scoring == "sigmoid",
                             num_groups=moe.num_groups, topk_groups=moe.topk_groups, group_score=moe.group_score,
                             scaling_factor=moe.routed_scaling_factor)
        record_routing(ids)
        y = self.experts(x, weights, ids)
        return y if self.shared_experts is None else y + self.shared_experts(x)


class DeepseekForCausalLM(MoeForCausalLM):
    """DeepSeek-V2 and V3: every layer's attention latent, its MLP DeepSeek's experts on the sparse layers."""

    def decoder_layer(self, config: ModelArchConfig, layer: int, *, dtype, rngs) -> DecoderLayer:
        mlp, mesh = None, param_mesh(self.mesh, ("layers", layer))  # its stage's under pipeline parallelism
        if layer in config.moe.sparse_layers:
            mlp = DeepseekMoeBlock(config, dtype=dtype, rngs=rngs, mesh=mesh)
        return DecoderLayer(config, layer, dtype=dtype, rngs=rngs, mlp=mlp,
                            attention=MLAttention(config, dtype=dtype, rngs=rngs, mesh=mesh))
