"""Pipeline parallelism: the decoder layers split into stages of consecutive layers, each stage's
params and KV arrays on devices of its own (a [data, model] mesh of tensor_parallel_size devices,
jaxllm.sharding.StageMeshes), and a step's forward run stage by stage: stage 0 embeds the tokens,
each stage runs its layers and hands the residual stream [T, hidden_size] to the next stage's
devices (jax.device_put), and the last stage ends as the one-mesh forward does (final norm, logits
at the sampled rows, their argmax), so everything after the forward (sampler, logprobs, pooling)
runs unchanged on the last stage's mesh.

Each stage is an executable of its own per token bucket (ExecutableKey(STAGE, bucket, stage=s); the
last stage's is the bucket's FORWARD), compiled at warm-up. JAX dispatches them asynchronously and
each device runs its queue in order, so while stage 1 runs step N, stage 0 is free for step N + 1:
the engine core keeps pipeline_parallel_size steps in flight (engine/core.py), and the scheduler
never schedules a request again before its sampled token has come back (core/scheduler.py), so no
stage 0 waits for the last stage's output of the step before. Stage 0 therefore reads every token
id from the host: a step whose tokens are still on the device (prev_rows) is an error here.

A stage's executable takes the model's whole flat param list, as the one-mesh forward does, with
every param of another stage replaced by a scalar placeholder on this stage's mesh (jit prunes the
unused arguments): the model is merged from the same graphdef and touches only its stage's modules
(LlamaForCausalLM.embed, decode_layers, norm, compute_logits). A model whose head is its embedding
(tie_word_embeddings) keeps a copy of the embedding on the last stage.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.profiler import TraceAnnotation

from jaxllm.kernels.attention import get_attention_fn
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.dual_batch import decode_two_halves, in_halves
from jaxllm.models.moe import recording_routing
from jaxllm.sharding import StageMeshes, replicated
from jaxllm.worker import input_batch as batching
from jaxllm.worker.executables import FORWARD, STAGE, ExecutableKey, Executables
from jaxllm.worker.kv_cache import KVCache
from jaxllm.worker.model_loader import ModelWeights
from jaxllm.worker.step_output import StepOutput
from jaxllm.worker.step_functions import (forward_out_shardings, layer_routing, sampled_rows, step_routing,
                                          traced_invariant)

_TIED_EMBEDDING = ("embed_tokens", "embedding")


@dataclasses.dataclass(frozen=True)
class _Stage:
    index: int
    mesh: jax.sharding.Mesh
    layers: range
    first: bool
    last: bool


class Pipeline:
    def __init__(self, weights: ModelWeights, meshes: StageMeshes, arch: ModelArchConfig, kv_cache: KVCache,
                 layouts: dict[int, batching.BatchLayout], num_sampled: int, attention_backend: str,
                 invariant: bool, dtype, dbo: bool = False):
        """layouts: each token bucket's BatchLayout; num_sampled: the greedy ids' length (ModelRunner's);
        dbo: each stage runs its layers on each half of the tokens in turn (models/dual_batch.py). A MoE
        model's stages hand on their layers' expert ids with the residual stream; the last gives the step's
        routing (step_functions.step_routing) as the one-mesh forward does."""
        self.meshes, self.arch, self.kv_cache, self.layouts = meshes, arch, kv_cache, layouts
        self.dtype = dtype
        self.num_experts = arch.moe.num_experts if arch.moe else 0
        n = len(meshes.meshes)
        starts = [meshes.layer_stage.index(s) for s in range(n)] + [arch.num_layers]
        self.stages = [_Stage(s, mesh, range(starts[s], starts[s + 1]), s == 0, s == n - 1)
                       for s, mesh in enumerate(meshes.meshes)]
        self.fns = [self._jit(stage, weights, attention_backend, invariant, num_sampled, dbo) for stage in self.stages]
        # The last stage has none of host 0's devices (stages on hosts of their own): host 0 reads each step's
        # outputs, so they move to the first stage's devices, which are its (to_first_stage).
        self.output_elsewhere = all(d.process_index != 0 for d in self.stages[-1].mesh.devices.flat)
        self.params: list[list[jax.Array]] = []
        self.set_weights(weights)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def set_weights(self, weights: ModelWeights) -> None:
        """Each stage's param list (its own params, placeholders for the others'), from `weights` as loaded."""
        placeholders = [{} for _ in self.stages]
        self.params = []
        for stage, own in zip(self.stages, placeholders):
            params = []
            for path, value in zip(weights.paths, weights.params):
                if self.meshes.of_param(path) == stage.mesh:
                    params.append(value)
                elif stage.last and path == _TIED_EMBEDDING and self.arch.tie_word_embeddings:
                    params.append(jax.device_put(value, jax.sharding.NamedSharding(stage.mesh, value.sharding.spec)))
                else:
                    if value.dtype not in own:
                        own[value.dtype] = jax.device_put(np.zeros((), value.dtype), replicated(stage.mesh))
                    params.append(own[value.dtype])
            self.params.append(params)

    def to_first_stage(self, output: StepOutput) -> StepOutput:
        """A step's outputs moved from the last stage's devices to the first stage's (host 0's). Every host
        makes the same call in the same order: a transfer between hosts has a sender and a receiver."""
        fields, sums = jax.device_put((output.device_fields(), output.pooling and output.pooling.sums),
                                      replicated(self.stages[0].mesh))
        return dataclasses.replace(output, **fields, pooling=output.pooling and output.pooling._replace(sums=sums))

    @property
    def head_params(self) -> list[jax.Array]:
        """The last stage's param list: what computes logits from its hidden states (prompt logprobs)."""
        return self.params[-1]

    def _jit(self, stage: _Stage, weights: ModelWeights, attention_backend: str, invariant: bool, num_sampled: int,
             dbo: bool):
        kv = self.kv_cache.stages[stage.index]
        kv_shardings = self.kv_cache.shardings[kv.slice]
        attn_fn = get_attention_fn(attention_backend, stage.mesh, invariant, latent=self.arch.mla is not None)
        fn = make_stage_fn(weights.graphdef, weights.treedef, attn_fn, self.layouts, num_sampled, stage,
                           kv.tensors, self.kv_cache.layout.num_tensors, self.num_experts, dbo)
        fn = traced_invariant(fn, stage.mesh) if invariant else fn
        rep = replicated(stage.mesh)
        routing = (rep, rep) if self.num_experts else ()
        out = (forward_out_shardings(stage.mesh, kv_shardings) + (routing,) if stage.last
               else (rep, rep if self._moe_layers_before(stage.layers.stop) else None, kv_shardings))
        return jax.jit(fn, donate_argnums=(1,), static_argnums=(5, 6), out_shardings=out)

    def _moe_layers_before(self, layer: int) -> int:
        """The MoE layers before decoder layer `layer` (whose expert ids a stage starting there receives)."""
        return sum(i in self.arch.moe.sparse_layers for i in range(layer)) if self.num_experts else 0

    def key(self, stage: int, token_bucket: int, decodes_only: bool = False) -> ExecutableKey:
        """The executable of a stage at a token bucket: the last stage's is the bucket's FORWARD."""
        return ExecutableKey(FORWARD, token_bucket, decodes_only=decodes_only) if stage == self.num_stages - 1 else (
            ExecutableKey(STAGE, token_bucket, stage=stage, decodes_only=decodes_only))

    def lower(self, stage: int, token_bucket: int, buffer: np.ndarray,
              decodes_only: bool = False) -> jax.stages.Lowered:
        s = self.stages[stage]
        x = routed = None
        if not s.first:
            x = jax.ShapeDtypeStruct((token_bucket, self.arch.hidden_size), self.dtype, sharding=replicated(s.mesh))
            before = self._moe_layers_before(s.layers.start)
            if before:  # the earlier stages' MoE layers' expert ids
                routed = jax.ShapeDtypeStruct((token_bucket, before, self.arch.moe.top_k), jnp.int32,
                                              sharding=replicated(s.mesh))
        caches = self.kv_cache.caches[self.kv_cache.stages[stage].slice]
        return self.fns[stage].lower(self.params[stage], caches, x, routed, buffer, token_bucket, decodes_only)

    def forward(self, executables: Executables, token_bucket: int, buffer: np.ndarray,
                decodes_only: bool = False) -> tuple:
        """Dispatch every stage of a step (buffer: its packed inputs; decodes_only: every request has one
        token, AttentionMetadata.decodes_only); returns the last stage's (greedy ids,
        logits, sampling words, hidden states, a MoE model's routing), on their way. The KV caches are
        donated stage by stage."""
        offset, (num_tokens,) = self.layouts[token_bucket].fields["prev_rows"]
        if (buffer[offset:offset + num_tokens] >= 0).any():
            raise RuntimeError("a pipeline-parallel step reads a token the step before is still sampling: the "
                               "scheduler schedules a request only once its last token has landed")
        x = routed = None
        caches = self.kv_cache.caches
        for stage in self.stages:
            fn = executables.get(self.key(stage.index, token_bucket, decodes_only),
                                 lambda: self.lower(stage.index, token_bucket, buffer, decodes_only))
            part = self.kv_cache.stages[stage.index].slice
            if stage.last:
                with TraceAnnotation("dispatch"):
                    *outputs, caches[part], routing = fn(self.params[stage.index], caches[part], x, routed, buffer)
                return (*outputs, routing)
            with TraceAnnotation("dispatch"):
                x, routed, caches[part] = fn(self.params[stage.index], caches[part], x, routed, buffer)
            # The residual stream (and the expert ids) to the next stage's devices: a device-to-device copy,
            # in the queue of both.
            x, routed = jax.device_put((x, routed), replicated(self.stages[stage.index + 1].mesh))
        raise AssertionError("a pipeline has a last stage")


