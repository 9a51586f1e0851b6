"""The runner's compiled executables, one per ExecutableKey: all compiled at warm-up (loaded
from the executable store when it holds them), so serving never compiles.

Tracing holds the GIL and XLA's compilation does not: `build` traces each key here while
the ones before it compile in a thread pool, and loads stored ones in parallel.
"""
import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable

import jax
from tqdm import tqdm

from jaxllm import compilation
from jaxllm.sample.sampler import SampleMode

_COMPILE_THREADS = min(8, os.cpu_count() or 1)

FORWARD, PROMPT_LOGPROBS, SAMPLER, LOGPROBS, DRAFT = "forward", "prompt logprobs", "sampler", "logprobs", "draft"
POOL = "pool"
STAGE = "stage"  # a pipeline stage but the last (worker/pipeline.py), per token bucket


def compiler_options(config, mesh: jax.sharding.Mesh) -> dict:
    """XLA's options for the runner's executables (part of the compilation caches' keys)."""
    mc, sc = config.model, config.scheduler
    # FP8 GEMMs go to cuBLASLt: on an H200, XLA's Triton GEMM autotuner spends ~45 s on each FP8
    # GEMM shape of 8192 tokens, cuBLASLt's 0.3 s, for a GEMM 12% slower there and 17% faster
    # at 16 tokens (docs/benchmarks.md).
    fp8_dots = mc.quantization is not None and mc.quantization.xla_fp8_dot
    options = {"xla_gpu_enable_triton_gemm": False} if fp8_dots else {}
    if not sc.async_scheduling and mesh.devices.flat[0].platform == "gpu":
        # One step at a time (n-gram speculative decoding too): the GPU waits while the host launches
        # the step, and XLA's CUDA graphs make the launch slower (their update costs the host
        # ~2.7 ms per 8B step); kernel by kernel, the GPU starts at the first. On an H200 the
        # 8B shape's synchronous step falls from 7.4 to 6.1 ms at batch 1 (docs/benchmarks.md).
        # (A GPU's option only: elsewhere a synchronous engine shares an asynchronous one's executables.)
        options["xla_gpu_enable_command_buffer"] = ""
    return options


@dataclasses.dataclass(frozen=True)
class ExecutableKey:
    # FORWARD, PROMPT_LOGPROBS, DRAFT, POOL and STAGE per token bucket; SAMPLER and LOGPROBS per request bucket
    kind: str
    bucket: int
    mode: SampleMode | None = None  # SAMPLER: the least work that samples the batch right
    processed: bool = False         # SAMPLER: with the logits processors
    num_logprobs: int | None = None  # LOGPROBS: the top K
    stage: int | None = None         # STAGE: the pipeline stage
    decodes_only: bool = False       # FORWARD, STAGE: a model with Mamba layers' step of one token a request

    def __str__(self) -> str:  # the executable's name in the store
        parts = [self.kind, str(self.bucket)] + (["decodes only"] if self.decodes_only else [])
        if self.mode is not None:
            parts += [self.mode.name.lower(), "processed" if self.processed else "plain"]
        if self.num_logprobs is not None:
            parts.append(f"top {self.num_logprobs}")
        if self.stage is not None:
            parts.append(f"of stage {self.stage}")
        return " ".join(parts)


Lower = Callable[[ExecutableKey, object], jax.stages.Lowered]  # (key, its forward's out_info) -> lowered


class Executables:
    def __init__(self, store: compilation.ExecutableStore | None, compiler_options: dict):
        self.store, self.compiler_options = store, compiler_options
        self.compiled: dict[ExecutableKey, jax.stages.Compiled] = {}

    def get(self, key: ExecutableKey, lower: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
        """The executable of `key`, compiled from `lower()` if warm-up did not (a test's own shapes)."""
        if key not in self.compiled:
            self.compiled[key] = lower().compile(compiler_options=self.compiler_options)
        return self.compiled[key]

    def build(self, keys: list[ExecutableKey], lower: Lower, show_progress: bool) -> str:
        """Compile (or load) every key, each FORWARD before the keys of its buckets that follow
        it (they are lowered against its out_info). Returns where the time went."""
        start = time.perf_counter()
        names = [str(key) for key in keys]
        lower_s, out_info = 0.0, None
        with concurrent.futures.ThreadPoolExecutor(_COMPILE_THREADS) as pool:
            stored = dict(zip(names, pool.map(self.store.load, names))) if self.store else {}
            load_s = time.perf_counter() - start
            jobs = []
            for key, name in zip(keys, names):
                if stored.get(name) is not None:
                    executable = stored[name]
                    job = concurrent.futures.Future()
                    job.set_result(executable)
                else:
                    lower_start = time.perf_counter()
                    executable = lower(key, out_info)
                    lower_s += time.perf_counter() - lower_start
                    job = pool.submit(self._compile_and_store, name, executable)
                jobs.append((key, job))
                if key.kind == FORWARD:
                    out_info = executable.out_info  # (sampled, logits, words, hidden, kv caches, routing[, drafter's])
            for key, job in tqdm(jobs, desc="Compiling", disable=not show_progress):
                self.compiled[key] = job.result()
        elapsed = time.perf_counter() - start
        return (f"{len(jobs)} executables, {sum(c is not None for c in stored.values())} of them stored: "
                f"loading {load_s:.1f} s, tracing and lowering {lower_s:.1f} s, waiting on XLA "
                f"{elapsed - lower_s - load_s:.1f} s")

    def _compile_and_store(self, name: str, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        compiled = lowered.compile(compiler_options=self.compiler_options)
        if self.store:
            self.store.save(name, compiled)
        return compiled
