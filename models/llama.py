"""One Flax NNX decoder for the Llama family, Mistral, Qwen2 and Qwen3.

    tokens -> embed -> N x [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> head

The four differ only in flags from ModelArchConfig: qkv bias (Qwen2), q/k RMSNorm
(Qwen3), sliding window (Mistral, Qwen when enabled), rope scaling (Llama 3.1), tied
embeddings. Attribute names follow HF's checkpoints (embed_tokens, self_attn.o_proj, ...),
except two fused projections, one matmul each where HF has several: self_attn.qkv_proj
(q_proj, k_proj, v_proj) and mlp.gate_up_proj (gate_proj, up_proj), which the loader
packs from HF's tensors. Linear kernels are stored [in, out].

Every param carries its logical axes as `out_sharding` metadata; jaxllm.sharding's
rules turn them into mesh placements. Params are in the model dtype; RMSNorm and
RoPE compute in fp32 (as does softmax, inside every attention backend). Layers are unrolled (a Python loop, no lax.scan:
scanning over stacked weights streamed them 2.5x slower at decode on the H200).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.kernels import batch_invariant
from jaxllm.kernels.attention import AttentionMetadata, write_kv
from jaxllm.models import fp8
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.kv_layout import model_kv_layout
from jaxllm.models.lora import LayerLoRA, LoRABatch
from jaxllm.models.yarn import yarn_attention_factor, yarn_inv_freq
from jaxllm.sharding import logical_to_spec, per_device_linear, sum_in_device_order

INIT_STD = 0.02  # HF's initializer_range; keeps random-weight activations sane


def dot(x, kernel, out_dtype=None, axes: tuple[str | None, ...] | None = None):
    """x [..., in] @ kernel [in, *out] -> [..., *out], batch-invariant when the runner asks
    (kernels/batch_invariant.py). axes: the kernel's logical axes (in, *out), by which the
    invariant matmul runs per device under tensor parallelism (without them XLA would gather
    the kernel whole onto every device: a Pallas call is one custom call it cannot split)."""
    if not batch_invariant.enabled():
        return jnp.tensordot(x, kernel, axes=1, preferred_element_type=out_dtype)
    out_dtype = out_dtype or x.dtype
    rows, mesh = x.reshape(-1, x.shape[-1]), batch_invariant.tensor_parallel_mesh()
    if mesh is None or axes is None:
        y = _invariant_matmul(rows, kernel, out_dtype)
    else:
        # Row-parallel (in split): each device's float32 partial, added in device order, then cast.
        partial_dtype = jnp.float32 if logical_to_spec(axes)[0] is not None else out_dtype
        per_device = per_device_linear(functools.partial(_invariant_matmul, out_dtype=partial_dtype), mesh, axes,
                                       sum_in_order=True)
        plain = lambda a, w: jnp.tensordot(a, w, axes=1, preferred_element_type=partial_dtype)
        y = batch_invariant.with_plain_gradient(per_device, plain)(rows, kernel).astype(out_dtype)
    return y.reshape(*x.shape[:-1], *kernel.shape[1:])


def _invariant_matmul(rows, kernel, out_dtype):
    """rows [T, in] @ kernel [in, *out] -> [T, *out] by the batch-invariant matmul."""
    y = batch_invariant.matmul(rows, kernel.reshape(kernel.shape[0], -1), out_dtype)
    return y.reshape(rows.shape[0], *kernel.shape[1:])


def rms_normalize(x32, eps: float):
    """x32 / rms(x32) over the last axis (float32)."""
    if batch_invariant.enabled():
        return batch_invariant.rms_normalize(x32, eps)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _param(rngs: nnx.Rngs, shape, axes, dtype, *, ones=False) -> nnx.Param:
    """A param with its logical axes. eager_sharding=False: placement happens in the
    loader, from the rules, not when the module is built."""
    value = jnp.ones(shape, dtype) if ones else INIT_STD * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, *out] with logical axes (in_axis, *out_axes).
    An out of several axes (gate_up's [2, intermediate]) stays so in y [..., *out]: a
    device's shard of the kernel gives its shard of y, with no reshape across devices."""

    def __init__(self, in_dim, out_dim: int | tuple[int, ...], axes, *, bias=False, dtype, rngs):
        out_shape = out_dim if isinstance(out_dim, tuple) else (out_dim,)
        self.kernel = _param(rngs, (in_dim, *out_shape), axes, dtype)
        self.bias = _param(rngs, out_shape, axes[1:], dtype) if bias else None

    def __call__(self, x):
        y = dot(x, self.kernel[...], axes=self.kernel.get_metadata().get("out_sharding"))
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    """x / rms(x) * weight over the last axis, normalised in fp32 (as HF: the weight
    multiplies after the cast back to the input dtype)."""

    def __init__(self, dim, eps, *, dtype, rngs):
        self.weight = _param(rngs, (dim,), ("norm",), dtype, ones=True)
        self.eps = eps

    def __call__(self, x):
        return self.weight[...] * rms_normalize(x.astype(jnp.float32), self.eps).astype(x.dtype)