def make_stage_fn(graphdef, params_treedef, attn_fn, layouts: dict[int, batching.BatchLayout], num_sampled: int,
                  stage: _Stage, tensors: tuple[int, ...], num_tensors: int, num_experts: int = 0, dbo: bool = False):
    """The jitted function of one stage (a closure, not a method: the runner is not kept alive by it)."""
    def run(params, kv_caches, x, routed, buffer, token_bucket: int, decodes_only: bool = False):
        """params: the stage's flat param list (placeholders for the other stages'); kv_caches: the arrays of
        its KV `tensors`; x: the residual stream from the stage before [T, hidden_size] (None on stage 0);
        routed: a MoE model's expert ids of the stages before [T, their MoE layers, k] (None where no MoE
        layer came before); buffer [size] int32: the step's inputs, laid out as `token_bucket`'s BatchLayout;
        decodes_only: every request has one token (AttentionMetadata.decodes_only). Returns (x after the
        stage's layers, the expert ids so far, kv_caches), or on the last stage the one-mesh forward's
        outputs (step_functions.py)."""
        batch = layouts[token_bucket].unpack(buffer, decodes_only)
        model = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, params))
        if stage.first:
            x = model.embed(batch.input_ids)
        every = [None] * num_tensors
        for t, cache in zip(tensors, kv_caches):
            every[t] = cache
        with recording_routing() as recorded:
            if dbo:
                x, every = decode_two_halves(model, x, batch.positions, every, batch.attention, attn_fn, stage.layers)
            else:
                x, every, _ = model.decode_layers(x, batch.positions, every, batch.attention, attn_fn, stage.layers)
        kv_caches = [every[t] for t in tensors]
        if recorded:  # this stage's MoE layers' after the earlier stages'
            halves = dbo and in_halves(x.shape[0])
            routed = jnp.concatenate(([] if routed is None else [routed]) + [layer_routing(recorded, halves)], axis=1)
        if not stage.last:
            return x, routed, kv_caches
        routing = step_routing(routed, batch.logits_indices, batch.attention, num_experts) if num_experts else ()
        return sampled_rows(model, model.norm(x), batch, num_sampled) + (kv_caches, routing)
    return run
