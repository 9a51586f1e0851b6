"""The LoRA adapters' part of a step: y = x @ W + (x @ A[s]) @ B[s] for each token's adapter slot s.

Each target module holds, per layer, every slot's adapter stacked, padded to the engine's max rank
r, with the adapter's scaling folded into B:

    A [in, num_slots, r]     B [num_slots, r, out]     (one array of each per layer)

Arrays of their own per layer, as the base weights are, not one [num_layers, ...] array sliced in
the step: a layer's slice, fused into its matmuls, can make them computations of their own for XLA's
GPU autotuner (one autotuning per layer and module, in every token bucket), where per-layer arrays
give every layer the same ones.

A step says which slot each token reads as a one-hot mask [T, num_slots] (all zeros: the
base model alone). The delta is then two plain matmuls whose shapes depend only on the slot
count and r, never on which adapters are loaded: every slot's x @ A is computed and the other
slots' zeroed, so the second matmul reads only the token's own slot:

    [T, in] @ [in, S * r] -> [T, S, r] * mask -> [T, S * r] @ [S * r, out] -> [T, out]

which costs what one adapter of rank S * r would, and for a few slots of rank 16 is small beside
the base matmul. Sharding follows the base weight's: a column-parallel module's B shards its out
axis, a row-parallel module's A its in axis (A and B of the other side are small and replicated).
"""
import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.models.config import ModelArchConfig

# The target modules (PEFT's names, HF's Linear names) a Llama-family adapter may have.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ModuleDims:
    in_dim: int
    out_dim: int
    in_axis: str  # logical axes (jaxllm.sharding) of the base weight's in and out
    out_axis: str


def lora_module_dims(arch: ModelArchConfig) -> dict[str, ModuleDims]:
    """Each target module's in and out widths and logical axes in `arch` (the one that runs: with
    tensor parallelism over more devices than KV heads, k_proj's and v_proj's out holds the repeats)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, m = arch.hidden_size, arch.intermediate_size
    return {"q_proj": ModuleDims(h, q, "embed", "q_heads"), "k_proj": ModuleDims(h, kv, "embed", "kv_heads"),
            "v_proj": ModuleDims(h, kv, "embed", "kv_heads"), "o_proj": ModuleDims(q, h, "q_heads", "embed"),
            "gate_proj": ModuleDims(h, m, "embed", "mlp"), "up_proj": ModuleDims(h, m, "embed", "mlp"),
            "down_proj": ModuleDims(m, h, "mlp", "embed")}


def lora_stack_axes(dims: ModuleDims) -> tuple[tuple, tuple]:
    """The logical axes of a module's stacked A [in, slots, r] and B [slots, r, out] of one layer."""
    return (dims.in_axis, None, None), (None, None, dims.out_axis)


# Per target module, each layer's stacked (A, B) (above): ([A of layer 0, A of layer 1, ...], [B of layer 0, ...]).
Stacks = dict[str, tuple[list[jax.Array], list[jax.Array]]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """A step's adapters, inside the jitted step: the Stacks, and each token's slot as a mask [T, num_slots]."""
    stacks: Stacks
    mask: jax.Array

    @classmethod
    def of(cls, stacks: Stacks, token_slots: jax.Array) -> "LoRABatch":
        """token_slots [T] int32: each token's slot, -1 for none (one_hot of -1 is all zeros)."""
        a = next(iter(stacks.values()))[0][0]
        return cls(stacks, jax.nn.one_hot(token_slots, a.shape[1], dtype=a.dtype))

    def layer(self, layer: int) -> "LayerLoRA":
        return LayerLoRA(self, layer)


class LayerLoRA:
    """One decoder layer's view of a LoRABatch: `lora(name, x)` is the delta of module `name`."""

    def __init__(self, batch: LoRABatch, layer: int):
        self.batch, self.layer = batch, layer

    def __call__(self, name: str, x: jax.Array) -> jax.Array:
        a, b = self.batch.stacks[name]
        return lora_delta(x, a[self.layer], b[self.layer], self.batch.mask)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """x [T, in], a [in, S, r], b [S, r, out], mask [T, S] -> [T, out]: token t's
    (x[t] @ a[:, s]) @ b[s] for the slot s its mask row selects (zeros where it selects none)."""
    num_tokens, (in_dim, num_slots, rank) = x.shape[0], a.shape
    xa = jnp.dot(x, a.reshape(in_dim, num_slots * rank)).reshape(num_tokens, num_slots, rank) * mask[:, :, None]
    return jnp.dot(xa.reshape(num_tokens, num_slots * rank), b.reshape(num_slots * rank, b.shape[-1]))
