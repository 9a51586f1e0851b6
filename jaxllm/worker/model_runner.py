"""ModelRunner: owns the weights and the paged KV cache on the mesh, and runs one
step per SchedulerOutput: the forward pass to the logits at each request's last token
and their argmax (one executable per token bucket, the KV cache donated, so updated
in place), then, unless every request is greedy with no logits processors, the sampler
(one executable per request bucket, SampleMode and whether it runs the processors of
jaxllm/sample/processors.py), and, when a request asks for them, the logprobs of the
sampled ids (one executable per request bucket and number of top tokens;
jaxllm/sample/logprobs.py) and of its prompt (one per token bucket).

A step is dispatched without waiting for the previous one: its sampled ids stay on
the device, padded to max_num_seqs, and the next step reads from there a token the
host does not have yet (asynchronous scheduling).
"""
import concurrent.futures
import functools
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.profiler import TraceAnnotation
from tqdm import tqdm

import jaxllm
from jaxllm import compilation
from jaxllm.config import Config
from jaxllm.core.kv_cache_utils import cdiv
from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.executor import multihost
from jaxllm.kernels.attention import get_attention_fn
from jaxllm.models.kv_layout import model_kv_layout
from jaxllm.models.loader import create_model, iter_weights, quantize_model
from jaxllm.sample import processors
from jaxllm.sample.logits_processor import AddedRequest, BatchUpdate
from jaxllm.sample.logprobs import compute_logprobs
from jaxllm.sample.processors import ProcessorState
from jaxllm.sample.sampler import SampleMode
from jaxllm.sharding import kv_cache_sharding, make_mesh, named_sharding, replicated
from jaxllm.sample import host_masks
from jaxllm.worker import batch as batching, kv_heads, step_functions
from jaxllm.worker.step_output import Logprobs, StepOutput

if TYPE_CHECKING:
    from jaxllm.request import Request

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 512 << 20  # CPU devices report no memory: cap the cache at 512 MiB
_PROMPT_LOGPROBS_CHUNK = 256  # prompt positions per call of the prompt-logprobs executable
_COMPILE_THREADS = min(8, os.cpu_count() or 1)


