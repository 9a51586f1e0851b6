"""Mamba2 (HF transformers' Mamba2ForCausalLM): Llama's outline with a Mamba2 mixer for each
attention and MLP.

    tokens -> embed -> N x [x + mixer(norm(x))] -> norm -> head
    mixer:  z, xBC, dt = in_proj(x)
            x, B, C = silu(causal depthwise conv1d(xBC))          over each request's tokens
            y = SSM(x, dt = clip(softplus(dt + dt_bias)), A = -exp(A_log), B, C) + D x
            out_proj(rmsnorm(y * silu(z)) * weight)

Each request has its states per layer in its state slot (the Mamba KV cache group's one block,
models/kv_layout.py): the conv's last conv_kernel - 1 inputs (of x, and of B and C) and the SSM state. A step's tokens
read them where the request has computed tokens before (a later prefill chunk, a decode) and
leave them after its last token; a request's first step starts from zeros, whatever the slot held.
The residual stream is fp32 with `residual_in_fp32` (HF's default). The gated RMSNorm normalizes
over the whole intermediate width, as HF's Mamba2 does (mamba_ssm normalizes each of n_groups
groups: the same for the one group of the published checkpoints).

Attribute names follow Llama's (embed_tokens, layers, norm, lm_head); the loader reads them from
HF's backbone.embeddings, backbone.layers.{i}.{norm,mixer}, backbone.norm_f (models/loader.py).
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.kernels.reference import scatter_index
from jaxllm.kernels.ssd import chunk_terms_fn, ragged_ssd_in_slots, state_update_fn
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.kv_layout import model_kv_layout
from jaxllm.models.llama import Linear, LlamaForCausalLM, RMSNorm, _param, rms_normalize


class Requests(NamedTuple):
    """The step's requests as a Mamba layer reads them from its group's metadata."""
    query_start_loc: jax.Array  # [R + 1] int32
    num_seqs: jax.Array         # [1] int32
    query_lens: jax.Array       # [R] int32, 0 for padding
    has_state: jax.Array        # [R] bool: tokens computed before this step, whose states the slot holds
    slots: jax.Array            # [R] int32: each request's state slot (its block in the group)
    write_slots: jax.Array      # [R] int32: the same, out of range for padding (its writes dropped; scatter_index)

    @classmethod
    def of(cls, md: AttentionMetadata, num_slots: int) -> "Requests":
        qsl, num_seqs = md.query_start_loc, md.num_seqs
        real = jnp.arange(md.seq_lens.shape[0]) < jnp.reshape(num_seqs, ())
        query_lens = jnp.where(real, qsl[1:] - qsl[:-1], 0)
        slots = md.block_tables[:, 0]
        return cls(qsl, num_seqs, query_lens, real & (md.seq_lens > query_lens), slots,
                   scatter_index(slots, real, num_slots))

    def token_requests(self, num_tokens: int) -> jax.Array:
        """[num_tokens] int32: each token's request (a padding token: the last request)."""
        req = jnp.searchsorted(self.query_start_loc[1:], jnp.arange(num_tokens), side="right", method="compare_all")
        return jnp.minimum(req, self.query_lens.shape[0] - 1).astype(jnp.int32)


def causal_conv(xbc, conv_state, weight, bias, requests: Requests):
    """Each request's depthwise causal conv over its tokens, after the inputs its state holds.

    xbc [T, D]; conv_state [S, K - 1, D] (the last K - 1 inputs of each slot, oldest first);
    weight [D, 1, K] (HF's Conv1d); bias [D] or None. Returns (out [T, D] float32, before the
    activation; conv_state with each request's last K - 1 inputs)."""
    num_tokens, k = xbc.shape[0], weight.shape[-1]
    # The cache is read once, its requests' rows, and written after: where two reads feed the
    # outputs and the write, XLA copies the whole cache so that the write cannot come first.
    held = jnp.where(requests.has_state[:, None, None], conv_state[requests.slots], 0)  # [R, K - 1, D]
    req = requests.token_requests(num_tokens)
    back = jnp.arange(k) - (k - 1)  # the window of a token: the K inputs ending at it
    rel = (jnp.arange(num_tokens) - requests.query_start_loc[req])[:, None] + back  # [T, K]: in its step's tokens
    window = _inputs(xbc, held, requests.query_start_loc, req[:, None], rel)
    out = jnp.einsum("tkd,dk->td", window.astype(jnp.float32), weight[:, 0].astype(jnp.float32))
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    num_reqs = requests.query_lens.shape[0]
    last = requests.query_lens[:, None] - 1 + back[1:]  # [R, K - 1]: the inputs a request's state keeps
    kept = _inputs(xbc, held, requests.query_start_loc, jnp.arange(num_reqs)[:, None], last)
    return out, conv_state.at[requests.write_slots].set(kept.astype(conv_state.dtype), mode="drop", unique_indices=True)


