"""Which layers share a block table, and which KV tensors they write: a model's KV cache groups.

Layers of one attention type (full, or one sliding window) form groups of equal size,
vLLM's hybrid layout. Each group has its own block table, and the j-th layer of
every group stores its K/V in KV tensor j, so a block id means one block in one
layer of each group. A group of sliding-window layers gives back the blocks that
fall out of its window, and another group (or request) takes them.

    Gemma 3 270M: 18 layers, full attention at 5, 11, 17 -> groups of 3 layers:
    (5, 11, 17) full, (0, 1, 2) (3, 4, 6) ... (14, 15, 16) sliding: 6 groups, 3 tensors.
    Llama: one group of every layer, one tensor per layer.

A group of Mamba layers (vLLM's MambaSpec) holds one block per request, whatever its length: its
state slot, which indexes each layer's fixed-size states (models/mamba_config.py) instead of K/V.
    Mamba2: one group of every layer, one state tensor (conv x, conv B and C, SSM) per layer.

A hybrid model (Granite 4.0-H: attention and Mamba layers) has its attention layers' groups as
above, then one Mamba group whose layers' states are KV tensors of their own, after the attention
ones. Its state slots come from a pool of their own, one per running request (max_num_seqs), not
from the blocks (a state is some hundred times an attention block of a layer), so the tensors of
one model hold arrays of two sizes: [num_blocks, ...] K and V, [num_state_slots, ...] states.
    Granite 4.0-H Tiny: attention at 5, 15, 25, 35 -> group (5, 15, 25, 35) in tensors 0-3;
    the 36 other layers a Mamba group in tensors 4-39.

What each KV tensor holds is the model's KVCacheSpec: K and V for attention, multi-head latent
attention's one latent a token (DeepSeek-V3: 576 values where its 128 heads' K and V would take
40,960), or a Mamba layer's states. The scheduler sees blocks only: a latent layer's blocks are
full attention's.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxllm.sharding import replicated, split_over_model


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    sliding_window: int | None  # None: full attention
    layers: tuple[int, ...]
    mamba: bool = False  # Mamba layers: a request's one block is its state slot
    first_tensor: int = 0  # the KV tensor of its first layer (a hybrid model's Mamba group's follow attention's)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """What one KV tensor holds per block id: an array [num_blocks, *shape] for each of `shapes`.
    Attention's K and V ([block_size, kv_heads, head_dim] each), split over the KV heads; latent
    attention's one latent a token ([block_size, 1, kv_lora_rank + qk_rope_head_dim]), which every
    head reads: replicated; a Mamba layer's state slot (models/mamba_config.py state_shapes: the conv's
    x inputs and SSM state split over the heads, its B and C inputs replicated), in the model's dtype
    rather than the cache's; an n-gram drafter's token ids ([block_size] int32:
    worker/ngram_drafter.py), replicated."""
    shapes: tuple[tuple[int, ...], ...]
    # Per array, its axis (of [num_blocks, *shape]) split over the mesh's "model" axis, or None
    # (replicated); () replicates every array.
    split_axes: tuple[int | None, ...] = ()
    model_dtype: bool = False  # the arrays in the model's dtype (Mamba's states), not the KV cache's
    dtype: str | None = None   # a dtype of their own (token ids' "int32"), whatever the cache's and the model's

    def arrays(self, num_blocks: int, cache_dtype, model_dtype) -> list[jax.ShapeDtypeStruct]:
        dtype = self.dtype or (model_dtype if self.model_dtype else cache_dtype)
        return [jax.ShapeDtypeStruct((num_blocks, *shape), dtype) for shape in self.shapes]

    def bytes_per_block(self, cache_dtype, model_dtype, model_devices: int = 1) -> int:
        """A block id's bytes: in all, or on each of `model_devices` devices of the mesh's "model" axis."""
        split = self.split_axes or (None,) * len(self.shapes)
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize // (1 if axis is None else model_devices)
                   for a, axis in zip(self.arrays(1, cache_dtype, model_dtype), split))

    def shardings(self, mesh) -> tuple:
        """The arrays' NamedShardings on `mesh`."""
        split = self.split_axes or (None,) * len(self.shapes)
        return tuple(replicated(mesh) if axis is None else split_over_model(mesh, len(shape) + 1, axis)
                     for shape, axis in zip(self.shapes, split))


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]  # the full-attention groups first
    num_tensors: int  # KV tensors: a group's j-th layer uses tensor first_tensor + j

    @property
    def hybrid(self) -> bool:
        """Attention and Mamba groups both: the Mamba groups' state slots are a pool of their own."""
        return any(g.mamba for g in self.groups) and not all(g.mamba for g in self.groups)

    def layer_slot(self, layer: int) -> tuple[int, int]:
        """(group, tensor) of layer `layer`."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.first_tensor + group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV cache group")

    def state_tensors(self) -> range:
        """The KV tensors a hybrid layout's Mamba group holds its states in (none otherwise)."""
        if not self.hybrid:
            return range(0)
        group = next(g for g in self.groups if g.mamba)
        return range(group.first_tensor, group.first_tensor + len(group.layers))


