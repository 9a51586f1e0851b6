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
    Mamba2: one group of every layer, one state tensor pair (conv, SSM) per layer.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    sliding_window: int | None  # None: full attention
    layers: tuple[int, ...]
    mamba: bool = False  # Mamba layers: a request's one block is its state slot


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]  # the full-attention groups first
    num_tensors: int  # KV tensors: a group's j-th layer uses tensor j

    def layer_slot(self, layer: int) -> tuple[int, int]:
        """(group, tensor) of layer `layer`."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV cache group")


def model_kv_layout(config) -> KVCacheLayout:
    """The layout of a ModelArchConfig's layers: each layer's sliding window decides its group; a
    Mamba2 model's layers form one Mamba group."""
    if config.mamba is not None:
        if len(config.mamba.layers) != config.num_layers:
            raise ValueError("a model of both attention and Mamba layers is not built yet")
        return KVCacheLayout((KVCacheGroup(None, config.mamba.layers, mamba=True),), config.num_layers)
    return kv_cache_layout([config.layer_sliding_window(i) for i in range(config.num_layers)])


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
