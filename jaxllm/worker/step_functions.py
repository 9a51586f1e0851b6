"""The functions ModelRunner jits: the forward pass of one step (to the logits at each
request's last token and their argmax), the sampler with and without the logits
processors, the logprobs of the sampled ids and of prompt positions, the writer of
the processors' state rows, and the pooling of hidden states (worker/pooler.py). A MoE model's
forward also gives the experts its routers chose (step_routing).
Closures and plain functions, not methods: the runner is not kept alive by its executables."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels import batch_invariant
from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.models.dual_batch import decode_two_halves, in_halves
from jaxllm.models.lora import LoRABatch
from jaxllm.models.moe import recording_routing
from jaxllm.sample import processors
from jaxllm.sample.logprobs import compute_logprobs
from jaxllm.sample.processors import ProcessorState
from jaxllm.sample.sampler import ProcessorMetadata, SampleMode, SamplingMetadata, sample
from jaxllm.sharding import named_sharding, replicated
from jaxllm.worker import input_batch as batching
from jaxllm.worker.draft_inputs import read_previous_step
from jaxllm.worker.pooler import pool_hidden


class StepFunctions:
    """The jitted functions of one runner, their outputs' shardings pinned so that each step sees
    the same inputs as the one before (and compiles nothing new)."""

    def __init__(self, graphdef, params_treedef, attn_fn, layouts: dict[int, batching.BatchLayout],
                 num_sampled: int, mesh, kv_shardings: list[tuple], user_processors: tuple, num_logprobs: int,
                 invariant: bool = False, num_speculative_tokens: int = 0, aux_layers: tuple[int, ...] = (),
                 drafter_block_size: int | None = None, num_experts: int = 0, dbo: bool = False):
        """num_sampled: the length of the sampled ids' array (the most rows of logits a step has);
        kv_shardings: each KV tensor's arrays' shardings (KVCacheSpec.shardings);
        invariant: the model traces with the batch-invariant ops (kernels/batch_invariant.py);
        aux_layers: an EAGLE-3 head's target layers, whose input states the forward returns too;
        drafter_block_size: with a draft model or an EAGLE head, the KV block size (draft_inputs.py);
        num_experts: a MoE model's experts per layer (0: a dense model), whose forward gives step_routing's arrays;
        dbo: the layers run on each half of the tokens in turn (models/dual_batch.py)."""
        rep = replicated(mesh)
        self.processor_state_sharding = ProcessorState(*[named_sharding(mesh, (None, "vocab"))] * 4)
        model_fn = functools.partial(traced_invariant, mesh=mesh) if invariant else (lambda fn: fn)
        forward = model_fn(make_forward_fn(graphdef, params_treedef, attn_fn, layouts, num_sampled, aux_layers,
                                           drafter_block_size, num_experts, dbo))
        routing_shardings = (rep, rep) if num_experts else ()
        forward_shardings = forward_out_shardings(mesh, kv_shardings) + (routing_shardings,)
        drafter_outputs = (rep,) * ((drafter_block_size is not None) + bool(aux_layers))
        self.forward = jax.jit(forward, donate_argnums=(1,), static_argnums=(4, 5),
                               out_shardings=forward_shardings + drafter_outputs)
        # The samplers too: under tensor parallelism their softmax over the vocabulary runs whole on each device.
        self.sample = jax.jit(model_fn(functools.partial(sample_padded, num_sampled=num_sampled)),
                              static_argnums=(2,), out_shardings=rep)
        # Users' processors (EngineArgs.logits_processors): every step runs them, in the processed sampler.
        self.sample_processed = jax.jit(model_fn(
            functools.partial(sample_processed, num_sampled=num_sampled, user_processors=user_processors,
                              num_speculative_tokens=num_speculative_tokens)),
            donate_argnums=(2,), static_argnums=(5,), out_shardings=(rep, self.processor_state_sharding))
        self.write_rows = jax.jit(processors.write_rows, donate_argnums=(0,),
                                  out_shardings=self.processor_state_sharding)
        self.logprobs = jax.jit(model_fn(compute_logprobs), static_argnums=(2,), out_shardings=rep)
        self.prompt_logprobs = jax.jit(model_fn(make_prompt_logprobs_fn(graphdef, params_treedef, num_logprobs)),
                                       out_shardings=rep)
        self.pool = jax.jit(pool_hidden, static_argnums=(2,), out_shardings=rep)


def forward_out_shardings(mesh, kv_shardings: list) -> tuple:
    """Where a forward's outputs live: (greedy ids, logits, sampling words, hidden states, KV caches)."""
    rep = replicated(mesh)
    return rep, named_sharding(mesh, (None, "vocab")), rep, rep, kv_shardings


