"""The paged KV cache on the mesh: how many blocks the memory budget holds, and the caches
themselves, per KV tensor the arrays its KVCacheSpec names (models/kv_layout.py): (K, V)
[num_blocks, block_size, kv_heads, head_dim], sharded over KV heads; latent attention's (latent,)
[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim], replicated; or a Mamba2 model's
state slots (conv x [num_blocks, conv_kernel - 1, heads * head_dim] and SSM [num_blocks, heads,
head_dim, state_size], sharded over the heads; conv B and C [num_blocks, conv_kernel - 1, 2 * groups
* state_size], replicated) in the model's dtype, one slot per running request. The budget counts a
device's share of each array. A block id means one block in one layer of each KV cache group
(models/kv_layout.py), and in each of a drafter's tensors: a draft
model's KV (worker/draft_model.py), an n-gram drafter's token ids (worker/ngram_drafter.py). A
hybrid model's Mamba tensors hold num_state_slots state slots (max_num_seqs: one per running
request), apart from the blocks, which the budget left takes.

Under pipeline parallelism each stage holds the arrays of the KV tensors its layers use, on its own
mesh: `caches` lists them stage by stage (StageCaches says where each stage's run), and a block id
means the same block in every stage's arrays, so one block table serves every stage."""
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import distributed
from jaxllm.config import Config
from jaxllm.kernels.ssd import scan_bytes
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.kv_layout import KVCacheLayout, KVCacheSpec, model_kv_specs
from jaxllm.sample.processors import ProcessorState
from jaxllm.sharding import StageMeshes
from jaxllm.utils import cdiv

logger = logging.getLogger(__name__)
_CPU_KV_CACHE_BYTES = 512 << 20  # CPU devices report no memory: cap the cache at 512 MiB


@dataclasses.dataclass(frozen=True)
class StageCaches:
    """A pipeline stage's part of the cache: its mesh, and the KV tensors its layers use, whose arrays
    are KVCache.caches[start:start + len(tensors)]."""
    mesh: jax.sharding.Mesh
    tensors: tuple[int, ...]
    start: int

    @property
    def slice(self) -> slice:
        return slice(self.start, self.start + len(self.tensors))


def _stage_tensors(layout: KVCacheLayout, meshes: StageMeshes) -> list[tuple[jax.sharding.Mesh, tuple[int, ...]]]:
    """Each stage's mesh and the KV tensors its layers write. A tensor that layers of several stages share
    (a hybrid model's groups: models/kv_layout.py) has an array on each of them."""
    tensors = [set() for _ in meshes.meshes]
    for layer, stage in enumerate(meshes.layer_stage):
        tensors[stage].add(layout.layer_slot(layer)[1])
    return [(mesh, tuple(sorted(t))) for mesh, t in zip(meshes.meshes, tensors)]


