"""Mixture-of-experts MLPs (Qwen2-MoE, Qwen3-MoE, Mixtral; DeepSeek's in models/deepseek.py): a
router picks k of E SwiGLU experts for each token, and the token's MLP is their outputs weighted by
the router.

    p = softmax(x W_router)                                  [T, E], fp32 (DeepSeek-V3: sigmoid of each)
    w, e = top_k(p)                                          [T, k]; w / sum(w) where the model renormalizes
    y_t = sum_j w_tj * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = e_tj
        (+ sigmoid(x_t W_shared_gate) * shared_mlp(x_t): Qwen2-MoE's shared expert)

DeepSeek's routers choose among groups of experts, V3's with a bias on the scores, and scale the
weights (route's arguments say how).

The experts' weights are stacked, gate_up_proj [E, hidden, 2, I] (gate and up fused, as the dense
MLP's) and down_proj [E, I, hidden]. The T * k (token, expert) pairs are sorted by expert, so each
expert's rows are contiguous, one grouped GEMM per projection (kernels/grouped_matmul.py on a
GPU, jax.lax.ragged_dot elsewhere: grouped_matmul_kind) runs every expert on its rows, and the
rows go back to token order to be summed with their weights. With
quantization="fp8" the stacked weights are e4m3 with a float32 scale per expert and output channel,
and each row goes to e4m3 by its own max (grouped_dot), as an Fp8Linear's (split over devices, by
the whole row's max).

Over the mesh's "model" axis of N devices, the attention stays tensor parallel (every device
holds every token's activations), and the experts are split one of two ways:
- tensor parallel (the default, vLLM's): each device holds 1/N of every expert's intermediate
  and runs all T * k rows on its slices; the partial sums are added up (psum), as a dense MLP's.
- expert parallel (MoeConfig.expert_parallel): each device holds E/N whole experts. Device d
  routes tokens [d * T/N, (d + 1) * T/N), sends each pair's row to the device of its expert with
  one all_to_all, runs its experts on what it receives, sends the results back with another, sums
  its tokens' rows, and an all_gather gives every device every token again.

The all_to_all is padded: each device sends each other one block of C rows. C is the worst case,
so no token is ever dropped and the step keeps one static shape: T/N tokens whose k experts are
distinct, of which at most E/N live on one device, so C = T/N * min(k, E/N). The price is bytes:
each all_to_all moves T * min(k, E/N) rows per device where a balanced routing needs T * k / N.
Looping over a smaller capacity, or jax.lax.ragged_all_to_all (only the real rows), is what to
measure against it on a GPU (docs/models.md).

A forward traced under recording_routing() hands back each MoE layer's expert ids, in layer order
(the engine returns them with the samples and counts them for /metrics: worker/step_functions.py).
"""
import contextlib
import contextvars
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.kernels.grouped_matmul import grouped_matmul, mosaic_grouped_matmul
from jaxllm.models.config import ModelArchConfig, MoeConfig
from jaxllm.models.fp8 import quantize_rows
from jaxllm.models.llama import INIT_STD, MLP, DecoderLayer, LlamaForCausalLM, Linear
from jaxllm.sharding import logical_to_spec, param_mesh


# The expert ids [T, k] of each MoE layer of the forward being traced, in order; None: not recording.
_recorded: contextvars.ContextVar[list | None] = contextvars.ContextVar("routed_experts", default=None)


@contextlib.contextmanager
def recording_routing():
    """Within it, each MoE layer a forward traces adds its tokens' expert ids [T, k] int32 (the traced
    arrays) to the list it yields."""
    token = _recorded.set([])
    try:
        yield _recorded.get()
    finally:
        _recorded.reset(token)


def record_routing(ids) -> None:
    """A MoE layer's expert ids [T, k], for recording_routing."""
    recorded = _recorded.get()
    if recorded is not None:
        recorded.append(ids)


