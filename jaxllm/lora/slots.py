"""LoRASlots: the runner's max_loras device slots of adapters, and which adapter each holds.

Each target module's slots are stacked arrays per layer (models/lora.py) made once at start-up; loading
an adapter writes one slot of every module and layer in one jitted, donated update whose slot index is
an argument, so neither loading nor the step ever compiles anew. A step's adapters must all be
in slots (the scheduler runs at most max_loras distinct adapters in one step): one that is not
takes a free slot, else the least recently used slot of an adapter the step does not run.
Adapters read from disk are kept in host memory, max_cpu_loras of them, least recently used
dropped first (from its slot too): the slots hold a subset of them. An adapter that fails to
load fails its requests alone.
"""
import collections
import logging

import jax
import numpy as np

from jaxllm.contracts.step import SchedulerOutput
from jaxllm.lora.adapter import AdapterWeights, check_adapter, read_adapter
from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.request import LoRARequest
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.lora import Stacks, lora_module_dims, lora_stack_axes
from jaxllm.sharding import named_sharding

logger = logging.getLogger(__name__)


def _write_slot(stacks: Stacks, slot: jax.Array, values: dict[str, tuple[jax.Array, jax.Array]]) -> Stacks:
    """stacks with slot `slot` (int32 scalar) of each module set to values' (A [layers, in, r], B [layers, r, out])."""
    out = {}
    for module, (a_layers, b_layers) in stacks.items():
        new_a, new_b = values[module]
        out[module] = ([jax.lax.dynamic_update_slice(a, new_a[i, :, None], (0, slot, 0))
                        for i, a in enumerate(a_layers)],
                       [jax.lax.dynamic_update_slice(b, new_b[i, None], (slot, 0, 0)) for i, b in enumerate(b_layers)])
    return out


