"""Gemma 3 (and Gemma 2) as a Flax NNX decoder, text only.

    tokens -> embed * sqrt(hidden) -> N x [x + norm(attn(norm(x))); x + norm(mlp(norm(x)))]
           -> norm -> tied head -> (soft-cap)

Gemma departs from llama.py's decoder in a few places, all from HF's modeling_gemma3 /
modeling_gemma2: RMSNorm scales by (1 + weight), in fp32; four norms per layer (before
and after attention and MLP); a GeGLU MLP with tanh-approximate GELU; queries scaled by
query_pre_attn_scalar**-0.5; sliding-window layers mixed with full ones, and in Gemma 3
a plain RoPE of a lower base on the sliding layers (ModelArchConfig.layer_rope); Gemma
3's q/k norms; Gemma 2's soft-caps on attention scores and logits.

The conventions are llama.py's: attribute names are HF's checkpoint names but for the
fused qkv_proj and gate_up_proj, kernels are stored [in, out], every param carries its
logical axes, layers are unrolled.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.kv_layout import model_kv_layout
from jaxllm.models.llama import MLP, Attention, LlamaForCausalLM, _param, rms_normalize, rope_cos_sin


class GemmaRMSNorm(nnx.Module):
    """x / rms(x) * (1 + weight), all in fp32, then cast back (HF's Gemma3RMSNorm; the
    weight is stored as an offset from 1, so a fresh norm is the identity)."""

    def __init__(self, dim, eps, *, dtype, rngs):
        self.weight = _param(rngs, (dim,), ("norm",), dtype)
        self.eps = eps

    def __call__(self, x):
        x32 = rms_normalize(x.astype(jnp.float32), self.eps)
        return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GemmaAttention(Attention):
    """llama.py's attention (its scale Gemma's query_pre_attn_scalar's) with Gemma's score soft-cap and (1 + w)
    q/k norms."""

    def __init__(self, config: ModelArchConfig, layer: int, *, dtype, rngs):
        super().__init__(config, layer, dtype=dtype, rngs=rngs)
        self.soft_cap = config.attn_logit_softcap
        if config.qk_norm:  # Gemma 3
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, rngs=rngs)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, kv_cache, md: AttentionMetadata, attn_fn):
        """x [num_tokens, hidden]; cos, sin [num_tokens, head_dim // 2] (this layer's rope);
        md: the layer's KV cache group's -> ([num_tokens, hidden], (k_cache, v_cache))."""
        def gemma_attn_fn(*args, **kwargs):  # the same call, with Gemma's soft-cap
            return attn_fn(*args, **{**kwargs, "soft_cap": self.soft_cap})
        return super().__call__(x, cos, sin, kv_cache, md, gemma_attn_fn)


class GemmaMLP(MLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""
    activation = staticmethod(functools.partial(jax.nn.gelu, approximate=True))


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, config: ModelArchConfig, layer: int, *, dtype, rngs):
        h, eps = config.hidden_size, config.rms_norm_eps
        self.kv_group, self.kv_tensor = model_kv_layout(config).layer_slot(layer)
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, rngs=rngs)
        self.self_attn = GemmaAttention(config, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, rngs=rngs)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, rngs=rngs)
        self.mlp = GemmaMLP(config, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, kv_cache, md, attn_fn):
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, md, attn_fn)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), kv_cache


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model; Gemma 2 is the same module without q/k norms, with one rope
    and with soft-caps (all read from the config). Llama's outline with Gemma's layers and
    norm, its embedding scale, per-layer ropes and final soft-cap."""
    decoder_layer, final_norm = GemmaDecoderLayer, GemmaRMSNorm

    def embed(self, input_ids):
        x = self.embed_tokens(input_ids)
        # HF multiplies by sqrt(hidden) rounded to the model dtype (e.g. 25.25 in bf16 for 640).
        return x * jnp.asarray(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def decode_layers(self, x, positions, kv_caches, md: AttentionMetadata, attn_fn, layers: range,
                      aux_layers: tuple[int, ...] = ()):
        """LlamaForCausalLM.decode_layers with each layer's rope (Gemma 3's local and global), and its
        KV cache group's metadata (model_kv_layout)."""
        ropes = {}  # (theta, scaling items) -> (cos, sin): two at most (Gemma 3's local and global)
        kv_caches, aux = list(kv_caches), []
        for i in layers:
            if i in aux_layers:
                aux.append(x)
            theta, scaling = self.config.layer_rope(i)
            key = (theta, tuple(sorted((scaling or {}).items())))
            if key not in ropes:
                ropes[key] = _cos_sin(self.config, theta, scaling, positions)
            layer = self.layers[i]
            t = layer.kv_tensor
            x, kv_caches[t] = layer(x, *ropes[key], kv_caches[t], md.group(layer.kv_group), attn_fn)
        return x, kv_caches, aux

    def compute_logits(self, hidden):
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32, soft-capped (Gemma 2)."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def _cos_sin(config: ModelArchConfig, theta: float, scaling: dict | None, positions):
    """cos, sin [num_tokens, head_dim // 2] fp32 of one rope."""
    return rope_cos_sin(dataclasses.replace(config, rope_theta=theta, rope_scaling=scaling), positions)
