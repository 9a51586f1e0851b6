"""EAGLE draft heads (speculative_config method "eagle" and "eagle3"): a decoder layer that
reads the target's hidden states beside the next token's embedding and guesses the token after
(Li et al., EAGLE, 2024, and EAGLE-3, 2025; layouts and formulas as vLLM loads the checkpoints).

EAGLE-1 ("eagle"), at position p, from the target's last hidden state f_p (after its final norm)
and the token t_{p+1}:

    x = fc([embed(t_{p+1}); f_p])          [2H] -> [H], embed: the target's
    x = N x decoder layer(x)               the first without its input norm
    logits = the target's LM head(x)       and x stands in for f_{p+1} at the next draft

EAGLE-3 ("eagle3"), from the residual stream entering three of the target's layers, side by
side (g_p [3 * target H]):

    f = fc(g_p)                                              [3 target H] -> [H], once
    x = [input_norm(embed(t_{p+1})); hidden_norm(f)]         [2H]: attention's q, k, v read both
    r = f + attn(x);  h = r + mlp(post_attention_norm(r))    (r = hidden_norm(f) + attn(x) with
                                                             the config's norm_before_residual)
    logits = lm_head(norm(h))                                over a draft vocabulary; draft id
                                                             i is target id i + d2t[i]
    and h (before the norm) stands in for f at the next draft.

Checkpoint names are the heads' own: no "model." prefix (the loader adds it, eagle_weights),
EAGLE-3's layer is "midlayer". The heads read the target's embedding unless theirs is of
another width, and EAGLE-1 the target's LM head.
"""
from collections.abc import Iterable, Iterator

import jax.numpy as jnp
from flax import nnx

from jaxllm.models.eagle_config import EagleArchConfig
from jaxllm.models.llama import MLP, Attention, DecoderLayer, Embed, Linear, RMSNorm, dot, rope_cos_sin


def eagle_weights(weights: Iterable[tuple[str, object]], config: EagleArchConfig) -> Iterator[tuple[str, object]]:
    """An EAGLE checkpoint's (name, tensor) pairs as the loader names them ("model." before all but
    lm_head; EAGLE-3's layer "midlayer", which some checkpoints call "layers.0"), without what the
    head takes from the target (its embedding, EAGLE-1's LM head) and without t2d (d2t's inverse)."""
    for name, source in weights:
        name = name.removeprefix("model.")
        if config.architecture == "eagle3" and name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        if (name == "t2d" or (name == "embed_tokens.weight" and not config.own_embedding)
                or (name == "lm_head.weight" and config.architecture == "eagle")):
            continue
        yield (name if name.startswith("lm_head.") else "model." + name), source


class Identity(nnx.Module):
    """In place of EAGLE-1's first input norm, which its heads do not have."""

    def __call__(self, x):
        return x


class EagleHead(nnx.Module):
    """EAGLE-1: fc over [embedding; target hidden], then N Llama decoder layers."""
    embed_tokens = None  # the target's

    def __init__(self, config: EagleArchConfig, *, dtype, rngs: nnx.Rngs):
        h = config.hidden_size
        self.config = config
        self.fc = Linear(2 * h, h, (None, "embed"), bias=config.fc_bias, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_layers)])
        self.layers[0].input_layernorm = Identity()  # fc's output enters the first attention as is

    def combine(self, target_hidden):
        """The target's hidden states [T, H] (after its final norm) as the head reads them: as they are."""
        return target_hidden

    def __call__(self, embeds, hidden, positions, kv_caches, md, attn_fn):
        """embeds [T, H]: each position's next token's embedding; hidden [T, H]: the state at each position
        (combine's, or the head's own from the draft before); positions [T] int32; kv_caches: the head's,
        per KV tensor (k_cache, v_cache); md: its AttentionMetadata. Returns (the state the logits
        read [T, H], the state the next draft reads [T, H], kv_caches)."""
        cos, sin = rope_cos_sin(self.config, positions)
        x = self.fc(jnp.concatenate([embeds, hidden], axis=-1))
        kv_caches = list(kv_caches)
        for layer in self.layers:
            t = layer.kv_tensor
            x, kv_caches[t] = layer(x, cos, sin, kv_caches[t], md.group(layer.kv_group), attn_fn)
        return x, x, kv_caches

    def compute_logits(self, x, target_head):
        """x [n, H] -> logits [n, vocab] float32, through the target's LM head target_head [H, vocab]."""
        return dot(x, target_head, jnp.float32)

    def target_ids(self, draft_ids):
        return draft_ids


class Eagle3Layer(nnx.Module):
    """EAGLE-3's decoder layer: attention over the normed embedding and the normed hidden state side by side."""

    def __init__(self, config: EagleArchConfig, *, dtype, rngs: nnx.Rngs):
        h, eps = config.hidden_size, config.rms_norm_eps
        self.kv_group, self.kv_tensor = 0, 0
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(h, eps, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(h, eps, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(config, 0, dtype=dtype, rngs=rngs, in_dim=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, embeds, hidden, cos, sin, kv_cache, md, attn_fn):
        """embeds, hidden [T, H] -> ([T, H] before the final norm, (k_cache, v_cache))."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        h, kv_cache = self.self_attn(jnp.concatenate([self.input_layernorm(embeds), normed], axis=-1),
                                     cos, sin, kv_cache, md, attn_fn)
        x = residual + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class Eagle3Head(nnx.Module):
    """EAGLE-3: fc over three target states, one Eagle3Layer, its own norm and LM head over a draft vocabulary."""

    def __init__(self, config: EagleArchConfig, *, dtype, rngs: nnx.Rngs):
        h = config.hidden_size
        self.config = config
        self.embed_tokens = Embed(config.vocab_size, h, dtype=dtype, rngs=rngs) if config.own_embedding else None
        self.fc = Linear(3 * config.target_hidden_size, h, (None, "embed"), bias=config.fc_bias, dtype=dtype,
                         rngs=rngs)
        self.midlayer = Eagle3Layer(config, dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.lm_head = Linear(h, config.draft_vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs)
        self.d2t = (nnx.Param(jnp.zeros(config.draft_vocab_size, jnp.int32), out_sharding=(None,),
                              eager_sharding=False) if config.has_d2t else None)

    def combine(self, target_hidden):
        """The target's three states [T, 3 * target H] -> [T, H]."""
        return self.fc(target_hidden)

    def __call__(self, embeds, hidden, positions, kv_caches, md, attn_fn):
        """EagleHead.__call__'s interface: the logits read the normed state, the next draft the state before it."""
        cos, sin = rope_cos_sin(self.config, positions)
        x, kv = self.midlayer(embeds, hidden, cos, sin, kv_caches[0], md.group(0), attn_fn)
        return self.norm(x), x, [kv]

    def compute_logits(self, x, target_head):
        """x [n, H] -> logits [n, draft_vocab_size] float32 (its own LM head; target_head is not read)."""
        return dot(x, self.lm_head.kernel[...], jnp.float32)

    def target_ids(self, draft_ids):
        """Draft vocabulary ids [n] -> the target's."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[...][draft_ids]


EAGLE_HEADS = {"eagle": EagleHead, "eagle3": Eagle3Head}