def rope_inv_freq(config: ModelArchConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, with linear, Llama 3.1 or YaRN scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend between.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = np.where(wavelen > old_len / low, inv_freq / factor,
                            np.where(wavelen < old_len / high, inv_freq, blended))
    elif rope_type == "yarn":
        inv_freq = yarn_inv_freq(dim, config.rope_theta, scaling)
    return inv_freq.astype(np.float32)


def rope_cos_sin(config: ModelArchConfig, positions):
    """cos, sin [num_tokens, head_dim // 2] fp32 of positions [num_tokens] int32 (times YaRN's attention factor)."""
    angles = positions.astype(jnp.float32)[:, None] * rope_inv_freq(config)[None, :]
    scaling = config.rope_scaling or {}
    factor = yarn_attention_factor(scaling) if scaling.get("rope_type") == "yarn" else 1.0
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x, cos, sin):
    """Rotate-half (GPT-NeoX / HF) RoPE. x [num_tokens, heads, head_dim]; cos, sin
    [num_tokens, head_dim // 2] fp32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelArchConfig, layer: int, *, dtype, rngs, in_dim: int | None = None):
        """in_dim: the width q, k and v are computed from (default hidden_size; an EAGLE-3 head's is 2x)."""
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.sliding_window, self.scale = c.layer_sliding_window(layer), c.attn_scale
        q_dim, group_dim = c.num_heads * c.head_dim, (c.num_heads // c.num_kv_heads + 2) * c.head_dim
        # q, k, v in one matmul, its out axis grouped by KV head: KV head j's g q heads
        # (j*g .. j*g + g - 1), then k head j, then v head j. Contiguous shards of that axis
        # are whole groups, so each device computes its own heads' q, k and v.
        self.qkv_proj = Linear(in_dim or c.hidden_size, c.num_kv_heads * group_dim, ("embed", "qkv"),
                               bias=c.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(q_dim, c.hidden_size, ("q_heads", "embed"), bias=c.o_proj_bias, dtype=dtype, rngs=rngs)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, rngs=rngs)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, cos, sin, kv_cache, md: AttentionMetadata, attn_fn, lora: LayerLoRA | None = None):
        """x [num_tokens, hidden] -> ([num_tokens, hidden], (k_cache, v_cache)); md: the layer's
        KV cache group's (AttentionMetadata.group); lora: the step's adapters (models/lora.py)."""
        n, g = x.shape[0], self.num_heads // self.num_kv_heads
        qkv = self.qkv_proj(x).reshape(n, self.num_kv_heads, g + 2, self.head_dim)
        q = qkv[:, :, :g].reshape(n, self.num_heads, self.head_dim)  # q head i is KV head i // g's
        k, v = qkv[:, :, g], qkv[:, :, g + 1]
        if lora is not None:  # HF's q_proj, k_proj and v_proj outputs, head by head
            q, k, v = (p + lora(name, x).reshape(p.shape) for p, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = write_kv(*kv_cache, k, v, md.slot_mapping)
        o = attn_fn(q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables,
                    md.num_seqs, scale=self.scale, sliding_window=self.sliding_window)
        o = o.reshape(n, self.num_heads * self.head_dim)
        out = self.o_proj(o) if lora is None else self.o_proj(o) + lora("o_proj", o)
        return out, (k_cache, v_cache)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up one matmul (gate_up_proj's kernel
    [hidden, 2, intermediate]: gate at 0, up at 1)."""
    activation = staticmethod(jax.nn.silu)

    def __init__(self, config: ModelArchConfig, *, dtype, rngs, intermediate_size: int | None = None):
        """intermediate_size: default the config's (a MoE layer's shared expert has its own)."""
        h, m = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(h, (2, m), ("embed", None, "mlp"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(m, h, ("mlp", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x, lora: LayerLoRA | None = None):
        """x [num_tokens, hidden] -> [num_tokens, hidden]; lora: the step's adapters (models/lora.py)."""
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2, intermediate]
        if lora is None and self.activation is jax.nn.silu and fp8.takes_rows(self.down_proj):
            return self.down_proj(fp8.swiglu_quantize(gate_up))  # SwiGLU and e4m3 in one kernel
        gate, up = gate_up[:, 0], gate_up[:, 1]
        if lora is None:
            return self.down_proj(self.activation(gate) * up)
        h = self.activation(gate + lora("gate_proj", x)) * (up + lora("up_proj", x))
        return self.down_proj(h) + lora("down_proj", h)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelArchConfig, layer: int, *, dtype, rngs, mlp: nnx.Module | None = None,
                 attention: nnx.Module | None = None):
        """mlp: default a dense MLP of the config's size (a MoE model's sparse layers pass their experts);
        attention: default Attention (DeepSeek's layers pass their latent attention)."""
        self.kv_group, self.kv_tensor = model_kv_layout(config).layer_slot(layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(config, layer, dtype=dtype, rngs=rngs) if attention is None else attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs) if mlp is None else mlp

    def __call__(self, x, cos, sin, kv_cache, md, attn_fn, lora: LayerLoRA | None = None):
        """lora: the step's adapters (only the Llama family's Attention and MLP take them)."""
        with_lora = {} if lora is None else {"lora": lora}
        qkv_proj = self.self_attn.qkv_proj if lora is None and isinstance(self.self_attn, Attention) else None
        gate_up_proj = self.mlp.gate_up_proj if lora is None and isinstance(self.mlp, MLP) else None
        _, normed = norm_into(self.input_layernorm, qkv_proj, x)
        h, kv_cache = self.self_attn(normed, cos, sin, kv_cache, md, attn_fn, **with_lora)
        x, normed = norm_into(self.post_attention_layernorm, gate_up_proj, h, x)
        return x + self.mlp(normed, **with_lora), kv_cache


