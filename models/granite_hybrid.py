"""Granite 4.0-H (HF transformers' GraniteMoeHybridForCausalLM): Llama's outline whose layers mix
tokens with attention or a Mamba2 mixer, and whose MLP is a shared dense MLP beside the experts.

    tokens -> embed * embedding_multiplier
           -> N x [x + r * mixer(norm(x));  x + r * (experts(norm(x)) + shared_mlp(norm(x)))]
           -> norm -> head / logits_scaling                 (r: residual_multiplier)
    mixer:  attention (softmax scale attention_multiplier, no positions unless the config asks RoPE)
            or models/mamba2.py's Mamba2 mixer, per layer_types

The experts are models/moe.py's (a router's softmax over top-k logits is the renormalized top-k of
the softmax). An attention layer's K and V take paged blocks; a Mamba layer's states take the
request's state slot (models/kv_layout.py: a hybrid layout). Attribute names follow HF's
checkpoints (self_attn, mamba, block_sparse_moe, shared_mlp) but for the fused projections: the
loader reads the router from block_sparse_moe.router.layer, the stacked experts from its
input_linear (each expert's gate rows, then up) and output_linear, and the shared MLP's gate_up_proj
and down_proj from shared_mlp.input_linear and output_linear (models/loader.py).
"""
import jax.numpy as jnp
from flax import nnx

from jaxllm.models.config import ModelArchConfig
from jaxllm.models.kv_layout import model_kv_layout
from jaxllm.models.llama import MLP, Attention, Embed, LlamaForCausalLM, RMSNorm
from jaxllm.models.mamba2 import Mamba2Mixer
from jaxllm.models.moe import SparseMoeBlock
from jaxllm.sharding import param_mesh


class ScaledEmbed(Embed):
    """The embeddings times a constant (in the model's dtype, as HF)."""

    def __init__(self, vocab_size, hidden_size, multiplier: float, *, dtype, rngs):
        super().__init__(vocab_size, hidden_size, dtype=dtype, rngs=rngs)
        self.multiplier = multiplier

    def __call__(self, ids):
        return super().__call__(ids) * jnp.asarray(self.multiplier, self.embedding.dtype)


class GraniteDecoderLayer(nnx.Module):
    def __init__(self, config: ModelArchConfig, layer: int, *, dtype, rngs, mesh=None):
        self.kv_group, self.kv_tensor = model_kv_layout(config).layer_slot(layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        if config.mamba is not None and layer in config.mamba.layers:
            self.mamba, self.self_attn = Mamba2Mixer(config, dtype=dtype, rngs=rngs), None
        else:
            self.mamba, self.self_attn = None, Attention(config, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.block_sparse_moe = None if config.moe is None else SparseMoeBlock(config, dtype=dtype, rngs=rngs,
                                                                                mesh=mesh)
        self.shared_mlp = MLP(config, dtype=dtype, rngs=rngs)
        self.residual_multiplier = config.granite.residual_multiplier

    def __call__(self, x, cos, sin, kv_cache, md, attn_fn):
        """x [T, hidden]; kv_cache: this layer's (K, V) blocks or (conv, SSM) state slots; md: its group's."""
        h = self.input_layernorm(x)
        if self.mamba is not None:
            h, kv_cache = self.mamba(h, kv_cache, md)
        else:
            h, kv_cache = self.self_attn(h, cos, sin, kv_cache, md, attn_fn)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        y = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            y = self.block_sparse_moe(h) + y
        return x + y * self.residual_multiplier, kv_cache


class GraniteHybridForCausalLM(LlamaForCausalLM):
    """mesh: where the experts run per device (None: one device)."""

    def __init__(self, config: ModelArchConfig, *, dtype, rngs: nnx.Rngs, mesh=None):
        self.mesh = mesh
        super().__init__(config, dtype=dtype, rngs=rngs)
        self.embed_tokens = ScaledEmbed(config.vocab_size, config.hidden_size, config.granite.embedding_multiplier,
                                        dtype=dtype, rngs=rngs)

    def decoder_layer(self, config: ModelArchConfig, layer: int, *, dtype, rngs) -> GraniteDecoderLayer:
        return GraniteDecoderLayer(config, layer, dtype=dtype, rngs=rngs, mesh=param_mesh(self.mesh, ("layers", layer)))

    def rope(self, positions):
        """Without RoPE ("nope"), the rotation by angle 0: attention sees no positions."""
        if self.config.granite.rope:
            return super().rope(positions)
        shape = (positions.shape[0], self.config.head_dim // 2)
        return jnp.ones(shape, jnp.float32), jnp.zeros(shape, jnp.float32)

    def compute_logits(self, hidden):
        return super().compute_logits(hidden) / self.config.granite.logits_scaling