def route(router_logits, top_k: int, renormalize: bool, score_bias=None, *, sigmoid: bool = False,
          num_groups: int = 1, topk_groups: int = 1, group_score: str = "max", scaling_factor: float = 1.0):
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32): each token's k
    best-scored experts, best first, with their scores (renormalized to sum to 1), times scaling_factor.

    The scores are the softmax of the logits, or each one's sigmoid (DeepSeek-V3). The choice is by
    the scores plus score_bias [E] (V3's e_score_correction_bias; the weights stay the scores), among
    the experts of each token's topk_groups best of num_groups equal groups, a group scored by its best
    expert ("max": V2's group_limited_greedy) or its best two's sum ("top2": V3)."""
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    if num_groups > 1:
        choice = _within_best_groups(choice, num_groups, topk_groups, group_score)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * scaling_factor, ids.astype(jnp.int32)


def _within_best_groups(choice, num_groups: int, topk_groups: int, group_score: str):
    """choice [T, E] with each token's experts outside its topk_groups best groups at -inf."""
    t, e = choice.shape
    grouped = choice.reshape(t, num_groups, e // num_groups)
    scores = jax.lax.top_k(grouped, 2)[0].sum(-1) if group_score == "top2" else grouped.max(-1)  # [T, groups]
    _, best = jax.lax.top_k(scores, topk_groups)
    keep = jnp.zeros((t, num_groups), bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)


def _stacked(weight):
    """The stacked experts' weight of `weight`: itself, or an FP8 (weight, scale) pair's weight."""
    return weight[0] if isinstance(weight, tuple) else weight


def grouped_matmul_kind() -> str:
    """The grouped GEMM a model traces with, JAXLLM_MOE_KERNEL: "pallas" (kernels/grouped_matmul.py,
    the default on a GPU, where XLA's ragged_dot runs every row through every expert), "mosaic" (JAX's
    Hopper kernel for the 16-bit GEMMs of steps with at least MOSAIC_MIN_ROWS rows, "pallas" for the
    others) or "ragged" (jax.lax.ragged_dot, the default elsewhere)."""
    kind = os.environ.get("JAXLLM_MOE_KERNEL") or ("pallas" if jax.default_backend() == "gpu" else "ragged")
    if kind not in ("pallas", "mosaic", "ragged"):
        raise ValueError(f"JAXLLM_MOE_KERNEL must be 'pallas', 'mosaic' or 'ragged', got {kind!r}")
    if kind == "mosaic" and jax.default_backend() == "gpu" and not _is_hopper():
        raise ValueError(f"JAXLLM_MOE_KERNEL=mosaic needs a Hopper GPU (wgmma), not {jax.devices()[0].device_kind}")
    return kind


def _is_hopper() -> bool:
    from jaxllm.kernels.mosaic_attention import is_hopper  # (Mosaic GPU's modules: imported where used)
    return is_hopper()


# Fewer rows than this (a decode step's), and most experts have none: the Mosaic kernel may still
# read a tile of each such expert's weight, where the Pallas kernel reads only the chosen ones.
MOSAIC_MIN_ROWS = 1024


def _grouped_matmul(rows, weight, group_sizes, out_dtype):
    kind = grouped_matmul_kind()
    if kind == "mosaic" and rows.shape[0] >= MOSAIC_MIN_ROWS and rows.dtype == weight.dtype == out_dtype:
        return mosaic_grouped_matmul(rows, weight, group_sizes)
    if kind in ("pallas", "mosaic"):
        return grouped_matmul(rows, weight, group_sizes, out_dtype)
    return jax.lax.ragged_dot(rows, weight, group_sizes, preferred_element_type=out_dtype)


def grouped_dot(rows, weight, group_sizes, row_experts, scale_over: str | None = None):
    """rows [M, K] grouped by expert, each times its expert's weight: [G, K, N] in the model's dtype, or
    (e4m3 [G, K, N], float32 scale [G, N] per output channel) with the rows scaled to e4m3 per row as
    an Fp8Linear's (by the whole row's max where scale_over's devices each hold a slice of it);
    row_experts [M] (sorted; G: none) picks each row's scales -> [M, N] in rows' dtype."""
    if not isinstance(weight, tuple):
        return _grouped_matmul(rows, weight, group_sizes, rows.dtype)
    w8, w_scale = weight
    x8, x_scale = quantize_rows(rows, over=scale_over)
    y = _grouped_matmul(x8, w8, group_sizes, jnp.float32)
    scale = jnp.take(w_scale, row_experts, axis=0, mode="fill", fill_value=0)
    return (y * x_scale[:, None] * scale).astype(rows.dtype)


def expert_mlp(rows, row_experts, group_sizes, gate_up, down, inner_over: str | None = None):
    """The experts' SwiGLU on rows grouped by expert: rows [M, hidden], expert g's being the
    group_sizes[g] [G] int32 rows after the groups before it (row_experts [M], sorted, says whose
    each is); gate_up [G, hidden, 2, I], down [G, I, hidden], or with quantization="fp8" each an
    (e4m3 weight, scale [G, 2, I] or [G, hidden]) pair -> [M, hidden] (a row after the last group
    is not defined). inner_over: the mesh axis whose devices each hold a slice of I (tensor parallel)."""
    g, hidden, _, inter = _stacked(gate_up).shape
    if isinstance(gate_up, tuple):
        gate_up = (gate_up[0].reshape(g, hidden, 2 * inter), gate_up[1].reshape(g, 2 * inter))
    else:
        gate_up = gate_up.reshape(g, hidden, 2 * inter)
    gate_up_rows = grouped_dot(rows, gate_up, group_sizes, row_experts).reshape(-1, 2, inter)
    return grouped_dot(jax.nn.silu(gate_up_rows[:, 0]) * gate_up_rows[:, 1], down, group_sizes, row_experts,
                       inner_over)


def experts_of_rows(rows, experts, gate_up, down, inner_over: str | None = None):
    """Each row through its expert: rows [M, hidden], experts [M] int32 in [0, G] (G: none, its output
    not defined) -> [M, hidden]. The rows are sorted by expert for the grouped GEMM, and back."""
    # experts [2, 0, 2, 1] -> order [1, 3, 0, 2] (experts 0, 1, 2, 2), group sizes [1, 1, 2]
    order = jnp.argsort(experts, stable=True)
    sizes = jnp.bincount(experts, length=_stacked(gate_up).shape[0])
    out = expert_mlp(rows[order], experts[order], sizes, gate_up, down, inner_over)
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # (reference.scatter_index says why)


def combine(pair_rows, weights, dtype):
    """Each token's rows [T, k, hidden] summed with its weights [T, k] (in fp32) -> [T, hidden] `dtype`."""
    return jnp.einsum("tkh,tk->th", pair_rows.astype(jnp.float32), weights).astype(dtype)


def moe_one_device(x, weights, ids, gate_up, down, inner_over: str | None = None):
    """x [T, hidden] through the experts (or slices of them, their intermediate over inner_over's
    devices) that gate_up and down hold, every pair's rows of the T tokens (weights, ids [T, k]) ->
    [T, hidden]."""
    t, k = ids.shape
    rows = experts_of_rows(jnp.repeat(x, k, axis=0), ids.reshape(-1), gate_up, down, inner_over)
    return combine(rows.reshape(t, k, -1), weights, x.dtype)


def moe_tensor_parallel(mesh, x, weights, ids, gate_up, down):
    """moe_one_device on each device's slices of every expert's intermediate (gate_up and down
    sharded by the "mlp" rule), the partial sums added up over the devices."""
    axis = logical_to_spec(("mlp",))[0]

    def local(x, weights, ids, gate_up, down):
        return jax.lax.psum(moe_one_device(x, weights, ids, gate_up, down, axis), axis)

    gate_up_spec, down_spec = P(None, None, None, axis), P(None, axis)
    if isinstance(gate_up, tuple):  # FP8: the scales [G, 2, I] split as the intermediate, [G, hidden] whole
        gate_up_spec, down_spec = (gate_up_spec, P(None, None, axis)), (down_spec, P())
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), gate_up_spec, down_spec),
                         out_specs=P(), check_vma=False)(x, weights, ids, gate_up, down)


