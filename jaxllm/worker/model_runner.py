"""ModelRunner: owns the weights and the paged KV cache on the mesh, and runs one
step per SchedulerOutput: the forward pass to the logits at each request's last token
and their argmax (one executable per token bucket, the KV cache donated, so updated
in place), then, unless every request is greedy, the sampler (one executable per
request bucket and SampleMode), and, when a request asks for logprobs, the logprobs
of the sampled ids (one executable per request bucket; jaxllm/sample/logprobs.py).

A step is dispatched without waiting for the previous one: its sampled ids stay on
the device, padded to max_num_seqs, and the next step reads from there a token the
host does not have yet (asynchronous scheduling).
"""
import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.profiler import TraceAnnotation
from tqdm import tqdm

from jaxllm import compilation
from jaxllm.config import Config, ModelConfig
from jaxllm.core.kv_cache_manager import cdiv
from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.engine import LogprobsArrays
from jaxllm.kernels.attention import get_attention_fn
from jaxllm.models.loader import create_model
from jaxllm.sample.logprobs import compute_logprobs
from jaxllm.sample.sampler import SampleMode, sample
from jaxllm.sharding import kv_cache_sharding, make_mesh, named_sharding, replicated
from jaxllm.worker import batch as batching

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 512 << 20  # CPU devices report no memory: cap the cache at 512 MiB
_COMPILE_THREADS = min(8, os.cpu_count() or 1)


def iter_weights(mc: ModelConfig):
    """(HF name, numpy array) pairs from the model's checkpoint, whatever its format."""
    if mc.format == "gguf":
        from jaxllm.models.gguf import iter_gguf_weights
        return iter_gguf_weights(mc.path)
    from jaxllm.models.loader import iter_hf_weights
    return iter_hf_weights(mc.path)


