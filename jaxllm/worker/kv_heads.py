"""Tensor parallelism over more devices than KV heads: each KV head is repeated until
there is one per device, as vLLM does, so device d holds the KV head its q heads read.

    4 devices, 8 q heads, 2 KV heads: repeat 2 -> KV heads [h0, h0, h1, h1]; device d
    has q heads 2d, 2d + 1 (which read h0 for d < 2, h1 after) and KV head d // 2.

The model is built with the repeated count and the loader's K/V projections are repeated
to match, lazily: a device's slice of the repeated rows is read from the original head's
rows. The loader packs them into qkv_proj by repeated KV head: group d holds q heads
d*g' .. d*g' + g' - 1 (g' = num_heads / tp) and repeated head d, a copy of original
head d // repeat, which is the head those q heads read (i // g' // repeat == i // g).
The KV cache holds one head per device.
"""
import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from jaxllm.models.config import ModelArchConfig
from jaxllm.models.tensor_sources import Index, TensorSource

# A K or V projection's tensors whose rows are its heads' (or blocks of them): a quantized one's too
# (models/quant_checkpoint.py), but for those all its heads share (input_scale, input_perm).
_KV_PROJECTIONS = tuple(f".{proj}.{leaf}" for proj in ("k_proj", "v_proj")
                        for leaf in ("weight", "bias", "weight_scale", "weight_packed", "weight_zero"))


def kv_head_repeat(arch: ModelArchConfig, tensor_parallel_size: int) -> int:
    """How many copies of each KV head tensor parallelism needs (1: none)."""
    return max(tensor_parallel_size // arch.num_kv_heads, 1)


def replicated_arch(arch: ModelArchConfig, repeat: int) -> ModelArchConfig:
    return arch if repeat == 1 else dataclasses.replace(arch, num_kv_heads=arch.num_kv_heads * repeat)


def replicate_kv_weights(weights: Iterable[tuple[str, TensorSource]], num_kv_heads: int,
                         repeat: int) -> Iterator[tuple[str, TensorSource]]:
    """The HF-named weights with each K/V projection's heads repeated: a weight
    [kv_heads * head_dim, hidden] reads as [kv_heads * repeat * head_dim, hidden], a bias likewise
    (and a quantized projection's scales, whose rows may be blocks of a head's)."""
    for name, source in weights:
        if repeat > 1 and name.endswith(_KV_PROJECTIONS):
            source = RepeatedHeads(source, source.shape[0] // num_kv_heads, repeat)  # rows per head
        yield name, source


class RepeatedHeads:
    """A K/V projection source [kv_heads * head_dim, ...] seen with each head repeated
    `repeat` times: [kv_heads * repeat * head_dim, ...] (head_dim: a head's rows)."""

    def __init__(self, source: TensorSource, head_dim: int, repeat: int):
        self.source, self.head_dim, self.repeat = source, head_dim, repeat
        self.shape = (source.shape[0] * repeat, *source.shape[1:])
        self._last_read = (None, None)  # (index, rows): the devices holding one head's copies come in a row

    def __getitem__(self, index: Index) -> np.ndarray:
        rows, rest = index[0], tuple(index[1:])
        repeated = np.arange(*rows.indices(self.shape[0]))
        # head_dim 2, repeat 2: repeated rows [0, 1, 2, 3, 4, 5, 6, 7] -> original [0, 1, 0, 1, 2, 3, 2, 3]
        original = repeated // (self.repeat * self.head_dim) * self.head_dim + repeated % self.head_dim
        low, high = int(original.min()), int(original.max()) + 1
        read_index = (slice(low, high), *rest)  # one read of the rows it needs
        key = tuple(s.indices(n) for s, n in zip(read_index, self.source.shape))
        if self._last_read[0] != key:
            self._last_read = (key, np.asarray(self.source[read_index]))
        block = self._last_read[1]
        if np.array_equal(original, np.arange(low, high)):
            return block  # a device's shard within one head's copy: the rows as read
        return block[original - low]
