"""The paged KV cache on the mesh: how many blocks the memory budget holds, and the caches
themselves, per KV tensor the arrays its KVCacheSpec names (models/kv_layout.py): (K, V)
[num_blocks, block_size, kv_heads, head_dim], sharded over KV heads; latent attention's (latent,)
[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim], replicated; or a Mamba2 model's
state slots (conv [num_blocks, conv_kernel - 1, conv_dim], SSM [num_blocks, heads, head_dim,
state_size]) in the model's dtype, one slot per running request. A block id means one block in
one layer of each KV cache group (models/kv_layout.py), and in each of a draft model's KV
tensors (worker/draft_model.py). A hybrid model's Mamba tensors hold num_state_slots state slots
(max_num_seqs: one per running request), apart from the blocks, which the budget left takes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import distributed
from jaxllm.config import Config
from jaxllm.kernels.ssd import max_chunks
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.kv_layout import KVCacheLayout, KVCacheSpec, model_kv_specs
from jaxllm.sample.processors import ProcessorState
from jaxllm.utils import cdiv

_CPU_KV_CACHE_BYTES = 512 << 20  # CPU devices report no memory: cap the cache at 512 MiB


class KVCache:
    def __init__(self, config: Config, arch: ModelArchConfig, layout: KVCacheLayout, mesh: jax.sharding.Mesh,
                 draft: tuple[ModelArchConfig, KVCacheLayout] | None = None):
        """Sizes the cache from the memory left once the weights are on the devices. draft: a draft
        model's architecture and layout, whose KV tensors (`draft_caches`) take the same block ids."""
        self.config, self.arch, self.layout, self.mesh = config, arch, layout, mesh
        self._models = [(arch, layout)] + ([draft] if draft else [])
        self.block_size = config.cache.block_size
        self._specs = [model_kv_specs(a, self.block_size) for a, _ in self._models]  # per model, per KV tensor
        # Blocks per block id in each model's tensors: the draft's groups each take one (draft_model.py).
        self._blocks_per_id = [1] + ([len(draft[1].groups)] if draft else [])
        self.num_state_slots = config.scheduler.max_num_seqs if layout.hybrid else 0
        self._state_tensors = layout.state_tensors()  # the target's tensors of num_state_slots rows
        self.num_blocks = self._num_blocks()
        if self.num_blocks < self.blocks_per_request():
            raise ValueError(
                f"the KV cache has {self.num_blocks} blocks, fewer than one request of max_model_len "
                f"({config.model.max_model_len}) tokens takes ({self.blocks_per_request()}): raise "
                "gpu_memory_utilization or num_gpu_blocks_override, or lower max_model_len")
        self.caches: list[tuple[jax.Array, ...]] | None = None
        self.draft_caches: list[tuple[jax.Array, ...]] | None = None
        self.shardings = [spec.shardings(mesh) for spec in self._specs[0]]  # the target's, per KV tensor
        # Compiled once and kept: a cache made again (after a failed step, a wake-up) compiles nothing.
        self._zeros_made: dict[tuple[KVCacheSpec, int], tuple] = {}
        self._zeros = [[self._zeros_fns(spec, self._rows(m, t)) for t, spec in enumerate(specs)]
                       for m, specs in enumerate(self._specs)]

    def _rows(self, model: int, tensor: int) -> int:
        """The leading dimension of a model's KV tensor: its state slots, or its blocks."""
        if model == 0 and tensor in self._state_tensors:
            return self.num_state_slots
        return self.num_blocks * self._blocks_per_id[model]

    def _zeros_fns(self, spec: KVCacheSpec, rows: int) -> tuple:
        """Compiled makers of a tensor's zeroed arrays (one per spec and size: every layer shares them)."""
        if (spec, rows) not in self._zeros_made:
            dtypes = self.config.cache.cache_dtype, self.config.model.dtype
            self._zeros_made[spec, rows] = tuple(
                jax.jit(functools.partial(jnp.zeros, a.shape, a.dtype), out_shardings=sharding).lower().compile()
                for a, sharding in zip(spec.arrays(rows, *dtypes), spec.shardings(self.mesh)))
        return self._zeros_made[spec, rows]

    @property
    def bytes_per_block(self) -> int:
        """A block id holds one block in each KV tensor (a layer of each group), the draft's too."""
        dtypes = self.config.cache.cache_dtype, self.config.model.dtype
        return sum(blocks * spec.bytes_per_block(*dtypes) for m, (specs, blocks) in enumerate(zip(self._specs,
                   self._blocks_per_id)) for t, spec in enumerate(specs) if m or t not in self._state_tensors)

    @property
    def state_bytes(self) -> int:
        """A hybrid model's state slots (0 for any other model)."""
        dtypes = self.config.cache.cache_dtype, self.config.model.dtype
        return self.num_state_slots * sum(self._specs[0][t].bytes_per_block(*dtypes) for t in self._state_tensors)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override:
            return cache.num_gpu_blocks_override
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            budget = (stats["bytes_limit"] * cache.gpu_memory_utilization - stats["bytes_in_use"]
                      - self._activation_bytes() - self._processor_state_bytes() - self.state_bytes)
        else:
            budget = min(_CPU_KV_CACHE_BYTES,
                         self.config.scheduler.max_num_seqs * self.blocks_per_request() * self.bytes_per_block)
        num_blocks = max(int(budget // self.bytes_per_block), 0)
        if all(group.mamba for group in self.layout.groups):  # a state slot per running request, no more
            num_blocks = min(num_blocks, self.config.scheduler.max_num_seqs)
        if jax.process_count() > 1:  # every host schedules alike: the same cache on each (the smallest)
            from jax.experimental import multihost_utils
            distributed.barrier("jaxllm-weights-loaded")
            num_blocks = int(np.min(multihost_utils.process_allgather(np.int32(num_blocks))))
        return num_blocks

    def blocks_per_request(self) -> int:
        """The most blocks one request of max_model_len tokens holds, over every KV cache group: a
        sliding window's group holds its window and a prefill chunk (a bound)."""
        sc = self.config.scheduler
        full = cdiv(sc.max_model_len, self.block_size)
        slots = 0 if self.layout.hybrid else 1  # a hybrid model's state slot is not a block
        return sum(slots if group.mamba else full if group.sliding_window is None else
                   min(full, cdiv(group.sliding_window + sc.max_num_batched_tokens, self.block_size) + 1)
                   for group in self.layout.groups)

    def _activation_bytes(self) -> int:
        """A generous bound on the step's transient memory at the largest bucket."""
        arch, sc = self.arch, self.config.scheduler
        tokens = sc.max_num_batched_tokens
        per_token = 4 * (4 * arch.hidden_size + 3 * arch.intermediate_size
                         + 2 * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim)
        if arch.moe is not None:  # a token's k rows through the experts: copied, sorted, sent, combined in fp32
            per_token += 4 * arch.moe.top_k * (4 * arch.hidden_size + 3 * arch.moe.intermediate_size)
        if arch.mla is not None:  # latent attention in fp32: absorbed queries, accumulator, output, a gathered block
            per_token += 4 * arch.mla.latent_dim * (3 * arch.num_heads + self.block_size)
        logits = 4 * min(tokens, sc.max_num_seqs) * arch.vocab_size * 4
        return 2 * (tokens * per_token + logits + self._ssd_bytes()) + (256 << 20)

    def _ssd_bytes(self) -> int:
        """A Mamba layer's SSD scan at the largest bucket (kernels/ssd.py), in fp32: a few [chunks, Q, Q,
        heads] products and [chunks, heads, head_dim, state_size] states, and the requests' states."""
        m, sc = self.arch.mamba, self.config.scheduler
        if m is None:
            return 0
        tokens, reqs = sc.max_num_batched_tokens, min(sc.max_num_seqs, sc.max_num_batched_tokens)
        q = min(m.chunk_size, tokens)
        chunks = max_chunks(tokens, reqs, q)
        state = m.num_heads * m.head_dim * m.state_size
        return 4 * 4 * (chunks * q * q * m.num_heads + (chunks + reqs) * state)

    def _processor_state_bytes(self) -> int:
        return ProcessorState.nbytes(self.config.scheduler.max_num_seqs, self.config.model.arch.vocab_size)

    def allocate(self) -> None:
        """Zeroed caches on the mesh (a block's old contents never matter: a step writes a
        slot before any step reads it)."""
        self.caches, *draft = jax.block_until_ready(
            [[tuple(zeros() for zeros in per_tensor) for per_tensor in model] for model in self._zeros])
        self.draft_caches = draft[0] if draft else None

    def delete(self) -> None:
        """Free the caches' memory now (those a failed step consumed are gone already)."""
        for array in jax.tree.leaves([self.caches or [], self.draft_caches or []]):
            if not array.is_deleted():
                array.delete()
        self.caches = self.draft_caches = None
