"""Tensor parallelism over more devices than KV heads: each KV head is repeated until
there is one per device, as vLLM does, so device d holds the KV head its q heads read.

    4 devices, 8 q heads, 2 KV heads: repeat 2 -> KV heads [h0, h0, h1, h1]; device d
    has q heads 2d, 2d + 1 (which read h0 for d < 2, h1 after) and KV head d // 2.

The model is built with the repeated count and the loader's K/V projections are repeated
to match; the KV cache holds one head per device.
"""
import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from jaxllm.models.config import ModelArchConfig

_KV_PROJECTIONS = (".k_proj.weight", ".v_proj.weight", ".k_proj.bias", ".v_proj.bias")


def kv_head_repeat(arch: ModelArchConfig, tensor_parallel_size: int) -> int:
    """How many copies of each KV head tensor parallelism needs (1: none)."""
    return max(tensor_parallel_size // arch.num_kv_heads, 1)


def replicated_arch(arch: ModelArchConfig, repeat: int) -> ModelArchConfig:
    return arch if repeat == 1 else dataclasses.replace(arch, num_kv_heads=arch.num_kv_heads * repeat)


def replicate_kv_weights(weights: Iterable[tuple[str, np.ndarray]], head_dim: int,
                         repeat: int) -> Iterator[tuple[str, np.ndarray]]:
    """The HF-named weights with each K/V projection's heads repeated: a weight
    [kv_heads * head_dim, hidden] becomes [kv_heads * repeat * head_dim, hidden], a bias likewise."""
    for name, array in weights:
        if repeat > 1 and name.endswith(_KV_PROJECTIONS):
            heads = array.reshape(-1, head_dim, *array.shape[1:])
            array = np.repeat(heads, repeat, axis=0).reshape(-1, *array.shape[1:])
        yield name, array
