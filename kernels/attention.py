"""The one attention interface the models call: metadata + backend selection.

Every backend is a function with the signature of `reference.ragged_paged_attention`.
"""
import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from jaxllm.kernels import reference


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step, static-shape description of the ragged batch (see reference.py). The slot
    mapping and block tables have one row per KV cache group (models/kv_layout.py); a
    layer takes its group's with `group(g)`."""
    slot_mapping: jax.Array     # [num_groups, num_tokens] int32, -1 for padding
    query_start_loc: jax.Array  # [max_num_reqs + 1] int32
    seq_lens: jax.Array         # [max_num_reqs] int32
    block_tables: jax.Array     # [num_groups, max_num_reqs, max_blocks_per_seq] int32
    num_seqs: jax.Array         # [1] int32
    # Static: the host knows that every request of the step has one token (worker/model_runner.py
    # gives such steps a forward of their own), so a Mamba layer runs its one-step update alone.
    decodes_only: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def group(self, g: int) -> "AttentionMetadata":
        """The metadata of KV cache group `g`: its slot mapping [num_tokens] and block tables
        [max_num_reqs, max_blocks_per_seq], as the backends take them."""
        return dataclasses.replace(self, slot_mapping=self.slot_mapping[g], block_tables=self.block_tables[g])


BACKENDS = ("reference", "pallas", "triton", "mosaic")


def get_attention_fn(name: str, mesh=None, batch_invariant: bool = False, latent: bool = False):
    """The ragged paged attention function of backend `name`. With a mesh whose
    "model" axis spans several devices, each device runs it on its own q and KV heads
    (a kernel is one custom call: left to XLA, it would gather every head first).
    batch_invariant: a token's result does not depend on the others' (kernels/batch_invariant.py):
    the reference in fixed blocks of tokens, or a GPU backend without split-K.
    latent: over a latent cache (DeepSeek's MLA: one KV head whose values are its keys, replicated
    under tensor parallelism, each device's q heads reading it whole): the reference or the Pallas
    latent kernel (kernels/latent_attention.py), which also take context_only and return_lse (the
    expanded prefill's context part, models/deepseek.py)."""
    fn = _latent_backend(name) if latent else _backend(name)
    if batch_invariant:
        from jaxllm.kernels import batch_invariant as invariant
        fn = invariant.reference_attention if name == "reference" else invariant.pallas_attention
    if mesh is None or mesh.shape["model"] == 1:
        return fn
    return per_device_heads(fn, mesh, latent)


def per_device_heads(fn, mesh, latent: bool = False):
    """fn (a backend's signature) run on each device's own q heads and KV cache heads (a latent
    cache whole on every device)."""
    heads, cache, replicated = P(None, "model", None), P() if latent else P(None, None, "model", None), P()

    def attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs, *,
                  scale, sliding_window=None, soft_cap=None, **latent_options):
        """latent_options: the latent backends' context_only and return_lse (reference.py)."""
        local = functools.partial(fn, scale=scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap, **latent_options)
        out_specs = (heads, P(None, "model")) if latent_options.get("return_lse") else heads
        return jax.shard_map(local, mesh=mesh, out_specs=out_specs, check_vma=False,
                             in_specs=(heads, cache, cache) + (replicated,) * 4)(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs)
    return attention


def _backend(name: str):
    if name == "reference":
        return reference.ragged_paged_attention
    if name == "pallas":
        from jaxllm.kernels import pallas_attention
        return pallas_attention.ragged_paged_attention
    if name == "mosaic":
        from jaxllm.kernels import mosaic_attention
        return mosaic_attention.ragged_paged_attention
    if name == "triton":
        from jaxllm.kernels import triton_attention
        return triton_attention.ragged_paged_attention
    raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")


LATENT_BACKENDS = ("reference", "pallas")


def _latent_backend(name: str):
    if name == "reference":
        return reference.ragged_paged_attention
    if name == "pallas":
        from jaxllm.kernels import latent_attention
        return latent_attention.ragged_paged_attention
    raise ValueError(f"attention_backend over a latent cache must be one of {LATENT_BACKENDS}, got {name!r}")


def default_backend() -> str:
    """The fastest backend for the current platform (docs/kernels.md): on Hopper,
    Mosaic GPU prefill with Pallas decode; Pallas on other GPUs; else the reference."""
    if jax.default_backend() != "gpu":
        return "reference"
    from jaxllm.kernels import mosaic_attention
    return "mosaic" if mosaic_attention.is_hopper() else "pallas"


write_kv = reference.write_kv
write_slots = reference.write_slots