class LoRASlots:
    def __init__(self, config: LoRAConfig, arch: ModelArchConfig, run_arch: ModelArchConfig, kv_head_repeat: int,
                 dtype, mesh: jax.sharding.Mesh):
        """arch: the checkpoint's architecture (what adapters are checked against); run_arch: what runs
        (its KV heads repeated kv_head_repeat times under tensor parallelism: worker/kv_heads.py)."""
        self.config, self.dtype = config, dtype
        self._num_layers, self._repeat, self._head_dim = arch.num_layers, kv_head_repeat, arch.head_dim
        self._checkpoint_dims, self._dims = lora_module_dims(arch), lora_module_dims(run_arch)
        num_slots, rank = config.max_loras, config.max_lora_rank
        shardings, self.stacks = {}, {}
        for module, d in self._dims.items():
            a_axes, b_axes = lora_stack_axes(d)
            a_sharding, b_sharding = named_sharding(mesh, a_axes), named_sharding(mesh, b_axes)
            shardings[module] = ([a_sharding] * arch.num_layers, [b_sharding] * arch.num_layers)
            a, b = np.zeros((d.in_dim, num_slots, rank), dtype), np.zeros((num_slots, rank, d.out_dim), dtype)
            self.stacks[module] = ([jax.device_put(a, a_sharding) for _ in range(arch.num_layers)],
                                   [jax.device_put(b, b_sharding) for _ in range(arch.num_layers)])
        self._write = jax.jit(_write_slot, donate_argnums=(0,), out_shardings=shardings)
        self._zeros = {m: (np.zeros((arch.num_layers, d.in_dim, rank), dtype),
                           np.zeros((arch.num_layers, rank, d.out_dim), dtype)) for m, d in self._dims.items()}
        self._write_values(0, self._zeros)  # compiles the writer now, at start-up
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # adapter id -> slot, LRU first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._host: collections.OrderedDict[int, AdapterWeights] = collections.OrderedDict()  # read adapters, LRU first
        self._requests: dict[str, LoRARequest] = {}  # request id -> its adapter, while it holds a runner row

    def _write_values(self, slot: int, values: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.stacks = self._write(self.stacks, np.int32(slot), values)

    # ---- the requests' adapters ----
    def prepare_step(self, sched: SchedulerOutput, failed: dict[str, str]) -> np.ndarray:
        """Follow the step's finished, preempted and new requests, and return each scheduled request's
        slot [n] int32 (-1: the base model), its adapter loaded first if it is in none. A request whose
        adapter fails to load goes in `failed` (request id -> why) and runs on the base model this step,
        to end with the error."""
        for request_id in (*sched.finished_req_ids, *sched.preempted_req_ids):
            self._requests.pop(request_id, None)
        for new in sched.new_requests:
            if new.lora_request is not None:
                self._requests[new.req_id] = new.lora_request
        adapters = [self._requests.get(s.req_id) for s in sched.scheduled]
        needed = {lr.lora_int_id: lr for lr in adapters if lr is not None}
        if len(needed) > self.config.max_loras:
            raise RuntimeError(f"a step runs {len(needed)} LoRA adapters, more than max_loras "
                               f"({self.config.max_loras}): the scheduler admits no more")
        errors = {}
        for lora_int_id, lora_request in needed.items():
            try:
                self._activate(lora_request, needed)
            except Exception as e:  # a file that broke after the front end's check: nothing is dispatched yet
                logger.error("LoRA adapter %r failed to load: %s", lora_request.lora_name, e)
                errors[lora_int_id] = f"LoRA adapter {lora_request.lora_name!r}: {e}"
        slots = np.full(len(adapters), -1, np.int32)
        for i, (s, lr) in enumerate(zip(sched.scheduled, adapters)):
            if lr is None:
                continue
            if lr.lora_int_id in errors:
                failed[s.req_id] = errors[lr.lora_int_id]
            else:
                slots[i] = self._slot_of[lr.lora_int_id]
        return slots

    def _activate(self, lora_request: LoRARequest, pinned: dict[int, LoRARequest]) -> None:
        """Put the adapter in a slot unless it is in one: a free slot, else the least recently used one
        whose adapter is not `pinned` (the step's)."""
        lora_int_id = lora_request.lora_int_id
        if lora_int_id in self._slot_of:
            self._slot_of.move_to_end(lora_int_id)
            return
        weights = self._read(lora_request, pinned)
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            evicted = next(i for i in self._slot_of if i not in pinned)
            slot = self._slot_of.pop(evicted)
        values = {m: tuple(np.asarray(w, self.dtype) for w in weights.modules[m]) if m in weights.modules
                  else zeros for m, zeros in self._zeros.items()}
        self._write_values(slot, values)
        self._slot_of[lora_int_id] = slot

    def _read(self, lora_request: LoRARequest, pinned=()) -> AdapterWeights:
        """The adapter's weights, from host memory or its folder (then kept, within max_cpu_loras: the least
        recently used adapter not `pinned` is dropped, from its slot too)."""
        lora_int_id = lora_request.lora_int_id
        if lora_int_id in self._host:
            self._host.move_to_end(lora_int_id)
            return self._host[lora_int_id]
        spec = check_adapter(lora_request.lora_path, self.config.max_lora_rank, self._checkpoint_dims,
                             self._num_layers)
        weights = read_adapter(spec, self.config.max_lora_rank, self._dims, self._num_layers, self._repeat,
                               self._head_dim)
        self._host[lora_int_id] = weights
        if len(self._host) > self.config.max_cpu_loras:  # pinned ones are at most max_loras <= max_cpu_loras
            self._forget(next(i for i in self._host if i not in pinned and i != lora_int_id))
        return weights

    def _forget(self, lora_int_id: int) -> bool:
        """Drop the adapter from host memory and its slot; False if it was in neither."""
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        return self._host.pop(lora_int_id, None) is not None or slot is not None

    # ---- vLLM's add_lora / remove_lora / list_loras ----
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read the adapter into host memory now (its first request then only writes its slot)."""
        self._read(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter (its slot freed, its weights dropped from host memory); False if it was not
        loaded, or if a request still runs on it (it stays)."""
        if any(lr.lora_int_id == lora_int_id for lr in self._requests.values()):
            return False
        return self._forget(lora_int_id)

    def list_loras(self) -> list[int]:
        """The ids of the adapters held (in host memory; those in slots are among them)."""
        return list(self._host)

    def delete(self) -> None:
        for array in jax.tree.leaves(self.stacks):
            array.delete()