def model_kv_spec(config, block_size: int) -> KVCacheSpec:
    """What a ModelArchConfig's KV tensors hold, in blocks of `block_size` tokens (a hybrid model's:
    model_kv_specs)."""
    if config.mamba is not None:
        return _state_spec(config)
    if config.mla is not None:
        return KVCacheSpec(((block_size, 1, config.mla.latent_dim),))
    return _attention_spec(config, block_size)


def _attention_spec(config, block_size: int) -> KVCacheSpec:
    return KVCacheSpec(((block_size, config.num_kv_heads, config.head_dim),) * 2, split_axes=(2, 2))


def _state_spec(config) -> KVCacheSpec:
    return KVCacheSpec(config.mamba.state_shapes, split_axes=(2, None, 1), model_dtype=True)


def model_kv_specs(config, block_size: int) -> tuple[KVCacheSpec, ...]:
    """What each of a ModelArchConfig's KV tensors holds: a hybrid model's attention tensors K and V, its
    Mamba tensors states; any other model's the one spec of model_kv_spec."""
    layout = model_kv_layout(config)
    if not layout.hybrid:
        return (model_kv_spec(config, block_size),) * layout.num_tensors
    attention = _attention_spec(config, block_size)
    states = layout.state_tensors()
    return tuple(_state_spec(config) if t in states else attention for t in range(layout.num_tensors))


def model_kv_layout(config) -> KVCacheLayout:
    """The layout of a ModelArchConfig's layers: each layer's sliding window decides its group; Mamba
    layers form one Mamba group (after the attention layers' groups and tensors, in a hybrid model)."""
    if config.mamba is None:
        return kv_cache_layout([config.layer_sliding_window(i) for i in range(config.num_layers)])
    mamba_layers = config.mamba.layers
    if len(mamba_layers) == config.num_layers:
        return KVCacheLayout((KVCacheGroup(None, mamba_layers, mamba=True),), config.num_layers)
    attention = [i for i in range(config.num_layers) if i not in mamba_layers]
    inner = kv_cache_layout([config.layer_sliding_window(i) for i in attention])  # over attention's layers
    groups = tuple(dataclasses.replace(g, layers=tuple(attention[i] for i in g.layers)) for g in inner.groups)
    mamba = KVCacheGroup(None, mamba_layers, mamba=True, first_tensor=inner.num_tensors)
    return KVCacheLayout((*groups, mamba), inner.num_tensors + len(mamba_layers))


def kv_cache_layout(sliding_windows: list[int | None]) -> KVCacheLayout:
    """The groups of layers with per-layer windows `sliding_windows` (None: full attention).
    The group size is the smallest count of layers of one type, so no tensor goes unused
    by the smallest type; larger types split into several groups of that size (the last
    may be smaller)."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(sliding_windows):
        by_window.setdefault(window, []).append(layer)
    if not by_window:
        raise ValueError("a model needs at least one layer")
    size = min(len(layers) for layers in by_window.values())
    groups = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        layers = by_window[window]
        groups += [KVCacheGroup(window, tuple(layers[i:i + size])) for i in range(0, len(layers), size)]
    return KVCacheLayout(tuple(groups), size)