def norm_into(norm, linear, x, residual=None):
    """(residual + x, its norm) as `linear` takes it (x alone where residual is None): in e4m3 rows from one
    kernel (models/fp8.py add_norm_quantize) where linear takes them (JAXLLM_FP8_FUSED=1) and norm is an
    RMSNorm, else norm's output."""
    if type(norm) is RMSNorm and fp8.takes_rows(linear):
        return fp8.add_norm_quantize(x, residual, norm.weight[...], norm.eps)
    x = x if residual is None else residual + x
    return x, norm(x)


class Embed(nnx.Module):
    def __init__(self, vocab_size, hidden_size, *, dtype, rngs):
        self.embedding = _param(rngs, (vocab_size, hidden_size), ("vocab", "embed"), dtype)

    def __call__(self, ids):
        """ids [num_tokens] int32 -> [num_tokens, hidden_size]."""
        table, mesh = self.embedding[...], batch_invariant.tensor_parallel_mesh()
        take = lambda t, i: jnp.take(t, i, axis=0)
        if mesh is None:
            return take(table, ids)
        # Batch-invariant under tensor parallelism: XLA's lookup in a table split over the vocabulary
        # all-reduces each device's rows (zeros but the owner's); here they are gathered and added in
        # device order, so that no float all-reduce is left in the step (tests/engine/test_jax_program.py).
        table_spec = logical_to_spec(self.embedding.get_metadata()["out_sharding"])
        lookup = jax.shard_map(_own_rows, mesh=mesh, in_specs=(table_spec, P()), out_specs=P(), check_vma=False)
        return batch_invariant.with_plain_gradient(lookup, take)(table, ids)


