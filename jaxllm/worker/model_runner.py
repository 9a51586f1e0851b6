"""ModelRunner: one step per SchedulerOutput, on the weights and the paged KV cache it holds
on the mesh. Its parts: the weights (model_loader.py), the KV cache (kv_cache.py), the
compiled executables (executables.py; what warm-up builds, warm_up.py), the persistent request
rows and the packing of a step's inputs (input_batch.py), the logits processors' per-request
state (processor_state.py), the jitted functions (step_functions.py), the sampling
(step_sampling.py), and under pipeline parallelism the stages the forward runs through (pipeline.py).

A step is the forward pass to the logits at each request's last token (and, with
speculative decoding, at each of its draft tokens: those logits check the drafts) and their argmax
(one executable per token bucket, the KV cache donated, so updated in place), then their
sampling and logprobs (step_sampling.py). With pooling requests (runner="pooling"), their
tokens' hidden states are pooled too (per token bucket; worker/pooler.py).

A step is dispatched without waiting for the previous one: its sampled ids stay on the
device, padded to the widest bucket's rows of logits, and the next step reads from there a
token the host does not have yet (asynchronous scheduling). A step with requests under the core's token masks
(structured outputs, multi-token bad words) dispatches its forward in execute_model and its
sampling in sample_tokens, once the core has made the masks.

Speculative decoding: a request with drafts has a row of logits per draft and one for its
last token, each sampled as if the tokens before it had come one by one (same key, same
processors). It takes the run of drafts its samples agree with, and the sample after that
run (StepOutput.get_output). With drafts that are one guess each (n-gram), that is exact
rejection sampling: a draft is kept with the probability the model gives it, and the token
sampled where one is not is drawn from the model's distribution without it. A draft model
(worker/draft_model.py), an EAGLE head (worker/eagle.py) or, under asynchronous scheduling, n-gram
lookup (worker/ngram_drafter.py) makes the next step's drafts on the device, in an executable of
its own after the sampling, from the tokens each request took (and the head from the forward's
hidden states).
"""
import os
import time
from typing import NamedTuple

import jax
import numpy as np
from jax.profiler import TraceAnnotation

from jaxllm import compilation
from jaxllm.config import Config
from jaxllm.contracts.step import SchedulerOutput, TokenMasks
from jaxllm.kernels.attention import get_attention_fn
from jaxllm.lora.slots import LoRASlots
from jaxllm.models.kv_layout import model_kv_layout
from jaxllm.sample.sampler import SampleMode
from jaxllm.sharding import make_mesh, make_stage_meshes, replicated
from jaxllm.speculative_config import EAGLE_METHODS
from jaxllm.utils import cdiv
from jaxllm.worker import input_batch as batching, kv_heads, model_loader
from jaxllm.worker.draft_model import DraftModel
from jaxllm.worker.eagle import EagleProposer
from jaxllm.worker.executables import DRAFT, FORWARD, POOL, ExecutableKey, Executables, compiler_options
from jaxllm.worker.kv_cache import KVCache
from jaxllm.worker.model_loader import load_weights
from jaxllm.worker.ngram_drafter import NgramDrafter
from jaxllm.worker.pipeline import Pipeline
from jaxllm.worker.pooler import Pooler, StepPooling
from jaxllm.worker.processor_state import ProcessorRows
from jaxllm.worker.step_functions import StepFunctions
from jaxllm.worker.step_output import Logprobs, StepOutput
from jaxllm.worker.step_sampling import Forward, StepSampling
from jaxllm.worker.step_replay import StepReplay
from jaxllm.worker.warm_up import executable_store, run_warm_up


def single_token_bucket(platform: str) -> bool:
    """Whether the runner has a bucket of one token (batching.token_buckets), for a lone request's
    decode step: its attention then splits the context over every SM of a GPU, not over the programs a
    bucket of 16 request slots plans for (pallas_attention.plan: a sixteenth of them working, at batch
    1). On an H100 it took the 8B shape's batch-1 step from 20.2 to 10.2 ms at 100k context and from 10.6
    to 7.2 ms at 32k (docs/benchmarks.md), for two more executables (its forward and prompt logprobs).
    On by default on a GPU, where the split is planned; JAXLLM_SINGLE_TOKEN_BUCKET=0 / 1 turns it off /
    on anywhere. Never for a model with Mamba layers (ModelRunner): every step of one token is its
    decodes-only forward's."""
    chosen = os.environ.get("JAXLLM_SINGLE_TOKEN_BUCKET")
    return platform == "gpu" if chosen is None else chosen == "1"