def _inputs(xbc, held, query_start_loc, req, rel):
    """The inputs at places rel [n, m] of requests req [n, 1] in their step: this step's token, or
    (rel < 0) the input -rel back before it in the request's held state [R, K - 1, D] -> [n, m, D]."""
    k1 = held.shape[1]
    num_tokens = xbc.shape[0]
    from_step = xbc[jnp.clip(query_start_loc[req] + rel, 0, num_tokens - 1)]
    from_state = held[req, jnp.clip(rel + k1, 0, k1 - 1)]
    return jnp.where((rel >= 0)[..., None], from_step, from_state)


class Conv1d(nnx.Module):
    """A depthwise conv's params in HF's layout: weight [channels, 1, kernel], bias [channels]; its
    channels split over devices along `axis` (a logical axis name, or None: replicated)."""

    def __init__(self, channels: int, kernel: int, bias: bool, axis: str | None, *, dtype, rngs):
        self.weight = _param(rngs, (channels, 1, kernel), (axis, None, None), dtype)
        self.bias = _param(rngs, (channels,), (axis,), dtype) if bias else None

    def __call__(self, x, conv_state, requests: Requests):
        return causal_conv(x, conv_state, self.weight[...], None if self.bias is None else self.bias[...], requests)


class Mamba2Mixer(nnx.Module):
    """HF's in_proj and conv1d are held in parts (models/loader.py reads each from its rows of HF's
    tensor), so that under tensor parallelism each device holds whole heads and runs them alone:
    zxdt_proj [hidden, heads, 2 * head_dim + 1] (per head its z, x and dt rows) and conv_x (x's
    channels) split over the heads, bc_proj and conv_bc (B and C of every group) on every device.
    The gated norm's mean over the whole width and out_proj's sum are the collectives."""

    def __init__(self, config: ModelArchConfig, *, dtype, rngs):
        m = config.mamba
        self.mamba = m
        self.zxdt_proj = Linear(config.hidden_size, (m.num_heads, 2 * m.head_dim + 1), ("embed", "ssm_heads", None),
                                bias=m.use_bias, dtype=dtype, rngs=rngs)
        kernel = self.zxdt_proj.kernel
        self.zxdt_proj.kernel = nnx.Param(kernel[...], **{**kernel.get_metadata(), "hf_axes": (2, 0, 1)})
        self.bc_proj = Linear(config.hidden_size, 2 * m.group_dim, ("embed", None), bias=m.use_bias,
                              dtype=dtype, rngs=rngs)
        self.conv_x = Conv1d(m.intermediate_size, m.conv_kernel, m.use_conv_bias, "ssm_heads", dtype=dtype, rngs=rngs)
        self.conv_bc = Conv1d(2 * m.group_dim, m.conv_kernel, m.use_conv_bias, None, dtype=dtype, rngs=rngs)
        self.dt_bias = _param(rngs, (m.num_heads,), ("ssm_heads",), dtype)
        self.A_log = _param(rngs, (m.num_heads,), ("ssm_heads",), dtype)
        self.D = _param(rngs, (m.num_heads,), ("ssm_heads",), dtype)
        self.norm = RMSNorm(m.intermediate_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(m.intermediate_size, config.hidden_size, ("ssm_heads", "embed"), bias=m.use_bias,
                               dtype=dtype, rngs=rngs)

    def __call__(self, x, state, md: AttentionMetadata):
        """x [T, hidden]; state (conv x [S, K - 1, intermediate], conv B and C [S, K - 1, 2 * groups *
        state_size], ssm [S, heads, head_dim, state_size]), S state slots; md: the layer's group's
        metadata. Returns ([T, hidden], the updated state)."""
        m, num_tokens = self.mamba, x.shape[0]
        # The layer reads its states once its input is there, and writes them before its output is
        # used (the barrier below). Else the reads of every layer's states, which need the step's
        # inputs alone, may all start first, and the writes all wait for the end: XLA's GPU scheduler
        # sizes its memory by the whole card, and Mamba2-2.7B's step of 256 requests kept every
        # layer's fp32 states, 66 GiB, where one layer's are 0.6 GiB.
        x, state = jax.lax.optimization_barrier((x, state))
        conv_x, conv_bc, ssm_state = state
        requests = Requests.of(md, ssm_state.shape[0])
        zxdt = self.zxdt_proj(x)                                            # [T, heads, 2 * head_dim + 1]
        z, xs, dt = zxdt[..., :m.head_dim], zxdt[..., m.head_dim:-1], zxdt[..., -1]
        xs, conv_x = self.conv_x(xs.reshape(num_tokens, m.intermediate_size), conv_x, requests)
        bc, conv_bc = self.conv_bc(self.bc_proj(x), conv_bc, requests)
        # silu of the conv's fp32 output, rounded to the model's dtype as HF's
        xs = jax.nn.silu(xs).astype(x.dtype).astype(jnp.float32).reshape(num_tokens, m.num_heads, m.head_dim)
        B, C = jnp.split(jax.nn.silu(bc).astype(x.dtype).astype(jnp.float32), 2, axis=-1)
        dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)),
                      *m.time_step_limit)
        y, ssm_state = ragged_ssd_in_slots(
            xs, dt, -jnp.exp(self.A_log[...].astype(jnp.float32)), B.reshape(num_tokens, m.n_groups, m.state_size),
            C.reshape(num_tokens, m.n_groups, m.state_size), ssm_state, requests.slots, requests.has_state,
            requests.write_slots, requests.query_start_loc, requests.num_seqs, m.chunk_size, chunk_terms_fn(),
            md.decodes_only, state_update_fn())
        y = y + self.D[...].astype(jnp.float32)[:, None] * xs
        gated = y.reshape(num_tokens, m.intermediate_size) * jax.nn.silu(z.reshape(num_tokens, -1).astype(jnp.float32))
        y = (self.norm.weight[...] * rms_normalize(gated, self.norm.eps)).astype(x.dtype)
        return jax.lax.optimization_barrier((self.out_proj(y), (conv_x, conv_bc, ssm_state)))