def _own_rows(table, ids):
    """Inside a shard_map over "model": table [vocab / devices, hidden] this device's rows, ids
    [num_tokens] int32 -> [num_tokens, hidden], each row from the device that holds it."""
    local = ids - jax.lax.axis_index("model") * table.shape[0]
    mine = (local >= 0) & (local < table.shape[0])
    rows = jnp.where(mine[:, None], jnp.take(table, jnp.clip(local, 0, table.shape[0] - 1), axis=0), 0)
    return sum_in_device_order(rows)


class LlamaForCausalLM(nnx.Module):
    decoder_layer, final_norm = DecoderLayer, RMSNorm  # what a model of the same outline (Gemma) swaps

    def __init__(self, config: ModelArchConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([self.decoder_layer(config, i, dtype=dtype, rngs=rngs)
                                for i in range(config.num_layers)])
        self.norm = self.final_norm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs)

    def __call__(self, input_ids, positions, kv_caches, md: AttentionMetadata, attn_fn,
                 aux_layers: tuple[int, ...] = (), lora: LoRABatch | None = None):
        """One step over a flattened, padded ragged batch.

        input_ids, positions: [num_tokens] int32
        kv_caches: per KV tensor (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim];
          a layer uses its tensor (model_kv_layout)
        aux_layers: layers (ascending) whose input an EAGLE-3 head reads: the residual stream entering each
        lora: the step's LoRA adapters and each token's slot (models/lora.py); None: the base model alone
        Returns (hidden [num_tokens, hidden_size], the updated kv_caches list), and with aux_layers a third
        item, those states side by side [num_tokens, len(aux_layers) * hidden_size].
        """
        with_lora = {} if lora is None else {"lora": lora}  # the Llama family's layers alone take adapters
        x, kv_caches, aux = self.decode_layers(self.embed(input_ids), positions, kv_caches, md, attn_fn,
                                               range(len(self.layers)), aux_layers, **with_lora)
        if aux_layers:
            return self.norm(x), kv_caches, jnp.concatenate(aux, axis=-1)
        return self.norm(x), kv_caches

    def rope(self, positions):
        """cos, sin [num_tokens, head_dim // 2] fp32 of positions [num_tokens] int32: what attention rotates by."""
        return rope_cos_sin(self.config, positions)

    def embed(self, input_ids):
        """input_ids [num_tokens] int32 -> the residual stream entering layer 0 [num_tokens, hidden_size]."""
        return self.embed_tokens(input_ids)

    def decode_layers(self, x, positions, kv_caches, md: AttentionMetadata, attn_fn, layers: range,
                      aux_layers: tuple[int, ...] = (), lora: LoRABatch | None = None):
        """The residual stream x [num_tokens, hidden_size] through decoder layers `layers` (all of them, or a
        pipeline stage's: worker/pipeline.py); kv_caches as __call__'s (a stage's other tensors may be
        None); lora: as __call__'s. Returns (x after them, kv_caches as a list, the states entering the
        aux_layers among them)."""
        cos, sin = self.rope(positions)
        kv_caches, aux = list(kv_caches), []
        for i in layers:
            if i in aux_layers:
                aux.append(x)
            layer = self.layers[i]
            t = layer.kv_tensor
            with_lora = {} if lora is None else {"lora": lora.layer(i)}
            x, kv_caches[t] = layer(x, cos, sin, kv_caches[t], md.group(layer.kv_group), attn_fn, **with_lora)
        return x, kv_caches, aux

    def compute_logits(self, hidden):
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        if self.lm_head is None:
            w = self.embed_tokens.embedding[...].T
        else:
            w = self.lm_head.kernel[...]
        return dot(hidden, w, jnp.float32, axes=("embed", "vocab"))