class KVCache:
    def __init__(self, config: Config, arch: ModelArchConfig, layout: KVCacheLayout, mesh: jax.sharding.Mesh,
                 draft: tuple[tuple[KVCacheSpec, ...], int] | None = None, stage_meshes: StageMeshes | None = None):
        """Sizes the cache from the memory left once the weights are on the devices. draft: a drafter's
        tensors (`draft_caches`), which take the same block ids: their specs, and the blocks each holds per
        block id. stage_meshes: under pipeline parallelism, the stages' (each holds its layers' KV tensors)."""
        self.config, self.arch, self.layout, self.mesh = config, arch, layout, mesh
        self.block_size = config.cache.block_size
        # Per model (the target, a drafter), per tensor
        self._specs = [model_kv_specs(arch, self.block_size)] + ([draft[0]] if draft else [])
        self.stages, start = [], 0
        for stage_mesh, tensors in _stage_tensors(layout, stage_meshes) if stage_meshes else [
                (mesh, tuple(range(layout.num_tensors)))]:
            self.stages.append(StageCaches(stage_mesh, tuple(tensors), start))
            start += len(tensors)
        # Blocks per block id in each model's tensors: a draft model's groups each take one (draft_model.py).
        self._blocks_per_id = [1] + ([draft[1]] if draft else [])
        # The bytes the budget left for a step's temporaries, where it was sized from the device's memory
        self.step_reserve: int | None = None
        self.num_state_slots = config.scheduler.max_num_seqs if layout.hybrid else 0
        self._state_tensors = layout.state_tensors()  # the target's tensors of num_state_slots rows
        self.num_blocks = self._num_blocks()
        if self.num_blocks < self.blocks_per_request():
            ssd = ""
            if self._ssd_bytes():  # the scan's room grows with the step's tokens and requests, not its length
                sc = config.scheduler
                ssd = (f"; a Mamba layer's scan keeps {2 * self._ssd_bytes() / 2**30:.1f} GiB for a step of "
                       f"max_num_batched_tokens={sc.max_num_batched_tokens} and max_num_seqs={sc.max_num_seqs}: "
                       "lower those")
            raise ValueError(
                f"the KV cache has {self.num_blocks} blocks, fewer than one request of max_model_len "
                f"({config.model.max_model_len}) tokens takes ({self.blocks_per_request()}): raise "
                f"gpu_memory_utilization or num_gpu_blocks_override, or lower max_model_len{ssd}")
        cache_dtype = jnp.dtype(config.cache.cache_dtype)
        if cache_dtype.itemsize == 1:  # as vLLM warns, for the same reason
            logger.warning("the %s KV cache stores K and V with scale 1.0 (a checkpoint's k_scale / v_scale are "
                           "not read): values past the format's range saturate", cache_dtype.name)
        self.caches: list[tuple[jax.Array, ...]] | None = None
        self.draft_caches: list[tuple[jax.Array, ...]] | None = None
        # The target's, per array of `caches` (per KV tensor, and under pipeline parallelism per stage)
        self.shardings = [self._specs[0][t].shardings(stage.mesh) for stage in self.stages for t in stage.tensors]
        # Compiled once and kept: a cache made again (after a failed step, a wake-up) compiles nothing.
        # Per model, per entry of its caches: the functions that make its arrays.
        self._zeros_made: dict[tuple, tuple] = {}
        self._zeros = [[self._zeros_fns(self._specs[0][t], self._rows(0, t), stage.mesh)
                        for stage in self.stages for t in stage.tensors]]
        if draft:
            self._zeros.append([self._zeros_fns(spec, self._rows(1, t), mesh) for t, spec in enumerate(self._specs[1])])

    def _rows(self, model: int, tensor: int) -> int:
        """The leading dimension of a model's KV tensor: its state slots, or its blocks."""
        if model == 0 and tensor in self._state_tensors:
            return self.num_state_slots
        return self.num_blocks * self._blocks_per_id[model]

    def _zeros_fns(self, spec: KVCacheSpec, rows: int, mesh: jax.sharding.Mesh) -> tuple:
        """Compiled makers of a tensor's zeroed arrays (one per spec, size and mesh: every layer shares them)."""
        if (spec, rows, mesh) not in self._zeros_made:
            dtypes = self.config.cache.cache_dtype, self.config.model.dtype
            self._zeros_made[spec, rows, mesh] = tuple(
                jax.jit(functools.partial(jnp.zeros, a.shape, a.dtype), out_shardings=sharding).lower().compile()
                for a, sharding in zip(spec.arrays(rows, *dtypes), spec.shardings(mesh)))
        return self._zeros_made[spec, rows, mesh]

    @property
    def bytes_per_block(self) -> int:
        """A block id holds one block in each KV tensor (a layer of each group), the draft's too, and under
        pipeline parallelism in each stage's copy of a tensor its layers share."""
        return sum(self._stage_bytes_per_block(s) for s in range(len(self.stages)))

    def _stage_bytes_per_block(self, stage: int, per_device: bool = False) -> int:
        """What one block id takes on pipeline stage `stage` (a draft's tensors are the only stage's; a
        hybrid model's state tensors are not blocks): in all, or on each of the stage's devices (the
        arrays split over tensor parallelism's devices take a share each)."""
        dtypes = self._dtypes(stage, per_device)
        target = sum(self._specs[0][t].bytes_per_block(*dtypes) for t in self.stages[stage].tensors
                     if t not in self._state_tensors)
        return target + sum(blocks * spec.bytes_per_block(*dtypes) for specs, blocks
                            in zip(self._specs[1:], self._blocks_per_id[1:]) for spec in specs)

    def _state_bytes(self, stage: int = 0, per_device: bool = False) -> int:
        """A hybrid model's state slots (0 for any other model): in all, or on each of its devices."""
        dtypes = self._dtypes(stage, per_device)
        return self.num_state_slots * sum(self._specs[0][t].bytes_per_block(*dtypes) for t in self._state_tensors
                                          if t in self.stages[stage].tensors)

    def _dtypes(self, stage: int, per_device: bool) -> tuple:
        """KVCacheSpec.bytes_per_block's arguments: the dtypes, and the devices a split array is split over."""
        devices = self.stages[stage].mesh.shape["model"] if per_device else 1
        return self.config.cache.cache_dtype, self.config.model.dtype, devices

    @property
    def state_bytes(self) -> int:
        """A hybrid model's state slots, in all."""
        return sum(self._state_bytes(s) for s in range(len(self.stages)))

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override:
            return cache.num_gpu_blocks_override
        # This host's first device (every host sizes alike), or under pipeline parallelism the first device of
        # each stage on this host, after its weights: the fewest blocks of any.
        if len(self.stages) == 1:
            stages = {0: jax.local_devices()[0]}
        else:
            stages = {i: stage.mesh.devices.flat[0] for i, stage in enumerate(self.stages)
                      if stage.mesh.devices.flat[0].process_index == jax.process_index()}
        stats = {i: device.memory_stats() or {} for i, device in stages.items()}
        if not stats:  # a host that holds no stage: the others size the cache
            num_blocks = np.iinfo(np.int32).max
        elif any("bytes_limit" in s for s in stats.values()):
            self.step_reserve = self._activation_bytes()
            num_blocks = min(
                int((s["bytes_limit"] * cache.gpu_memory_utilization - s["bytes_in_use"] - self.step_reserve
                     - self._processor_state_bytes() - self._state_bytes(i, per_device=True))
                    // self._stage_bytes_per_block(i, per_device=True))
                for i, s in stats.items())
        else:
            budget = min(_CPU_KV_CACHE_BYTES,
                         self.config.scheduler.max_num_seqs * self.blocks_per_request() * self.bytes_per_block)
            num_blocks = int(budget // self.bytes_per_block)
        num_blocks = max(num_blocks, 0)
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
        """A Mamba layer's SSD scan at the largest bucket (kernels/ssd.py)."""
        m, sc = self.arch.mamba, self.config.scheduler
        if m is None:
            return 0
        reqs = min(sc.max_num_seqs, sc.max_num_batched_tokens)
        return scan_bytes(sc.max_num_batched_tokens, reqs, m.chunk_size, m.num_heads, m.head_dim, m.state_size)

    def _processor_state_bytes(self) -> int:
        return ProcessorState.nbytes(self.config.scheduler.max_num_seqs, self.config.model.arch.vocab_size)

    def allocate(self) -> None:
        """Zeroed caches on the mesh (a block's old contents never matter: a step writes a
        slot before any step reads it)."""
        self.caches, *draft = jax.block_until_ready(
            [[tuple(zeros() for zeros in per_array) for per_array in per_entry] for per_entry in self._zeros])
        self.draft_caches = draft[0] if draft else None

    def describe(self, draft: str = "") -> str:
        """The cache in a line: its blocks (or a Mamba model's state slots) and their memory; draft: what
        to say of a draft model's share."""
        gib = self.num_blocks * self.bytes_per_block / 2**30
        model_dtype = jnp.dtype(self.config.model.dtype).name
        if self.layout.groups[0].mamba:
            return f"Mamba states: {self.num_blocks} slots ({gib:.2f} GiB, {model_dtype})"
        text = (f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens{draft} ({self.num_tokens} tokens, "
                f"{gib:.2f} GiB, {jnp.dtype(self.config.cache.cache_dtype).name})")
        if self.layout.hybrid:
            text += f"; Mamba states: {self.num_state_slots} slots ({self.state_bytes / 2**30:.2f} GiB, {model_dtype})"
        return text

    def delete(self) -> None:
        """Free the caches' memory now (those a failed step consumed are gone already)."""
        for array in jax.tree.leaves([self.caches or [], self.draft_caches or []]):
            if not array.is_deleted():
                array.delete()
        self.caches = self.draft_caches = None