class Mamba2DecoderLayer(nnx.Module):
    """x + mixer(norm(x)); the attention layer's call, its rotary and attention inputs unused."""

    def __init__(self, config: ModelArchConfig, layer: int, *, dtype, rngs):
        self.kv_group, self.kv_tensor = model_kv_layout(config).layer_slot(layer)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mixer = Mamba2Mixer(config, dtype=dtype, rngs=rngs)
        self.residual_dtype = jnp.float32 if config.mamba.residual_in_fp32 else dtype
        self.dtype = dtype

    def __call__(self, x, cos, sin, state, md, attn_fn):
        h, state = self.mixer(self.norm(x.astype(self.dtype)), state, md)
        return x.astype(self.residual_dtype) + h, state


class Mamba2Norm(RMSNorm):
    """The final norm: the fp32 residual stream back in the model's dtype (as HF casts it for the head)."""

    def __call__(self, x):
        return (self.weight[...] * rms_normalize(x.astype(jnp.float32), self.eps)).astype(self.weight.dtype)


class Mamba2ForCausalLM(LlamaForCausalLM):
    """Llama's model of Mamba2 layers: the states take the KV caches' place (kv_caches holds a
    (conv x, conv B and C, SSM) per layer), positions are unused."""
    decoder_layer, final_norm = Mamba2DecoderLayer, Mamba2Norm