def sampled_rows(model, hidden, batch: batching.StepBatch, num_sampled: int) -> tuple:
    """A forward's outputs but its caches, from the final hidden states [T, hidden_size]: (the greedy ids
    [num_sampled] int32, the logits [L, vocab] float32 at batch.logits_indices, their sampling words, hidden)."""
    logits = model.compute_logits(hidden[batch.logits_indices])
    greedy = jnp.pad(jnp.argmax(logits, axis=-1).astype(jnp.int32), (0, num_sampled - logits.shape[0]))
    return greedy, logits, batch.sampling, hidden


def traced_invariant(fn, mesh=None):
    """fn, its model traced with the batch-invariant ops; mesh: where its params live (under tensor
    parallelism each device runs the ops on its own shards, kernels/batch_invariant.py)."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with batch_invariant.tracing(mesh=mesh):
            return fn(*args, **kwargs)
    return traced


def layer_routing(recorded: list, halves: bool):
    """Each MoE layer's expert ids [T, k] as recording_routing recorded them -> [T, moe_layers, k] (halves:
    the step ran in two halves, models/dual_batch.py, and each layer routed the first, then the second)."""
    if halves:
        recorded = [jnp.concatenate(recorded[i:i + 2]) for i in range(0, len(recorded), 2)]
    return jnp.stack(recorded, axis=1)


def step_routing(ids, logits_indices, md: AttentionMetadata, num_experts: int):
    """A MoE model's routing in a step: ids, each MoE layer's expert ids [T, moe_layers, k] (layer_routing) ->
    (the ids at each sampled token [L, moe_layers, k] int32: the row of a token taken is the routing of the
    forward that sampled it; the step's real tokens routed to each expert [moe_layers, num_experts] int32)."""
    real = jnp.arange(ids.shape[0]) < md.query_start_loc[md.num_seqs[0]]
    counts = jnp.zeros((ids.shape[1], num_experts), jnp.int32)
    counts = counts.at[jnp.arange(ids.shape[1])[None, :, None], ids].add(real[:, None, None].astype(jnp.int32))
    return ids[logits_indices], counts


def make_forward_fn(graphdef, params_treedef, attn_fn, layouts: dict[int, batching.BatchLayout], num_sampled: int,
                    aux_layers: tuple[int, ...] = (), drafter_block_size: int | None = None, num_experts: int = 0,
                    dbo: bool = False):
    """The jitted forward's function (a closure, not a method: the runner is not kept alive by its executables)."""
    def step(params, kv_caches, prev_tokens, buffer, token_bucket: int, decodes_only: bool = False, lora=None):
        """params: flat weights; kv_caches: per KV tensor its arrays (worker/kv_cache.py);
        prev_tokens: the previous step's tokens on the device, its sampled ids [num_sampled] int32, or with a
        drafter its table (draft_inputs.py); buffer [size] int32: this step's inputs, laid out as
        `token_bucket`'s BatchLayout; decodes_only: every request of the step has one token
        (AttentionMetadata.decodes_only); lora: with LoRA, each target module's stacked slots
        (jaxllm/lora/slots.py), which the buffer's lora_slots index. Returns (the greedy ids [num_sampled]
        int32, the logits [L, vocab] float32 at each sampled position (a request's last token, and its
        drafts'), their L rows of sampling words, the final hidden states [T, hidden_size] (for prompt
        logprobs and an EAGLE head), kv_caches, a MoE model's step_routing arrays (else ())),
        with a drafter the buffer [size] holding the tokens and positions the step ran (what the drafter
        reads), and with aux_layers the states entering them [T, len(aux_layers) * hidden_size]."""
        layout = layouts[token_bucket]
        batch = layout.unpack(buffer, decodes_only)
        if drafter_block_size is None:
            batch = dataclasses.replace(batch, input_ids=jnp.where(
                batch.prev_rows >= 0, prev_tokens[jnp.maximum(batch.prev_rows, 0)], batch.input_ids))
        else:
            batch = read_previous_step(batch, prev_tokens, drafter_block_size)
        model = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, params))
        md = batch.attention
        with_lora = {} if lora is None else {"lora": LoRABatch.of(lora, batch.lora_slots)}
        with recording_routing() as recorded:
            if dbo:
                x, kv_caches = decode_two_halves(model, model.embed(batch.input_ids), batch.positions, kv_caches, md,
                                                 attn_fn, range(len(model.layers)))
                hidden = model.norm(x)
            elif aux_layers:
                hidden, kv_caches, aux = model(batch.input_ids, batch.positions, kv_caches, md, attn_fn, aux_layers,
                                               **with_lora)
            else:
                hidden, kv_caches = model(batch.input_ids, batch.positions, kv_caches, md, attn_fn, **with_lora)
        halves = dbo and in_halves(batch.input_ids.shape[0])
        routing = () if not num_experts else step_routing(layer_routing(recorded, halves), batch.logits_indices, md,
                                                          num_experts)
        outputs = sampled_rows(model, hidden, batch, num_sampled) + (kv_caches, routing)
        if drafter_block_size is not None:
            outputs += (layout.replace(buffer, input_ids=batch.input_ids, positions=batch.positions,
                                       slot_mapping=md.slot_mapping, seq_lens=md.seq_lens, sampling=batch.sampling),)
        return outputs + (aux,) if aux_layers else outputs
    return step