def moe_expert_parallel(mesh, x, weights, ids, gate_up, down):
    """The experts whole on each device (gate_up and down sharded by the "expert" rule), each
    device's share of the tokens sent to its experts' devices and back by all_to_all (the module's
    docstring). x [T, hidden], weights, ids [T, k] replicated -> [T, hidden] replicated."""
    axis = logical_to_spec(("expert",))[0]
    n, num_tokens = mesh.shape[axis], x.shape[0]
    pad = -num_tokens % n  # padding tokens take expert 0 with weight 0
    x, weights, ids = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, weights, ids))

    def local(x, weights, ids, gate_up, down):
        """x [t, hidden], weights, ids [t, k]: this device's tokens; gate_up, down: its E/N experts."""
        t, k = ids.shape
        num_local = _stacked(gate_up).shape[0]
        capacity = t * min(k, num_local)
        # The pairs sorted by expert, so by device; each one's slot in its device's block:
        # devices [0, 0, 1, 1, 1] -> slots [0, 1, 0, 1, 2]
        order = jnp.argsort(ids.reshape(-1), stable=True)
        expert = ids.reshape(-1)[order]
        device = expert // num_local
        sent = jnp.bincount(device, length=n)
        slot = jnp.arange(t * k) - (jnp.cumsum(sent) - sent)[device]
        send_rows = jnp.zeros((n, capacity, x.shape[1]), x.dtype).at[device, slot].set(x[order // k],
                                                                                   unique_indices=True)
        send_experts = jnp.full((n, capacity), num_local, jnp.int32).at[device, slot].set(expert % num_local,
                                                                                          unique_indices=True)
        # [n, capacity, ...]: block s of what arrives is what device s sent here
        rows = jax.lax.all_to_all(send_rows, axis, 0, 0)
        experts = jax.lax.all_to_all(send_experts, axis, 0, 0)
        out = experts_of_rows(rows.reshape(n * capacity, -1), experts.reshape(-1), gate_up, down)
        back = jax.lax.all_to_all(out.reshape(n, capacity, -1), axis, 0, 0)
        pair_rows = jnp.zeros((t * k, x.shape[1]), back.dtype).at[order].set(back[device, slot], unique_indices=True)
        y = combine(pair_rows.reshape(t, k, -1), weights, x.dtype)
        return jax.lax.all_gather(y, axis, tiled=True)

    y = jax.shard_map(local, mesh=mesh, in_specs=(P(axis),) * 5, out_specs=P(), check_vma=False)(
        x, weights, ids, gate_up, down)
    return y[:num_tokens]


def _expert_param(rngs: nnx.Rngs, shape, axes, dtype, hf_axes) -> nnx.Param:
    """A stacked experts' param; hf_axes: it is the stack of HF's per-expert weights transposed so
    (models/loader.py)."""
    return nnx.Param(INIT_STD * jax.random.normal(rngs.params(), shape, dtype), out_sharding=axes,
                     eager_sharding=False, hf_axes=hf_axes)


class Experts(nnx.Module):
    """E SwiGLU experts, stacked: gate_up_proj [E, hidden, 2, I] (gate at 0, up at 1) and down_proj
    [E, I, hidden]; HF's experts.{e}.gate_proj, up_proj and down_proj (Mixtral's w1, w3, w2)."""

    def __init__(self, moe: MoeConfig, hidden_size: int, *, dtype, rngs, mesh=None):
        e, inter = moe.num_experts, moe.intermediate_size
        # Expert parallel: whole experts on each device; tensor parallel: each expert's intermediate split.
        expert, mlp = ("expert", None) if moe.expert_parallel else (None, "mlp")
        self.gate_up_proj = _expert_param(rngs, (e, hidden_size, 2, inter), (expert, "embed", None, mlp), dtype,
                                          hf_axes=(0, 3, 2, 1))
        self.down_proj = _expert_param(rngs, (e, inter, hidden_size), (expert, mlp, "embed"), dtype, hf_axes=(0, 2, 1))
        # quantization="fp8" (models/loader.py, quantize_model): the weights in e4m3 and their scales per
        # expert and output channel, gate_up_proj_scale [E, 2, I] and down_proj_scale [E, hidden].
        self.gate_up_proj_scale = self.down_proj_scale = nnx.data(None)
        self.mesh, self.expert_parallel = mesh, moe.expert_parallel

    def weight(self, name: str):
        """Param `name`'s array, or with quantization="fp8" its (e4m3 array, scale) pair."""
        scale = getattr(self, f"{name}_scale")
        return getattr(self, name)[...] if scale is None else (getattr(self, name)[...], scale[...])

    def __call__(self, x, weights, ids):
        """x [T, hidden], each token's experts ids [T, k] int32 and weights [T, k] float32 -> [T, hidden]."""
        gate_up, down = self.weight("gate_up_proj"), self.weight("down_proj")
        if self.mesh is None or self.mesh.shape["model"] == 1:
            return moe_one_device(x, weights, ids, gate_up, down)
        run = moe_expert_parallel if self.expert_parallel else moe_tensor_parallel
        return run(self.mesh, x, weights, ids, gate_up, down)


class Router(Linear):
    """A MoE layer's router (`gate`, HF's name): the experts' logits, x @ kernel [hidden, E], and with
    MoeConfig.score_bias DeepSeek-V3's e_score_correction_bias [E], in fp32 as HF keeps it."""

    def __init__(self, moe: MoeConfig, hidden_size: int, *, dtype, rngs):
        super().__init__(hidden_size, moe.num_experts, ("embed", None), dtype=dtype, rngs=rngs)
        bias = jnp.zeros((moe.num_experts,), jnp.float32)
        self.e_score_correction_bias = (nnx.Param(bias, out_sharding=(None,), eager_sharding=False)
                                        if moe.score_bias else None)


class SparseMoeBlock(nnx.Module):
    """The router (`gate`, HF's name), the experts, and Qwen2-MoE's shared expert with its gate."""

    def __init__(self, config: ModelArchConfig, *, dtype, rngs, mesh=None):
        moe, hidden = config.moe, config.hidden_size
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Linear(hidden, moe.num_experts, ("embed", None), dtype=dtype, rngs=rngs)
        self.experts = Experts(moe, hidden, dtype=dtype, rngs=rngs, mesh=mesh)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, dtype=dtype, rngs=rngs,
                                     intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden, 1, ("embed", None), dtype=dtype, rngs=rngs)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def __call__(self, x):
        """x [T, hidden] -> [T, hidden]."""
        # The router's logits in the model's dtype (as HF and vLLM), its softmax in fp32.
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        record_routing(ids)
        y = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE, Qwen3-MoE and Mixtral: Llama's model whose MLP is the experts on the config's
    sparse layers. mesh: where the experts run per device (None: one device)."""

    def __init__(self, config: ModelArchConfig, *, dtype, rngs: nnx.Rngs, mesh=None):
        self.mesh = mesh
        super().__init__(config, dtype=dtype, rngs=rngs)

    def decoder_layer(self, config: ModelArchConfig, layer: int, *, dtype, rngs) -> DecoderLayer:
        mlp = None
        if layer in config.moe.sparse_layers:
            mlp = SparseMoeBlock(config, dtype=dtype, rngs=rngs, mesh=param_mesh(self.mesh, ("layers", layer)))
        return DecoderLayer(config, layer, dtype=dtype, rngs=rngs, mlp=mlp)
