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


@dataclasses.dataclass(frozen=True)
class ExecutableKey:
    # FORWARD, PROMPT_LOGPROBS, DRAFT, POOL and STAGE per token bucket; SAMPLER and LOGPROBS per request bucket
    kind: str
    bucket: int
    mode: SampleMode | None = None  # SAMPLER: the least work that samples the batch right
    processed: bool = False         # SAMPLER: with the logits processors
    num_logprobs: int | None = None  # LOGPROBS: the top K
    stage: int | None = None         # STAGE: the pipeline stage

    def __str__(self) -> str:  # the executable's name in the store
        parts = [self.kind, str(self.bucket)]
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
                    out_info = executable.out_info  # (sampled, logits, words, hidden, kv caches[, EAGLE-3's])
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