def make_prompt_logprobs_fn(graphdef, params_treedef, num_logprobs: int):
    def prompt_logprobs(params, hidden, indices, targets):
        """hidden [T, hidden_size]; indices [C] int32: tokens whose logits give a prompt position's
        logprobs; targets [C] int32: the prompt's ids at those positions. Returns compute_logprobs'
        arrays for the C positions (the target's own logprob first)."""
        model = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, params))
        return compute_logprobs(model.compute_logits(hidden[indices]), targets, num_logprobs)
    return prompt_logprobs


def sample_padded(logits, words, mode: SampleMode, num_sampled: int) -> jax.Array:
    """Sampled ids [num_sampled] int32: the L rows' first, then zeros."""
    tokens = sample(logits, SamplingMetadata.from_words(words), mode)
    return jnp.pad(tokens, (0, num_sampled - tokens.shape[0]))


def sample_processed(logits, words, state: ProcessorState, bitmask, user_states: tuple, mode: SampleMode,
                      num_sampled: int, user_processors: tuple, num_speculative_tokens: int = 0):
    """The logits processors (the built-in ones, then the users'), then the sampler; each
    request with built-in processors counts the ids it takes. Returns (ids [num_sampled]
    int32, the new ProcessorState)."""
    md = ProcessorMetadata.from_words(words)
    logits = processors.apply_processors(logits, md, state, bitmask, num_speculative_tokens)
    for processor, user_state in zip(user_processors, user_states):
        logits = processor.apply(user_state, logits)
    tokens = sample(logits, SamplingMetadata.from_words(words), mode)
    return (jnp.pad(tokens, (0, num_sampled - tokens.shape[0])),
            processors.count_sampled(state, md, tokens, num_speculative_tokens))