class ModelRunner:
    def __init__(self, config: Config):
        self.config = config
        mc, sc = config.model, config.scheduler
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = cdiv(mc.max_model_len, self.block_size)
        self.mesh = make_mesh(config.parallel.tensor_parallel_size)
        compilation.install_compile_counter()
        compilation.enable_persistent_cache()

        start = time.perf_counter()
        weights = None if mc.load_format == "dummy" else iter_weights(mc)
        model = create_model(mc.arch, dtype=mc.dtype, mesh=self.mesh, weights=weights, seed=config.seed)
        self._graphdef, state = nnx.split(model)
        # A flat list of arrays dispatches faster than an nnx.State (0.14 vs 0.7 ms for 8B).
        self._params, self._params_treedef = jax.tree.flatten(state)
        jax.block_until_ready(self._params)
        self.startup_s = {"weights": time.perf_counter() - start}  # then "kv_cache", "compile" (warm_up)
        self._attn_fn = get_attention_fn(config.attention_backend, self.mesh)

        self.num_blocks = self._num_blocks()
        if self.num_blocks * self.block_size < mc.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_blocks * self.block_size} tokens, fewer than max_model_len "
                f"({mc.max_model_len}): raise gpu_memory_utilization or num_gpu_blocks_override, or lower max_model_len")
        start = time.perf_counter()
        self.kv_caches = jax.block_until_ready(self._allocate_kv_caches())
        self.startup_s["kv_cache"] = time.perf_counter() - start
        self.token_buckets = batching.token_buckets(sc.max_num_batched_tokens)
        self.request_rows = batching.RequestRows(self.max_blocks_per_seq, 2 * sc.max_num_seqs)
        layouts = [batching.BatchLayout(t, batching.request_bucket(t, sc.max_num_seqs), self.max_blocks_per_seq)
                   for t in self.token_buckets]
        self._host_buffers = {}
        for layout in layouts:
            buffers = [np.zeros(layout.size, np.int32) for _ in range(2)]
            self._host_buffers[layout.num_tokens] = [(b, layout.host_views(b)) for b in buffers]
        self._num_steps = 0
        # (width, then the step's inputs: bucket, buffer, mode, with logprobs)
        self._widest_step: tuple[tuple[int, int], int, np.ndarray, SampleMode, bool] | None = None
        self._prev_sampled = self._zero_sampled()
        forward_fn = _make_forward_fn(self._graphdef, self._params_treedef, self._attn_fn,
                                      {layout.num_tokens: layout for layout in layouts}, sc.max_num_seqs)
        # Pin the outputs' shardings, so the next step sees the same inputs.
        kv_sharding = kv_cache_sharding(self.mesh)
        self._forward = jax.jit(forward_fn, donate_argnums=(1,), static_argnums=(4,), out_shardings=(
            replicated(self.mesh), named_sharding(self.mesh, (None, "vocab")), replicated(self.mesh),
            [(kv_sharding, kv_sharding)] * mc.arch.num_layers))
        self._sample = jax.jit(functools.partial(_sample_padded, max_num_seqs=sc.max_num_seqs),
                               static_argnums=(2,), out_shardings=replicated(self.mesh))
        self.num_logprobs = min(mc.max_logprobs, mc.arch.vocab_size)  # K: the top tokens every request gets
        self._logprobs = jax.jit(functools.partial(compute_logprobs, num_logprobs=self.num_logprobs),
                                 out_shardings=replicated(self.mesh))
        # Compiled executables: the forward per token bucket, the sampler per (request bucket, mode);
        # the forward's own argmax samples a greedy batch, with no second call.
        self._forwards: dict[int, jax.stages.Compiled] = {}
        self._samplers: dict[tuple[int, SampleMode], jax.stages.Compiled] = {}
        self._logprob_fns: dict[int, jax.stages.Compiled] = {}  # per request bucket

    # ---- memory ----
    def _kv_bytes_per_block(self) -> int:
        arch = self.config.model.arch
        itemsize = jnp.dtype(self.config.model.dtype).itemsize
        return 2 * arch.num_layers * self.block_size * arch.num_kv_heads * arch.head_dim * itemsize

    def _num_blocks(self) -> int:
        if self.config.cache.num_gpu_blocks_override:
            return self.config.cache.num_gpu_blocks_override
        per_block = self._kv_bytes_per_block()
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            budget = (stats["bytes_limit"] * self.config.cache.gpu_memory_utilization
                      - stats["bytes_in_use"] - self._activation_bytes())
        else:
            sc = self.config.scheduler
            budget = min(_CPU_KV_CACHE_BYTES, sc.max_num_seqs * cdiv(sc.max_model_len, self.block_size) * per_block)
        return max(int(budget // per_block), 0)

    def _activation_bytes(self) -> int:
        """A generous bound on the step's transient memory at the largest bucket."""
        arch, sc = self.config.model.arch, self.config.scheduler
        tokens = sc.max_num_batched_tokens
        per_token = 4 * (4 * arch.hidden_size + 3 * arch.intermediate_size
                         + 2 * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim)
        logits = 4 * min(tokens, sc.max_num_seqs) * arch.vocab_size * 4
        return 2 * (tokens * per_token + logits) + (256 << 20)

    def reset_kv_caches(self) -> None:
        """Fresh caches and no step history, after a failed step may have consumed the donated caches."""
        for array in jax.tree.leaves(self.kv_caches):
            if not array.is_deleted():
                array.delete()
        self.kv_caches = self._allocate_kv_caches()
        self.request_rows.clear()
        self._prev_sampled = self._zero_sampled()

    def _allocate_kv_caches(self):
        arch = self.config.model.arch
        shape = (self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        sharding = kv_cache_sharding(self.mesh)
        dtype = self.config.model.dtype
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return [(zeros(), zeros()) for _ in range(arch.num_layers)]

    def _zero_sampled(self) -> jax.Array:
        return jax.device_put(np.zeros(self.config.scheduler.max_num_seqs, np.int32), replicated(self.mesh))

    def shutdown(self) -> None:
        """Free the device memory now (weights and KV cache), not when a collector finds it."""
        for array in jax.tree.leaves((self._params, self.kv_caches, self._prev_sampled)):
            array.delete()
        self._params = self.kv_caches = self._prev_sampled = None

    # ---- the step ----
    def _token_bucket(self, num_tokens: int) -> int:
        return next(b for b in self.token_buckets if b >= num_tokens)

    def _next_host_buffer(self, token_bucket: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The bucket's two host buffers in turn: with two steps in flight, a buffer
        is rewritten only once the step that read it has finished."""
        self._num_steps += 1
        return self._host_buffers[token_bucket][self._num_steps % 2]

    def _lower_forward(self, token_bucket: int) -> jax.stages.Lowered:
        buffer = self._host_buffers[token_bucket][0][0]
        return self._forward.lower(self._params, self.kv_caches, self._prev_sampled, buffer, token_bucket)

    def _dispatch(self, token_bucket: int, buffer: np.ndarray, mode: SampleMode,
                  with_logprobs: bool = False) -> tuple[jax.Array, "Logprobs | None"]:
        """Run a step's forward, unless the batch is greedy its sampler, and if asked the
        logprobs of its sampled ids (compiling them first if warm_up did not). Returns the
        sampled ids and the logprobs (or None)."""
        if token_bucket not in self._forwards:
            self._forwards[token_bucket] = self._lower_forward(token_bucket).compile()
        with TraceAnnotation("dispatch"):
            greedy, logits, sampling, self.kv_caches = self._forwards[token_bucket](
                self._params, self.kv_caches, self._prev_sampled, buffer)
        if mode == SampleMode.GREEDY:
            self._prev_sampled = greedy
        else:
            key = (logits.shape[0], mode)
            if key not in self._samplers:
                self._samplers[key] = self._sample.lower(logits, sampling, mode).compile()
            with TraceAnnotation("dispatch"):
                self._prev_sampled = self._samplers[key](logits, sampling)
        if not with_logprobs:
            return self._prev_sampled, None
        num_reqs = logits.shape[0]
        if num_reqs not in self._logprob_fns:
            self._logprob_fns[num_reqs] = self._logprobs.lower(logits, self._prev_sampled).compile()
        with TraceAnnotation("dispatch"):
            logprobs = Logprobs(*self._logprob_fns[num_reqs](logits, self._prev_sampled))
        return self._prev_sampled, logprobs

    def warm_up(self, show_progress: bool = True) -> None:
        """Compile the forward of every token bucket, and the sampler (of every mode) and the
        logprobs of every request bucket now, so serving never compiles, then run each once.
        Tracing holds the GIL and XLA's compilation does not: each bucket is traced here
        while the ones before it compile in a thread pool."""
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(_COMPILE_THREADS) as pool:
            forwards, samplers, logprob_fns = {}, {}, {}
            for token_bucket in self.token_buckets:
                lowered = self._lower_forward(token_bucket)
                forwards[token_bucket] = pool.submit(lowered.compile)
                sampled, logits, sampling, _ = lowered.out_info
                for mode in (SampleMode.RANDOM, SampleMode.FILTERED):
                    key = (logits.shape[0], mode)
                    if key not in samplers:
                        samplers[key] = pool.submit(self._sample.lower(logits, sampling, mode).compile)
                if logits.shape[0] not in logprob_fns:
                    logprob_fns[logits.shape[0]] = pool.submit(self._logprobs.lower(logits, sampled).compile)
            jobs = [(self._forwards, key, job) for key, job in forwards.items()]
            jobs += [(self._samplers, key, job) for key, job in samplers.items()]
            jobs += [(self._logprob_fns, key, job) for key, job in logprob_fns.items()]
            for executables, key, job in tqdm(jobs, desc="Compiling", disable=not show_progress):
                executables[key] = job.result()
        for token_bucket in self.token_buckets:
            buffer, views = self._next_host_buffer(token_bucket)
            batching.fill_padding(views)
            for mode in SampleMode:  # the logprobs once per bucket, with the greedy step
                jax.block_until_ready(self._dispatch(token_bucket, buffer, mode, mode == SampleMode.GREEDY))
        self.startup_s["compile"] = time.perf_counter() - start

    def execute_model(self, sched: SchedulerOutput) -> "StepOutput":
        """Dispatch one step and return at once; its sampled ids land later."""
        rows = self.request_rows.update(sched)
        token_bucket = self._token_bucket(sched.num_scheduled_tokens)
        buffer, views = self._next_host_buffer(token_bucket)
        batching.pack(sched, rows, self.request_rows, views, self.block_size)
        mode = self.request_rows.batch_sample_mode(rows)
        with_logprobs = bool(self.request_rows.wants_logprobs[rows].any())
        sampled, logprobs = self._dispatch(token_bucket, buffer, mode, with_logprobs)
        for array in (sampled, *(logprobs or ())):
            array.copy_to_host_async()
        width = (len(sched.requests), -sched.num_scheduled_tokens)  # most requests, then fewest tokens
        if self._widest_step is None or width > self._widest_step[0]:
            self._widest_step = (width, token_bucket, buffer.copy(), mode, with_logprobs)
        return StepOutput(sampled, len(sched.requests), logprobs)

    def time_widest_step(self, num_iters: int) -> float:
        """Seconds per step of the widest step since the last call (the first with the
        most requests and, among those, the fewest tokens: in a decode benchmark, the first
        step where every request decodes), its inputs replayed back to back: the device's
        time for it with no host work in between. For benchmarks, on an idle engine: the replay rewrites
        the KV slots of that step's finished requests."""
        if self._widest_step is None:
            raise RuntimeError("no step has run since the last call")
        step = self._widest_step[1:]
        self._widest_step = None
        jax.block_until_ready(self._dispatch(*step))
        start = time.perf_counter()
        for _ in range(num_iters):
            outputs = self._dispatch(*step)
        jax.block_until_ready(outputs)
        return (time.perf_counter() - start) / num_iters

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        gib = self.num_blocks * self._kv_bytes_per_block() / 2**30
        startup = ", ".join(f"{phase} {s:.1f} s" for phase, s in self.startup_s.items())
        return (f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens "
                f"({self.kv_cache_tokens} tokens, {gib:.2f} GiB); token buckets {self.token_buckets}; "
                f"attention backend {self.config.attention_backend}; start-up: {startup}")


class Logprobs(NamedTuple):
    """A step's sample logprobs on the device (compute_logprobs), one row per request of its bucket."""
    logprobs: jax.Array   # [R, 1 + K] float32: the sampled token's, then the top K
    token_ids: jax.Array  # [R, 1 + K] int32
    ranks: jax.Array      # [R] int32: the sampled token's rank (1 = most likely)


@dataclasses.dataclass
class StepOutput:
    """A dispatched step: its sampled ids (and logprobs, if a request asked) are on their way to the host."""
    sampled: jax.Array  # [max_num_seqs] int32, on the device
    num_reqs: int
    logprobs: Logprobs | None = None

    def token_ids(self) -> list[int]:
        """Each scheduled request's sampled id; blocks until the step has finished."""
        return np.asarray(self.sampled)[:self.num_reqs].tolist()

    def host_logprobs(self) -> LogprobsArrays | None:
        """The logprobs on the host, row i for scheduled request i (blocks until the step has
        finished), or None if no request asked."""
        if self.logprobs is None:
            return None
        return LogprobsArrays(*(np.asarray(a) for a in self.logprobs))


def _make_forward_fn(graphdef, params_treedef, attn_fn, layouts: dict[int, batching.BatchLayout], max_num_seqs: int):
    """The jitted forward's function (a closure, not a method: the runner is not kept alive by its executables)."""
    def step(params, kv_caches, prev_sampled, buffer, token_bucket: int):
        """params: flat weights; kv_caches: per layer (K, V) [num_blocks, block_size, kv_heads, head_dim];
        prev_sampled [max_num_seqs] int32: the previous step's ids; buffer [size] int32: this step's inputs,
        laid out as `token_bucket`'s BatchLayout. Returns (the greedy ids [max_num_seqs] int32, the logits
        [R, vocab] float32 at each request's last token, the SamplingMetadata of the R requests, kv_caches)."""
        batch = layouts[token_bucket].unpack(buffer)
        input_ids = jnp.where(batch.prev_rows >= 0, prev_sampled[jnp.maximum(batch.prev_rows, 0)], batch.input_ids)
        model = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, params))
        hidden, kv_caches = model(input_ids, batch.positions, kv_caches, batch.attention, attn_fn)
        logits = model.compute_logits(hidden[batch.logits_indices])
        greedy = _sample_padded(logits, batch.sampling, SampleMode.GREEDY, max_num_seqs)
        return greedy, logits, batch.sampling, kv_caches
    return step


def _sample_padded(logits, sampling, mode: SampleMode, max_num_seqs: int) -> jax.Array:
    """Sampled ids [max_num_seqs] int32: the R requests' first, then zeros."""
    tokens = sample(logits, sampling, mode)
    return jnp.pad(tokens, (0, max_num_seqs - tokens.shape[0]))