class _Step(NamedTuple):
    """What a step's sampling needs once its forward is on its way."""
    sched: SchedulerOutput
    rows: np.ndarray  # [n] int32: the scheduled requests' rows
    first_rows: np.ndarray | None  # with drafts, each request's first row of logits (else row i is request i's)
    forward: Forward
    mode: SampleMode
    processed: bool
    num_logprobs: int | None
    prompt_inputs: list
    prompt_segments: list
    failed: dict[str, str]
    pooling: StepPooling | None


class ModelRunner:
    def __init__(self, config: Config, show_progress: bool = False, params=None):
        """params: the model's params in memory (models/params.py's layouts), instead of its checkpoint."""
        self.config = config
        mc, sc = config.model, config.scheduler
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = cdiv(mc.max_model_len, self.block_size)
        # Under pipeline parallelism (worker/pipeline.py) the weights and KV arrays live on each stage's mesh,
        # and self.mesh, where the sampling runs, is the last stage's.
        parallel = config.parallel
        self.stage_meshes = make_stage_meshes(parallel.tensor_parallel_size, parallel.layer_partition)
        self.mesh = self.stage_meshes.meshes[-1] if self.stage_meshes else make_mesh(
            parallel.tensor_parallel_size, device_ids=parallel.device_ids)
        compilation.install_compile_counter()
        compilation.enable_persistent_cache()
        # A step's outputs start for the host as soon as it is dispatched, so that reading them waits for the
        # step alone. Not on a CPU, where they are in host memory already: there a copy's completion could
        # still be running in XLA's thread when a script's interpreter exits, and it aborts the process
        # ("terminate called without an active exception").
        self._copies_ahead = self.mesh.devices.flat[0].platform != "cpu"

        start = time.perf_counter()
        self._repeat = kv_heads.kv_head_repeat(mc.arch, config.parallel.tensor_parallel_size)
        self.arch = kv_heads.replicated_arch(mc.arch, self._repeat)  # what runs: KV heads repeated to one per device
        self.weights = load_weights(mc, self.arch, self.stage_meshes or self.mesh, self._repeat, config.seed, show_progress, params)
        self._from_memory = params is not None  # no checkpoint to wake sleeping weights from
        self._param_specs: model_loader.ParamSpecs | None = None  # what update_weights takes: made at the first
        self.kv_layout = model_kv_layout(self.arch)  # the KV cache groups: one block table each
        num_groups = len(self.kv_layout.groups)
        self.token_buckets = batching.token_buckets(sc.max_num_batched_tokens,
                                                    single_token_bucket(self.mesh.devices.flat[0].platform)
                                                    and self.arch.mamba is None)
        num_spec = config.num_speculative_tokens
        eagle = config.speculative is not None and config.speculative.method in EAGLE_METHODS
        rows = [batching.logit_rows(t, sc.max_num_seqs, num_spec) for t in self.token_buckets]
        if len(rows) > 1 and self.token_buckets[0] == 1:
            rows[0] = rows[1]  # the one-token bucket samples with the next bucket's samplers
        layouts = {t: batching.BatchLayout(t, batching.request_bucket(t, sc.max_num_seqs), self.max_blocks_per_seq,
                                           num_groups, num_rows, eagle, config.lora is not None)
                   for t, num_rows in zip(self.token_buckets, rows)}
        self.layouts = layouts
        attn_fn = get_attention_fn(config.attention_backend, self.mesh, config.batch_invariant,
                                   latent=self.arch.mla is not None)
        self.draft = None  # a drafter on the device: a draft model, an EAGLE head, or n-gram lookup
        if config.speculative is not None and config.speculative.draft is not None:
            self.draft = (EagleProposer if eagle else DraftModel)(config, self.mesh, attn_fn, layouts)
        elif config.drafts_on_device:
            self.draft = NgramDrafter(config, self.mesh, layouts)
        # The target layers whose input states an EAGLE-3 head reads: the forward returns them too.
        self.aux_layers = config.speculative.draft.arch.aux_layer_ids if eagle else ()
        # With enable_lora, the adapters' device slots (jaxllm/lora/slots.py): the forward's `lora` argument.
        self.lora = (LoRASlots(config.lora, mc.arch, self.arch, self._repeat, mc.dtype, self.mesh)
                     if config.lora else None)
        self.startup_s = {"weights": time.perf_counter() - start}  # then "kv_cache", "compile" (warm_up)
        self.compile_split = ""  # what the compile phase spent its time on (warm_up)
        self.kv_cache = KVCache(config, self.arch, self.kv_layout, self.mesh,
                                self.draft.kv_tensors(self.block_size) if self.draft else None, self.stage_meshes)
        start = time.perf_counter()
        self.kv_cache.allocate()
        self.startup_s["kv_cache"] = time.perf_counter() - start

        self.request_rows = batching.RequestRows(self.max_blocks_per_seq, sc.max_num_seqs, num_groups)
        self.pooler = Pooler(mc.pooler_config) if mc.pooler_config is not None else None
        # The sampled ids' array: as long as the widest bucket's rows of logits (max_num_seqs without drafts).
        self.num_sampled = layouts[self.token_buckets[-1]].num_rows
        # A buffer per step in flight (two with asynchronous scheduling, one per pipeline stage)
        self.host_buffers = batching.HostBuffers(layouts, max(2, parallel.pipeline_parallel_size))
        user_processors = tuple(cls(config) for cls in config.logits_processors)
        num_logprobs = min(mc.max_logprobs, mc.arch.vocab_size)  # the most top tokens a request gets
        self.fns = StepFunctions(self.weights.graphdef, self.weights.treedef, attn_fn, layouts, self.num_sampled, self.mesh,
            self.kv_cache.shardings, user_processors, num_logprobs, config.batch_invariant, num_spec,
            self.aux_layers, self.block_size if self.draft else None, mc.arch.moe.num_experts if mc.arch.moe else 0,
            config.enable_dbo)
        self.processor_rows = ProcessorRows(config, user_processors, self.fns.write_rows,
                                            self.fns.processor_state_sharding)
        self.pipeline = Pipeline(self.weights, self.stage_meshes, self.arch, self.kv_cache, layouts, self.num_sampled,
                                 config.attention_backend, config.batch_invariant, mc.dtype,
                                 config.enable_dbo) if self.stage_meshes else None
        # Per request of the drafter's table (draft_inputs.py): its last token, its k drafts, its rejected count.
        self._table_width = 2 + num_spec if self.draft else 0
        self._prev_tokens = self._zero_prev_tokens()  # the last step's tokens on the device, for the next one
        self.executables = Executables(executable_store(self), compiler_options(config, self.mesh))
        self.sampling = StepSampling(self.executables, self.fns, self.processor_rows, self.mesh, mc.arch.vocab_size,
                                     num_logprobs)
        self._waiting: _Step | None = None  # a step whose sampling waits for the core's token masks
        self.step_replay: StepReplay | None = None  # a benchmark's recorder, off unless armed

    @property
    def head_params(self) -> list[jax.Array]:
        """The params that compute logits from the forward's hidden states, on the sampling's mesh."""
        return self.pipeline.head_params if self.pipeline else self.weights.params

    @property
    def draft_weights(self):
        """A draft model's or EAGLE head's weights (ModelWeights); None without one (n-gram lookup has none)."""
        return self.draft and self.draft.weights

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def kv_caches(self) -> list[tuple[jax.Array, jax.Array]]:
        return self.kv_cache.caches

    def _zero_prev_tokens(self) -> jax.Array:
        """What the forward reads the step before's tokens from when there was none: the step's sampled
        ids [num_sampled], or with a drafter its table [table rows, 2 + k]."""
        shape = (self.draft.table_rows, self._table_width) if self.draft else (self.num_sampled,)
        return jax.device_put(np.zeros(shape, np.int32), replicated(self.mesh))

    def reset_kv_caches(self) -> None:
        """Fresh caches and no step history, after a failed step may have consumed the donated caches."""
        self.kv_cache.delete()
        self.kv_cache.allocate()
        self.request_rows.clear()
        if self.pooler is not None:
            self.pooler.clear()
        self._waiting = None
        self._prev_tokens = self._zero_prev_tokens()
        self.processor_rows.reset()

    # ---- weights and memory (an engine inside a JAX program) ----
    def get_params(self) -> dict:
        """The params as a nested dict (the engine's layout): the engine's own arrays."""
        return self.weights.as_dict()

    def update_weights(self, source) -> None:
        """New weights in place of the old, in the same shardings (the executables stay valid):
        `source` is params in memory (either layout of models/params.py) or a checkpoint's path;
        checked whole before any param changes. FP8 weights are quantized again on the device."""
        meshes = self.stage_meshes or self.mesh
        if self._param_specs is None:
            self._param_specs = model_loader.ParamSpecs.of(self.arch, self.config.model.dtype, meshes)
        model_loader.update(self.weights, model_loader.new_params(self.config, self.arch, meshes, self._repeat,
                                                                  self._param_specs, source))
        if self.pipeline:  # each stage's param list holds the arrays it was given
            self.pipeline.set_weights(self.weights)

    def sleep(self, level: int) -> None:
        """Free the KV cache and the per-request state (level 1), and the weights too (level 2)."""
        self.kv_cache.delete()
        self.processor_rows.delete()
        self._prev_tokens.delete()
        self.sampling.delete()
        self.request_rows.clear()
        if self.pooler is not None:
            self.pooler.clear()
        self._waiting = None
        if level == 2:
            self.weights.delete()
            if self.draft_weights:
                self.draft_weights.delete()

    def wake_up(self, tags: list[str]) -> None:
        """Make again what sleep freed: "weights" (from the checkpoint; an engine given its params
        in memory takes new ones through update_weights instead) and "kv_cache" (and the
        per-request state). Same shapes and shardings: nothing compiles."""
        if "weights" in tags and self.weights.deleted:
            if self._from_memory:
                raise ValueError("this engine's weights came from memory and slept at level 2: pass them "
                                 "to update_weights, which wakes them")
            self.weights = load_weights(self.config.model, self.arch, self.stage_meshes or self.mesh, self._repeat,
                                        self.config.seed)
            if self.pipeline:
                self.pipeline.set_weights(self.weights)
        if "weights" in tags and self.draft_weights and self.draft_weights.deleted:
            self.draft.reload()
        if "kv_cache" in tags and self.kv_cache.caches is None:
            self.kv_cache.allocate()
            self.processor_rows.reset()
            self._prev_tokens = self._zero_prev_tokens()

    def logprobs_fn(self):
        """The model's plain full-sequence logprobs, a pure function of params (sequence_logprobs.py)."""
        from jaxllm.worker.sequence_logprobs import make_logprobs_fn
        if self.pipeline:
            raise ValueError("logprobs_fn does not run under pipeline_parallel_size > 1 yet")
        return make_logprobs_fn(self)

    def shutdown(self) -> None:
        """Free the device memory now (weights and KV cache), not when a collector finds it."""
        self.weights.delete()
        if self.lora:
            self.lora.delete()
        if self.draft_weights:
            self.draft_weights.delete()
        self.kv_cache.delete()
        self.processor_rows.delete()
        self.sampling.delete()
        self._prev_tokens.delete()

    # ---- the step ----
    def execute_model(self, sched: SchedulerOutput) -> StepOutput | None:
        """Dispatch one step and return at once; its sampled ids land later. None when the step's
        sampling waits for the core's token masks (then sample_tokens dispatches it)."""
        rows, added, removed = self.request_rows.update(sched)
        if self.pooler is not None:
            self.pooler.update(sched)
        failed: dict[str, str] = {}  # request id -> why its host work failed: only it ends, with the error
        new_processed = [(row, new) for row, new in added if self.request_rows.processed[row]]
        if new_processed:
            self.processor_rows.write(new_processed, failed)
        if self.processor_rows.users and (added or removed):
            self.processor_rows.update_users(added, removed, failed)
        lora_slots = self.lora.prepare_step(sched, failed) if self.lora else None
        token_bucket, decodes_only = self._token_bucket(sched.num_scheduled_tokens), self._decodes_only(sched)
        buffer, views = self.host_buffers.next(token_bucket)
        first_rows = batching.pack(sched, rows, self.request_rows, views, self.block_size, self._table_width,
                                   lora_slots)
        mode = self.request_rows.batch_sample_mode(rows)
        processed = bool(self.processor_rows.users) or bool(self.request_rows.processed[rows].any())
        num_logprobs = self.sampling.logprob_bucket(int(self.request_rows.num_logprobs[rows].max()))
        prompt_inputs, prompt_segments = batching.prompt_logprob_inputs(sched, views, self.request_rows.prompts,
                                                                        token_bucket)
        if self.step_replay is not None:
            self.step_replay.offer(len(sched.scheduled), sched.num_scheduled_tokens,
                                   (token_bucket, buffer, mode, processed, num_logprobs, decodes_only))
        forward = self._forward(token_bucket, buffer, decodes_only)
        pool_inputs = self.pooler.token_rows(sched, views) if self.pooler is not None else None
        pooling = StepPooling(self._pool(forward, pool_inputs[0]), pool_inputs[1]) if pool_inputs else None
        step = _Step(sched, rows, first_rows, forward, mode, processed, num_logprobs, prompt_inputs, prompt_segments,
                     failed, pooling)
        if self.request_rows.host_masked[rows].any():
            self._waiting = step
            return None
        return self._sample_step(step, None)

    def sample_tokens(self, masks: TokenMasks) -> StepOutput:
        """Dispatch the sampling of the step execute_model left waiting, under the core's masks."""
        step, self._waiting = self._waiting, None
        first_rows = range(len(step.sched.scheduled)) if step.first_rows is None else step.first_rows.tolist()
        return self._sample_step(step, self.sampling.masked_bitmask(step.forward.logits.shape[0], step.sched.scheduled,
                                                                    first_rows, masks))

    def _sample_step(self, step: _Step, bitmask: np.ndarray | None) -> StepOutput:
        sampled, logprobs, prompt_logprobs, table = self._sample(
            step.forward, step.mode, step.processed, step.num_logprobs, bitmask, step.prompt_inputs, step.rows)
        # A MoE model's expert counts always (for /metrics); its sampled rows' experts when a request asked.
        routed, counts = step.forward.routing or (None, None)
        if routed is not None and not self.request_rows.routed_experts[step.rows].any():
            routed = None
        output = StepOutput(sampled, step.sched.scheduled, step.first_rows, logprobs, prompt_logprobs,
                            step.prompt_segments, step.failed, table, step.pooling, routed, counts)
        if self.pipeline and self.pipeline.output_elsewhere:
            output = self.pipeline.to_first_stage(output)
        if self._copies_ahead:
            for array in output.device_arrays():
                array.copy_to_host_async()
        return output

    def _token_bucket(self, num_tokens: int) -> int:
        return next(b for b in self.token_buckets if b >= num_tokens)

    @property
    def decodes_only_buckets(self) -> list[int]:
        """The token buckets a step of one token a request can take, which have a decodes-only forward (a
        model with Mamba layers; AttentionMetadata.decodes_only): up to the one max_num_seqs requests take."""
        if self.arch.mamba is None:
            return []
        widest = self._token_bucket(min(self.config.scheduler.max_num_seqs, self.token_buckets[-1]))
        return [t for t in self.token_buckets if t <= widest]

    def _decodes_only(self, sched: SchedulerOutput) -> bool:
        """Whether the step takes its bucket's decodes-only forward: a model with Mamba layers, and one token
        a request (AttentionMetadata.decodes_only)."""
        return self.arch.mamba is not None and sched.num_scheduled_tokens == len(sched.scheduled)

    def _forward(self, token_bucket: int, buffer: np.ndarray, decodes_only: bool = False) -> Forward:
        if self.pipeline:
            greedy, logits, words, hidden, routing = self.pipeline.forward(self.executables, token_bucket, buffer,
                                                                           decodes_only)
            return Forward(token_bucket, greedy, logits, words, hidden, None, hidden, routing)
        forward = self.executables.get(ExecutableKey(FORWARD, token_bucket, decodes_only=decodes_only),
                                       lambda: self.lower_forward(token_bucket, decodes_only))
        with TraceAnnotation("dispatch"):
            greedy, logits, words, hidden, self.kv_cache.caches, routing, *drafter_inputs = forward(
                self.weights.params, self.kv_cache.caches, self._prev_tokens, buffer, **self._lora_arg())
        draft_inputs = drafter_inputs[0] if drafter_inputs else None
        draft_hidden = drafter_inputs[1] if len(drafter_inputs) > 1 else hidden
        return Forward(token_bucket, greedy, logits, words, hidden, draft_inputs, draft_hidden, routing)

    def _pool(self, fwd: Forward, token_rows: np.ndarray) -> jax.Array:
        """The forward's hidden states summed into a row per request (worker/pooler.py), on their way to the
        host: [R, hidden_size] float32."""
        num_rows = self.layouts[fwd.token_bucket].num_reqs
        pool = self.executables.get(ExecutableKey(POOL, fwd.token_bucket), lambda: (
            self.fns.pool.lower(fwd.hidden, token_rows, num_rows)))
        with TraceAnnotation("dispatch"):
            sums = pool(fwd.hidden, token_rows)
        if self._copies_ahead:
            sums.copy_to_host_async()
        return sums

    def _propose(self, fwd: Forward, sampled: jax.Array) -> jax.Array | None:
        """With a draft model or an EAGLE head, its table (draft_inputs.py) of the step's requests: the
        token each took last, the drafts for after it, and how many of its drafts the model rejected."""
        if self.draft is None:
            return None
        propose = self.executables.get(ExecutableKey(DRAFT, fwd.token_bucket), lambda: self.lower_draft(
            fwd.token_bucket, fwd.draft_inputs, sampled, fwd.draft_hidden))
        with TraceAnnotation("dispatch"):
            table, self.kv_cache.draft_caches = propose(self.draft.params(self.weights), self.kv_cache.draft_caches,
                                                        fwd.draft_inputs, sampled, fwd.draft_hidden)
        return table

    def _sample(self, fwd: Forward, mode: SampleMode, processed: bool = False, num_logprobs: int | None = None,
                bitmask: np.ndarray | None = None, prompt_inputs=(), user_rows: np.ndarray | None = None
                ) -> tuple[jax.Array, Logprobs | None, list[Logprobs], jax.Array | None]:
        """StepSampling.sample, then a drafter's next drafts: also returns the drafter's table or None.
        The next step's forward reads its tokens from the table, or without a drafter from the sampled ids."""
        sampled, logprobs, prompt_logprobs = self.sampling.sample(fwd, mode, processed, num_logprobs, bitmask,
                                                                  prompt_inputs, user_rows, self.head_params)
        table = self._propose(fwd, sampled)
        self._prev_tokens = sampled if table is None else table
        return sampled, logprobs, prompt_logprobs, table

    def dispatch(self, token_bucket: int, buffer: np.ndarray, mode: SampleMode, processed: bool = False,
                 num_logprobs: int | None = None, decodes_only: bool = False, prompt_inputs=(),
                 token_rows: np.ndarray | None = None):
        """A whole step from a packed buffer, with no token masks (warm-up, a benchmark's replay),
        and a draft model's or EAGLE head's drafts after it; with `token_rows` [T] its pooling too."""
        forward = self._forward(token_bucket, buffer, decodes_only)
        pooled = None if token_rows is None else self._pool(forward, token_rows)
        return self._sample(forward, mode, processed, num_logprobs, None, prompt_inputs), pooled

    def lower_forward(self, token_bucket: int, decodes_only: bool = False) -> jax.stages.Lowered:
        buffer = self.host_buffers.first(token_bucket)
        if self.pipeline:
            return self.pipeline.lower(self.pipeline.num_stages - 1, token_bucket, buffer, decodes_only)
        return self.fns.forward.lower(self.weights.params, self.kv_cache.caches, self._prev_tokens, buffer,
                                      token_bucket, decodes_only, **self._lora_arg())

    def _lora_arg(self) -> dict:
        return {} if self.lora is None else {"lora": self.lora.stacks}

    # ---- LoRA adapters (jaxllm/lora/slots.py) ----
    def add_lora(self, lora_request) -> None:
        self.lora.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.lora.list_loras()

    def lower_draft(self, token_bucket: int, draft_inputs, sampled, draft_hidden) -> jax.stages.Lowered:
        """The forward's draft_inputs, sampled ids and draft_hidden (arrays or their shapes)."""
        return self.draft.propose.lower(self.draft.params(self.weights), self.kv_cache.draft_caches, draft_inputs,
                                        sampled, draft_hidden, token_bucket)

    # ---- compilation ----
    def warm_up(self, show_progress: bool = True) -> None:
        """Compile (or load) every executable and run each once (warm_up.py)."""
        run_warm_up(self, show_progress)

    # ---- benchmarks ----
    def record_widest_step(self) -> None:
        """From now on, keep the inputs of the widest step for time_widest_step."""
        self.step_replay = StepReplay(1 + self.config.num_speculative_tokens)

    def time_widest_step(self, num_iters: int) -> float:
        """Seconds per step of the widest step since record_widest_step, replayed back to back
        (worker/step_replay.py); recording stops."""
        replay, self.step_replay = self.step_replay, None
        if replay is None or replay.widest is None:
            raise RuntimeError("no step was recorded: call record_widest_step before the steps to time")
        return replay.time(self.dispatch, num_iters)

    def describe(self) -> str:
        startup = ", ".join(f"{phase} {s:.1f} s" for phase, s in self.startup_s.items())
        if self.compile_split:
            startup += f" ({self.compile_split})"
        draft = ""
        if self.draft_weights:
            draft = f" (the {self.config.speculative.method} drafter's too: {self.draft.model_config.path})"
        return (f"{self.kv_cache.describe(draft)}; token buckets {self.token_buckets}; "
                f"attention backend {self.config.attention_backend}; start-up: {startup}")