class ModelRunner:
    def __init__(self, config: Config, show_progress: bool = False):
        self.config = config
        mc, sc = config.model, config.scheduler
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = cdiv(mc.max_model_len, self.block_size)
        self.mesh = make_mesh(config.parallel.tensor_parallel_size)
        compilation.install_compile_counter()
        compilation.enable_persistent_cache()

        start = time.perf_counter()
        repeat = kv_heads.kv_head_repeat(mc.arch, config.parallel.tensor_parallel_size)
        self.arch = kv_heads.replicated_arch(mc.arch, repeat)  # what runs: KV heads repeated to one per device
        if mc.format == "orbax" and mc.load_format != "dummy":
            if repeat > 1:
                raise ValueError(f"an orbax checkpoint restores at tensor_parallel_size <= its KV heads "
                                 f"({mc.arch.num_kv_heads}); load its source (HF or GGUF) for more devices")
            from jaxllm.models.orbax_checkpoint import restore_model
            model = restore_model(mc.path, mc.arch, dtype=mc.dtype, mesh=self.mesh)  # straight into the shardings
        else:
            weights = None
            if mc.load_format != "dummy":
                weights = kv_heads.replicate_kv_weights(iter_weights(mc.path, mc.format), mc.arch.head_dim, repeat)
            model = create_model(self.arch, dtype=mc.dtype, mesh=self.mesh, weights=weights, seed=config.seed,
                                 show_progress=show_progress)
        quantize_model(model, mc.quantization, self.mesh)
        self._graphdef, state = nnx.split(model)
        # A flat list of arrays dispatches faster than an nnx.State (0.14 vs 0.7 ms for 8B).
        self._params, self._params_treedef = jax.tree.flatten(state)
        jax.block_until_ready(self._params)
        self.startup_s = {"weights": time.perf_counter() - start}  # then "kv_cache", "compile" (warm_up)
        self.compile_split = ""  # what the compile phase spent its time on (warm_up)
        self._attn_fn = get_attention_fn(config.attention_backend, self.mesh)
        self.kv_layout = model_kv_layout(self.arch)  # the KV cache groups: one block table each
        num_groups = len(self.kv_layout.groups)

        self.num_blocks = self._num_blocks()
        if self.num_blocks < self._blocks_per_request():
            raise ValueError(
                f"the KV cache has {self.num_blocks} blocks, fewer than one request of max_model_len "
                f"({mc.max_model_len}) tokens takes ({self._blocks_per_request()}): raise "
                "gpu_memory_utilization or num_gpu_blocks_override, or lower max_model_len")
        cache_dtype = jnp.dtype(config.cache.cache_dtype)
        if cache_dtype.itemsize == 1:  # as vLLM warns, for the same reason
            logger.warning("the %s KV cache stores K and V with scale 1.0 (a checkpoint's k_scale / v_scale are "
                           "not read): values past the format's range saturate", cache_dtype.name)
        start = time.perf_counter()
        self.kv_caches = jax.block_until_ready(self._allocate_kv_caches())
        self.startup_s["kv_cache"] = time.perf_counter() - start
        self.token_buckets = batching.token_buckets(sc.max_num_batched_tokens)
        self.request_rows = batching.RequestRows(self.max_blocks_per_seq, sc.max_num_seqs, num_groups)
        self._processor_state = self._zero_processor_state()
        layouts = [batching.BatchLayout(t, batching.request_bucket(t, sc.max_num_seqs), self.max_blocks_per_seq,
                                        num_groups) for t in self.token_buckets]
        self._host_buffers = {}
        for layout in layouts:
            buffers = [np.zeros(layout.size, np.int32) for _ in range(2)]
            self._host_buffers[layout.num_tokens] = [(b, layout.host_views(b)) for b in buffers]
        self._num_steps = 0
        # (width, then the step's inputs: bucket, buffer, mode, with processors, number of logprobs)
        self._widest_step: tuple[tuple[int, int], int, np.ndarray, SampleMode, bool, int | None] | None = None
        self._prev_sampled = self._zero_sampled()
        forward_fn = step_functions.make_forward_fn(self._graphdef, self._params_treedef, self._attn_fn,
                                                    {layout.num_tokens: layout for layout in layouts}, sc.max_num_seqs)
        # Pin the outputs' shardings, so the next step sees the same inputs.
        kv_sharding = kv_cache_sharding(self.mesh)
        vocab_sharded = named_sharding(self.mesh, (None, "vocab"))
        self._forward = jax.jit(forward_fn, donate_argnums=(1,), static_argnums=(4,), out_shardings=(
            replicated(self.mesh), vocab_sharded, replicated(self.mesh), replicated(self.mesh),
            [(kv_sharding, kv_sharding)] * self.kv_layout.num_tensors))
        self._sample = jax.jit(functools.partial(step_functions.sample_padded, max_num_seqs=sc.max_num_seqs),
                               static_argnums=(2,), out_shardings=replicated(self.mesh))
        # Users' processors (EngineArgs.logits_processors): every step runs them, in the processed sampler.
        self.logits_processors = tuple(cls(config) for cls in config.logits_processors)
        sample_processed = functools.partial(step_functions.sample_processed, max_num_seqs=sc.max_num_seqs,
                                             user_processors=self.logits_processors)
        self._sample_processed = jax.jit(sample_processed, donate_argnums=(2,), static_argnums=(5,),
                                         out_shardings=(replicated(self.mesh), self._processor_state_sharding()))
        self._write_rows = jax.jit(processors.write_rows, donate_argnums=(0,),
                                   out_shardings=self._processor_state_sharding())
        self.num_logprobs = min(mc.max_logprobs, mc.arch.vocab_size)  # the most top tokens a request gets
        # A step computes the top K of the bucket that holds its requests' most: a top-k of 8
        # costs a fifth of one of 20 at [256, 128k] on an H200 (above 16, XLA sorts the rows).
        self.logprob_buckets = sorted({0, min(8, self.num_logprobs), self.num_logprobs})
        self._logprobs = jax.jit(compute_logprobs, static_argnums=(2,), out_shardings=replicated(self.mesh))
        self._prompt_logprobs = jax.jit(
            step_functions.make_prompt_logprobs_fn(self._graphdef, self._params_treedef, self.num_logprobs),
            out_shardings=replicated(self.mesh))
        self.bitmask_words = cdiv(mc.arch.vocab_size, 32)
        # Per request bucket: a bitmask allowing every token, on the device, and a host buffer for masks.
        self._all_allowed: dict[int, jax.Array] = {}
        self._host_bitmasks: dict[int, list[np.ndarray]] = {}
        # Compiled executables: the forward per token bucket, the sampler per (request bucket, mode,
        # with the logits processors), the logprobs per request bucket, the prompt logprobs per token
        # bucket; the forward's own argmax samples a greedy batch without processors, with no second call.
        self._forwards: dict[int, jax.stages.Compiled] = {}
        self._samplers: dict[tuple[int, SampleMode, bool], jax.stages.Compiled] = {}
        self._logprob_fns: dict[tuple[int, int], jax.stages.Compiled] = {}  # per (request bucket, K)
        self._prompt_logprob_fns: dict[int, jax.stages.Compiled] = {}
        self._write_rows_fn: jax.stages.Compiled | None = None
        self._executable_names = {id(self._forwards): "forward", id(self._samplers): "sampler",
                                  id(self._logprob_fns): "logprobs", id(self._prompt_logprob_fns): "prompt logprobs"}
        # FP8 GEMMs go to cuBLASLt: on an H200, XLA's Triton GEMM autotuner spends ~45 s on each FP8
        # GEMM shape of 8192 tokens, cuBLASLt's 0.3 s, for a GEMM 12% slower there and 17% faster
        # at 16 tokens (docs/benchmarks.md). Part of the compilation caches' keys.
        self._compiler_options = {"xla_gpu_enable_triton_gemm": False} if mc.quantization == "fp8" else {}
        self._store = self._executable_store()

    # ---- memory ----
    def _kv_bytes_per_block(self) -> int:
        """A block id holds one block in each KV tensor (a layer of each group)."""
        arch = self.arch
        itemsize = jnp.dtype(self.config.cache.cache_dtype).itemsize
        return 2 * self.kv_layout.num_tensors * self.block_size * arch.num_kv_heads * arch.head_dim * itemsize

    def _num_blocks(self) -> int:
        if self.config.cache.num_gpu_blocks_override:
            return self.config.cache.num_gpu_blocks_override
        per_block = self._kv_bytes_per_block()
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            budget = (stats["bytes_limit"] * self.config.cache.gpu_memory_utilization
                      - stats["bytes_in_use"] - self._activation_bytes() - self._processor_state_bytes())
        else:
            budget = min(_CPU_KV_CACHE_BYTES,
                         self.config.scheduler.max_num_seqs * self._blocks_per_request() * per_block)
        num_blocks = max(int(budget // per_block), 0)
        if jax.process_count() > 1:  # every host schedules alike: the same cache on each (the smallest)
            from jax.experimental import multihost_utils
            multihost.barrier("jaxllm-weights-loaded")
            num_blocks = int(np.min(multihost_utils.process_allgather(np.int32(num_blocks))))
        return num_blocks

    def _blocks_per_request(self) -> int:
        """The most blocks one request of max_model_len tokens holds, over every KV cache group: a
        sliding window's group holds its window and a prefill chunk (a bound)."""
        sc = self.config.scheduler
        full = cdiv(sc.max_model_len, self.block_size)
        return sum(full if group.sliding_window is None else
                   min(full, cdiv(group.sliding_window + sc.max_num_batched_tokens, self.block_size) + 1)
                   for group in self.kv_layout.groups)

    def _activation_bytes(self) -> int:
        """A generous bound on the step's transient memory at the largest bucket."""
        arch, sc = self.arch, self.config.scheduler
        tokens = sc.max_num_batched_tokens
        per_token = 4 * (4 * arch.hidden_size + 3 * arch.intermediate_size
                         + 2 * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim)
        logits = 4 * min(tokens, sc.max_num_seqs) * arch.vocab_size * 4
        return 2 * (tokens * per_token + logits) + (256 << 20)

    def _processor_state_bytes(self) -> int:
        return ProcessorState.nbytes(self.config.scheduler.max_num_seqs, self.config.model.arch.vocab_size)

    def _processor_state_sharding(self):
        return ProcessorState(*[named_sharding(self.mesh, (None, "vocab"))] * 4)

    def _zero_processor_state(self) -> ProcessorState:
        num_rows, vocab = self.config.scheduler.max_num_seqs, self.config.model.arch.vocab_size
        return jax.jit(functools.partial(processors.zero_state, num_rows, vocab),
                       out_shardings=self._processor_state_sharding())()

    def reset_kv_caches(self) -> None:
        """Fresh caches and no step history, after a failed step may have consumed the donated caches."""
        for array in jax.tree.leaves(self.kv_caches):
            if not array.is_deleted():
                array.delete()
        self.kv_caches = self._allocate_kv_caches()
        self.request_rows.clear()
        self._prev_sampled = self._zero_sampled()
        self._processor_state = self._zero_processor_state()

    def _allocate_kv_caches(self):
        arch = self.arch
        shape = (self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        sharding = kv_cache_sharding(self.mesh)
        zeros = jax.jit(lambda: jnp.zeros(shape, self.config.cache.cache_dtype), out_shardings=sharding)
        return [(zeros(), zeros()) for _ in range(self.kv_layout.num_tensors)]

    def _zero_sampled(self) -> jax.Array:
        return jax.device_put(np.zeros(self.config.scheduler.max_num_seqs, np.int32), replicated(self.mesh))

    def shutdown(self) -> None:
        """Free the device memory now (weights and KV cache), not when a collector finds it."""
        for array in jax.tree.leaves((self._params, self.kv_caches, self._prev_sampled, self._processor_state)):
            array.delete()
        self._params = self.kv_caches = self._prev_sampled = self._processor_state = None

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

    def _dispatch(self, token_bucket: int, buffer: np.ndarray, mode: SampleMode, processed: bool = False,
                  num_logprobs: int | None = None, host_bitmask=None, prompt_inputs=(),
                  user_rows: np.ndarray | None = None) -> tuple[jax.Array, "Logprobs | None", list["Logprobs"]]:
        """Run a step's forward; unless the batch is greedy with no logits processors, its
        sampler (with `processed`, the processors', with the token mask that `host_bitmask()`
        makes once the forward is on its way, or with none); if asked, the logprobs of its
        sampled ids, and the prompt logprobs of `prompt_inputs` [(token indices [C], target ids
        [C])]. `user_rows`: the step's rows, for the users' processors' states. What warm_up
        did not compile compiles here. Returns (the sampled ids, their Logprobs or None, the
        prompt inputs' Logprobs)."""
        forward = self._compiled(self._forwards, token_bucket, lambda: self._lower_forward(token_bucket))
        with TraceAnnotation("dispatch"):
            greedy, logits, words, hidden, self.kv_caches = forward(self._params, self.kv_caches,
                                                                    self._prev_sampled, buffer)
        num_reqs = logits.shape[0]
        if processed:
            bitmask = self._all_allowed_bitmask(num_reqs) if host_bitmask is None else host_bitmask()
            user_states = self._user_states(user_rows, num_reqs)
            sampler = self._compiled(self._samplers, (num_reqs, mode, True), lambda: self._sample_processed.lower(
                logits, words, self._processor_state, bitmask, user_states, mode))
            with TraceAnnotation("dispatch"):
                self._prev_sampled, self._processor_state = sampler(logits, words, self._processor_state, bitmask,
                                                                    user_states)
        elif mode == SampleMode.GREEDY:
            self._prev_sampled = greedy
        else:
            sampler = self._compiled(self._samplers, (num_reqs, mode, False), lambda: self._sample.lower(
                logits, words, mode))
            with TraceAnnotation("dispatch"):
                self._prev_sampled = sampler(logits, words)
        logprobs = None
        if num_logprobs is not None:
            fn = self._compiled(self._logprob_fns, (num_reqs, num_logprobs), lambda: self._logprobs.lower(
                logits, self._prev_sampled, num_logprobs))
            with TraceAnnotation("dispatch"):
                logprobs = Logprobs(*fn(logits, self._prev_sampled))
        prompt_logprobs = []
        for indices, targets in prompt_inputs:
            fn = self._compiled(self._prompt_logprob_fns, token_bucket, lambda: self._prompt_logprobs.lower(
                self._params, hidden, indices, targets))
            with TraceAnnotation("dispatch"):
                prompt_logprobs.append(Logprobs(*fn(self._params, hidden, indices, targets)))
        return self._prev_sampled, logprobs, prompt_logprobs

    def _user_states(self, rows: np.ndarray | None, num_reqs: int) -> tuple:
        """The users' processors' states for the step: rows [n] int32, padded with -1 to num_reqs."""
        if not self.logits_processors:
            return ()
        padded = np.full(num_reqs, -1, np.int32)
        if rows is not None:
            padded[:len(rows)] = rows
        return tuple(p.state(padded) for p in self.logits_processors)

    def _all_allowed_bitmask(self, num_reqs: int) -> jax.Array:
        if num_reqs not in self._all_allowed:
            self._all_allowed[num_reqs] = jax.device_put(np.full((num_reqs, self.bitmask_words), -1, np.int32),
                                                         replicated(self.mesh))
        return self._all_allowed[num_reqs]

    def _prompt_logprobs_chunk(self, token_bucket: int) -> int:
        return min(_PROMPT_LOGPROBS_CHUNK, token_bucket)

    def _write_processor_rows(self, new_rows: list[tuple[int, "Request"]], failed: dict[str, str]) -> None:
        """Write the ProcessorState rows of requests that took a row this step, WRITE_ROWS at a
        time (with none, one call that writes nothing: warm_up's). A request whose rows cannot be
        made goes into `failed`, its row left as it was."""
        vocab = self.config.model.arch.vocab_size
        for start in range(0, max(len(new_rows), 1), processors.WRITE_ROWS):
            chunk = new_rows[start:start + processors.WRITE_ROWS]
            rows = np.full(processors.WRITE_ROWS, self.request_rows.num_rows, np.int32)  # out of range: skipped
            values = [np.zeros((processors.WRITE_ROWS, vocab), dtype)
                      for dtype in (np.int32, bool, np.float32, bool)]
            for i, (row, request) in enumerate(chunk):
                params = request.sampling_params
                try:
                    state_rows = processors.request_state_rows(
                        request.prompt_token_ids, request.output_token_ids, params.logit_bias,
                        params.allowed_token_ids, request.banned_token_ids, request.stop_token_ids, vocab)
                except Exception as e:
                    logger.exception("request %s: its logits processors' rows failed", request.request_id)
                    failed[request.request_id] = f"logits processors: {type(e).__name__}: {e}"
                    continue
                rows[i] = row
                for array, value in zip(values, state_rows):
                    array[i] = value
            if self._write_rows_fn is None:
                self._write_rows_fn = self._write_rows.lower(self._processor_state, rows, *values).compile()
            self._processor_state = self._write_rows_fn(self._processor_state, rows, *values)

    def warm_up(self, show_progress: bool = True) -> None:
        """Compile every executable now, so serving never compiles: the forward and the prompt
        logprobs of every token bucket, and the sampler (of every mode) and the logprobs of every
        request bucket; then run each once. Executables in the store (compilation.ExecutableStore)
        are loaded, in parallel, and not traced. Tracing holds the GIL and XLA's compilation does
        not: each bucket is traced here while the ones before it compile in a thread pool."""
        start = time.perf_counter()
        keys = self._warm_up_keys()
        names = [f"{self._executable_names[id(executables)]} {key}" for executables, key in keys]
        lower_s, out_info = 0.0, None  # tracing and lowering, in this thread; the last forward's out_info
        with concurrent.futures.ThreadPoolExecutor(_COMPILE_THREADS) as pool:
            stored = dict(zip(names, pool.map(self._store.load, names))) if self._store else {}
            load_s = time.perf_counter() - start
            jobs = []  # (where the executable goes, its key, its compile job)
            for (executables, key), name in zip(keys, names):
                if stored.get(name) is not None:
                    executable = stored[name]
                    jobs.append((executables, key, concurrent.futures.Future()))
                    jobs[-1][2].set_result(executable)
                else:
                    lower_start = time.perf_counter()
                    executable = self._lower(executables, key, out_info)  # a forward comes before its users
                    lower_s += time.perf_counter() - lower_start
                    jobs.append((executables, key, pool.submit(self._compile_and_store, name, executable)))
                if executables is self._forwards:
                    out_info = executable.out_info  # (sampled, logits, words, hidden, kv caches)
            for executables, key, job in tqdm(jobs, desc="Compiling", disable=not show_progress):
                executables[key] = job.result()
        compiled_s = time.perf_counter() - start
        multihost.barrier("jaxllm-compiled")  # other hosts may compile for longer
        self._write_processor_rows([], {})
        request_buckets = set()
        for token_bucket in self.token_buckets:
            buffer, views = self._next_host_buffer(token_bucket)
            batching.fill_padding(views)
            zeros = np.zeros(self._prompt_logprobs_chunk(token_bucket), np.int32)
            # Each forward once, with the logprobs and prompt logprobs; each sampler once, after the
            # smallest forward of its request bucket.
            jax.block_until_ready(self._dispatch(token_bucket, buffer, SampleMode.GREEDY, False,
                                                 num_logprobs=self.num_logprobs, prompt_inputs=[(zeros, zeros)]))
            num_reqs = batching.request_bucket(token_bucket, self.config.scheduler.max_num_seqs)
            if num_reqs not in request_buckets:
                request_buckets.add(num_reqs)
                for mode, processed in itertools.product(SampleMode, (False, True)):
                    if mode != SampleMode.GREEDY or processed:
                        jax.block_until_ready(self._dispatch(token_bucket, buffer, mode, processed))
        self.startup_s["compile"] = time.perf_counter() - start
        self.compile_split = (f"{len(jobs)} executables, {sum(c is not None for c in stored.values())} of them "
                              f"stored: loading {load_s:.1f} s, tracing and lowering {lower_s:.1f} s, waiting on "
                              f"XLA {compiled_s - lower_s - load_s:.1f} s, first runs "
                              f"{self.startup_s['compile'] - compiled_s:.1f} s")

    def _warm_up_keys(self) -> list[tuple[dict, object]]:
        """(where the executable goes, its key) for every executable warm_up builds, each forward
        before the prompt logprobs of its token bucket and the samplers of its request bucket."""
        keys, request_buckets = [], set()
        for token_bucket in self.token_buckets:
            keys += [(self._forwards, token_bucket), (self._prompt_logprob_fns, token_bucket)]
            num_reqs = batching.request_bucket(token_bucket, self.config.scheduler.max_num_seqs)
            if num_reqs in request_buckets:
                continue
            request_buckets.add(num_reqs)
            for mode in SampleMode:
                if mode != SampleMode.GREEDY:  # a greedy batch samples with the forward's argmax
                    keys.append((self._samplers, (num_reqs, mode, False)))
                keys.append((self._samplers, (num_reqs, mode, True)))
            keys += [(self._logprob_fns, (num_reqs, k)) for k in self.logprob_buckets]
        return keys

    def _lower(self, executables: dict, key, forward_info) -> jax.stages.Lowered:
        """The executable of `key` in `executables`, lowered; forward_info: the out_info of the
        forward of its token bucket (for the others than a forward)."""
        if executables is self._forwards:
            return self._lower_forward(key)
        sampled, logits, words, hidden, _ = forward_info
        if executables is self._prompt_logprob_fns:
            chunk = jax.ShapeDtypeStruct((self._prompt_logprobs_chunk(key),), jnp.int32)
            return self._prompt_logprobs.lower(self._params, hidden, chunk, chunk)
        if executables is self._logprob_fns:
            return self._logprobs.lower(logits, sampled, key[1])
        num_reqs, mode, processed = key
        if not processed:
            return self._sample.lower(logits, words, mode)
        return self._sample_processed.lower(logits, words, self._processor_state, self._all_allowed_bitmask(num_reqs),
                                            self._user_states(None, num_reqs), mode)

    def _compiled(self, executables: dict, key, lower) -> jax.stages.Compiled:
        """executables[key], compiled from `lower()` the first time."""
        if key not in executables:
            executables[key] = lower().compile(compiler_options=self._compiler_options)
        return executables[key]

    def _compile_and_store(self, name: str, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        compiled = lowered.compile(compiler_options=self._compiler_options)
        if self._store:
            self._store.save(name, compiled)
        return compiled

    def _executable_store(self) -> compilation.ExecutableStore | None:
        """The store of this runner's executables, keyed by everything they are built from; none
        with users' logits processors (their code is not in the key) or over several hosts."""
        if self.logits_processors or self.config.parallel.num_hosts > 1:
            return None
        from jaxllm import kernels, models
        params = [(p.shape, p.dtype, p.sharding) for p in self._params]
        caches = [(k.shape, k.dtype, k.sharding) for k, _ in self.kv_caches]
        key = "\n".join(map(repr, (self.config, self._params_treedef, params, caches,  # the buckets follow the config
                                    compilation.source_digest((jaxllm, models, kernels)))))
        return compilation.ExecutableStore.maybe(key, list(self.mesh.devices.flat))

    def execute_model(self, sched: SchedulerOutput) -> "StepOutput":
        """Dispatch one step and return at once; its sampled ids land later (but a step with
        host-made token masks first waits for the previous step's ids, see _host_bitmask)."""
        rows, added, removed = self.request_rows.update(sched)
        failed: dict[str, str] = {}  # request id -> why its host work failed: only it ends, with the error
        new_processed = [(row, request) for row, request in added if self.request_rows.processed[row]]
        if new_processed:
            self._write_processor_rows(new_processed, failed)
        if self.logits_processors and (added or removed):
            self._update_processors(added, removed, failed)
        token_bucket = self._token_bucket(sched.num_scheduled_tokens)
        buffer, views = self._next_host_buffer(token_bucket)
        batching.pack(sched, rows, self.request_rows, views, self.block_size)
        mode = self.request_rows.batch_sample_mode(rows)
        processed = bool(self.logits_processors) or bool(self.request_rows.processed[rows].any())
        most = int(self.request_rows.num_logprobs[rows].max())
        num_logprobs = None if most < 0 else next(k for k in self.logprob_buckets if k >= most)
        prompt_inputs, prompt_segments = self._prompt_logprob_inputs(sched, views, token_bucket)
        host_bitmask = None
        if self.request_rows.host_masked[rows].any():
            prev_sampled = self._prev_sampled
            host_bitmask = lambda: self._host_bitmask(sched, rows, views, prev_sampled, failed)
        sampled, logprobs, prompt_logprobs = self._dispatch(token_bucket, buffer, mode, processed, num_logprobs,
                                                            host_bitmask, prompt_inputs, rows)
        for array in (sampled, *(logprobs or ()), *(a for p in prompt_logprobs for a in p)):
            array.copy_to_host_async()
        width = (len(sched.requests), -sched.num_scheduled_tokens)  # most requests, then fewest tokens
        if self._widest_step is None or width > self._widest_step[0]:
            self._widest_step = (width, token_bucket, buffer.copy(), mode, processed, num_logprobs)
        return StepOutput(sampled, len(sched.requests), logprobs, prompt_logprobs, prompt_segments, failed)

    def _update_processors(self, added: list[tuple[int, "Request"]], removed: list[int], failed: dict) -> None:
        """Tell the users' processors who left and who joined, one joining request at a time: a
        processor that fails on one request's arguments fails that request alone."""
        updates = [(None, BatchUpdate([], removed))] if removed else []
        updates += [(r.request_id, BatchUpdate([AddedRequest(row, r.sampling_params, r.prompt_token_ids,
                                                             list(r.output_token_ids))], []))
                    for row, r in added]
        for request_id, update in updates:
            for processor in self.logits_processors:
                if request_id is None:
                    processor.update_state(update)
                    continue
                try:
                    processor.update_state(update)
                except Exception as e:
                    logger.exception("request %s: logits processor %s failed", request_id, type(processor).__name__)
                    failed[request_id] = f"logits processor {type(processor).__name__}: {type(e).__name__}: {e}"
                    break

    def _prompt_logprob_inputs(self, sched: SchedulerOutput, views, token_bucket: int):
        """The step's prompt positions whose logprobs a request asked for (ScheduledRequest.prompt_logprobs)
        in chunks of the executable's size: ([(token indices [C], prompt ids at those positions [C])],
        [(scheduled request index, number of positions)])."""
        indices, targets, segments = [], [], []
        query_start_loc = views["query_start_loc"]
        for i, s in enumerate(sched.requests):
            if s.prompt_logprobs is None:
                continue
            lo, hi = s.prompt_logprobs  # position p's logprobs: from the logits of token p - 1
            first = int(query_start_loc[i]) + lo - 1 - s.num_computed_tokens
            indices.extend(range(first, first + hi - lo))
            targets.extend(s.request.prompt_token_ids[lo:hi])
            segments.append((i, hi - lo))
        chunk = self._prompt_logprobs_chunk(token_bucket)
        inputs = []
        for start in range(0, len(indices), chunk):
            pair = np.zeros((2, chunk), np.int32)
            part = slice(start, start + chunk)
            pair[0, :len(indices[part])], pair[1, :len(targets[part])] = indices[part], targets[part]
            inputs.append((pair[0], pair[1]))
        return inputs, segments

    def _host_bitmask(self, sched: SchedulerOutput, rows: np.ndarray, views, prev_sampled: jax.Array,
                      failed: dict[str, str]) -> np.ndarray:
        """The token masks made on the host [R, bitmask_words] int32, for the step's requests with a
        grammar or multi-token bad words. They need every token before the one being sampled,
        and the last may still be on the device: this waits for the previous step (its ids
        `prev_sampled`), while the device runs this step's forward."""
        with TraceAnnotation("wait"):
            prev_host = np.asarray(prev_sampled)
        # Two buffers in turn, as the step's inputs: the step before may not have read its mask yet
        # (a CPU device reads a numpy argument in place).
        num_reqs = views["logits_indices"].shape[0]
        buffers = self._host_bitmasks.setdefault(
            num_reqs, [np.empty((num_reqs, self.bitmask_words), np.int32) for _ in range(2)])
        buffers.reverse()
        bitmask = buffers[0]
        bitmask[:] = -1
        prev_rows, last_tokens = views["prev_rows"], views["logits_indices"]
        entries = []
        for i in np.flatnonzero(self.request_rows.host_masked[rows]):
            if sched.requests[i].samples:
                in_flight = prev_rows[last_tokens[i]]  # where the previous step put this request's last token
                entries.append((sched.requests[i].request, [int(prev_host[in_flight])] if in_flight >= 0 else [], i))
        failed.update(host_masks.fill_bitmask(entries, bitmask))
        return bitmask

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
        jax.block_until_ready(self._dispatch(*step))  # a step replays with no host-made masks
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
        if self.compile_split:
            startup += f" ({self.compile_split})"
        dtype = jnp.dtype(self.config.cache.cache_dtype).name
        return (f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens "
                f"({self.kv_cache_tokens} tokens, {gib:.2f} GiB, {dtype}); token buckets {self.token_buckets}; "
                f"attention backend {self.config.attention_backend}; start-up: {startup}")
