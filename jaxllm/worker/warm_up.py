"""Warm-up: every executable a ModelRunner can call, compiled (or loaded from the executable
store) and run once, so that serving never compiles. What each executable is lowered from
lives here; executables.py keeps and compiles them.
"""
import itertools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import compilation, distributed
from jaxllm.sample.sampler import SampleMode
from jaxllm.worker import input_batch as batching
from jaxllm.worker.executables import DRAFT, FORWARD, LOGPROBS, POOL, PROMPT_LOGPROBS, SAMPLER, STAGE, ExecutableKey

logger = logging.getLogger(__name__)


def run_warm_up(runner, show_progress: bool = True) -> None:
    """Compile every executable of `runner`, then run each once: the forward, the prompt logprobs
    (and with a pooler, the pooling) of every token bucket, and the sampler (of every mode) and the
    logprobs of every request bucket. Records the time in runner.startup_s["compile"] and
    runner.compile_split. With JAXLLM_WARM_UP=0 nothing is compiled now: each executable is, when a
    step first needs it (executables.py Executables.get)."""
    if os.environ.get("JAXLLM_WARM_UP", "1") == "0":
        runner.processor_rows.write([], {})
        runner.startup_s["compile"] = 0.0
        runner.compile_split = "skipped (JAXLLM_WARM_UP=0: each executable compiles when first used)"
        return
    start = time.perf_counter()
    num_stages = runner.pipeline.num_stages if runner.pipeline else 1
    keys = warm_up_keys(runner.token_buckets, runner.layouts, runner.sampling.logprob_buckets, runner.draft is not None,
                        runner.pooler is not None, num_stages, runner.decodes_only_buckets)
    split = runner.executables.build(keys, lambda key, info: lower(runner, key, info), show_progress)
    compiled_s = time.perf_counter() - start
    if runner.kv_cache.step_reserve is not None and (warning := outgrown_reserve(runner.executables.compiled,
                                                                                 runner.kv_cache.step_reserve)):
        logger.warning(warning)
    distributed.barrier("jaxllm-compiled")  # other hosts may compile for longer
    runner.processor_rows.write([], {})
    row_buckets = set()
    for token_bucket in runner.token_buckets:
        buffer, views = runner.host_buffers.next(token_bucket)
        batching.fill_padding(views)
        zeros = np.zeros(batching.prompt_logprobs_chunk(token_bucket), np.int32)
        token_rows = np.full(token_bucket, -1, np.int32) if runner.pooler is not None else None
        # Each forward once, with the logprobs, prompt logprobs and pooling; each sampler once, after
        # the smallest forward of its request bucket.
        jax.block_until_ready(runner.dispatch(token_bucket, buffer, SampleMode.GREEDY, False,
                                              num_logprobs=runner.sampling.num_logprobs, prompt_inputs=[(zeros, zeros)],
                                              token_rows=token_rows))
        if token_bucket in runner.decodes_only_buckets:  # (a batch of padding alone: one token a request, or none)
            jax.block_until_ready(runner.dispatch(token_bucket, buffer, SampleMode.GREEDY, decodes_only=True))
        num_rows = runner.layouts[token_bucket].num_rows
        if num_rows not in row_buckets:
            row_buckets.add(num_rows)
            for mode, processed in itertools.product(SampleMode, (False, True)):
                if mode != SampleMode.GREEDY or processed:
                    jax.block_until_ready(runner.dispatch(token_bucket, buffer, mode, processed))
    runner.startup_s["compile"] = time.perf_counter() - start
    runner.compile_split = f"{split}, first runs {runner.startup_s['compile'] - compiled_s:.1f} s"


def outgrown_reserve(compiled: dict[ExecutableKey, jax.stages.Compiled], reserve: int) -> str | None:
    """A warning where an executable's temporaries (XLA's memory analysis) take more than the `reserve`
    bytes the KV cache's budget left for a step (a formula: worker/kv_cache.py): its first run may then
    not find the memory."""
    temp = {key: b for key, c in compiled.items() if (b := _temp_bytes(c)) is not None}
    if not temp or max(temp.values()) <= reserve:
        return None
    widest = max(temp, key=temp.get)
    return (f"the {widest} executable keeps {temp[widest] / 2**30:.2f} GiB of temporaries, more than the "
            f"{reserve / 2**30:.2f} GiB the KV cache's budget left for a step: it may run out of memory; "
            "lower max_num_batched_tokens, max_num_seqs or gpu_memory_utilization")


def _temp_bytes(compiled: jax.stages.Compiled) -> int | None:
    try:
        return compiled.memory_analysis().temp_size_in_bytes
    except Exception:  # a backend without the analysis: nothing to check
        return None


def warm_up_keys(token_buckets: list[int], layouts: dict, logprob_buckets: list[int], with_drafter: bool,
                 with_pooler: bool = False, num_stages: int = 1,
                 decodes_only_buckets: list[int] = ()) -> list[ExecutableKey]:
    """Every executable warm-up builds, each forward (after the pipeline stages before it) before the
    prompt logprobs (drafter, pooling) of its token bucket and the samplers and logprobs of its rows of logits;
    in decodes_only_buckets the decodes-only forward (and stages) too."""
    keys, row_buckets = [], set()
    for token_bucket in token_buckets:
        keys += [ExecutableKey(STAGE, token_bucket, stage=s) for s in range(num_stages - 1)]
        keys += [ExecutableKey(FORWARD, token_bucket), ExecutableKey(PROMPT_LOGPROBS, token_bucket)]
        if token_bucket in decodes_only_buckets:
            keys += [ExecutableKey(STAGE, token_bucket, stage=s, decodes_only=True) for s in range(num_stages - 1)]
            keys.append(ExecutableKey(FORWARD, token_bucket, decodes_only=True))
        if with_drafter:
            keys.append(ExecutableKey(DRAFT, token_bucket))
        if with_pooler:
            keys.append(ExecutableKey(POOL, token_bucket))
        num_rows = layouts[token_bucket].num_rows
        if num_rows in row_buckets:
            continue
        row_buckets.add(num_rows)
        for mode in SampleMode:
            if mode != SampleMode.GREEDY:  # a greedy batch samples with the forward's argmax
                keys.append(ExecutableKey(SAMPLER, num_rows, mode, False))
            keys.append(ExecutableKey(SAMPLER, num_rows, mode, True))
        keys += [ExecutableKey(LOGPROBS, num_rows, num_logprobs=k) for k in logprob_buckets]
    return keys


def lower(runner, key: ExecutableKey, forward_info) -> jax.stages.Lowered:
    """The executable of `key`, lowered; forward_info: the out_info of the forward of its
    token bucket (for the others than a forward)."""
    if key.kind == FORWARD:
        return runner.lower_forward(key.bucket, key.decodes_only)
    if key.kind == STAGE:
        return runner.pipeline.lower(key.stage, key.bucket, runner.host_buffers.first(key.bucket), key.decodes_only)
    sampled, logits, words, hidden = forward_info[:4]
    fns = runner.fns
    if key.kind == DRAFT:  # after the KV caches and the routing: the inputs as run, then an EAGLE-3 head's states
        draft_hidden = forward_info[7] if runner.aux_layers else hidden
        return runner.lower_draft(key.bucket, forward_info[6], sampled, draft_hidden)
    if key.kind == POOL:
        token_rows = jax.ShapeDtypeStruct((key.bucket,), jnp.int32)
        return fns.pool.lower(hidden, token_rows, runner.layouts[key.bucket].num_reqs)
    if key.kind == PROMPT_LOGPROBS:
        chunk = jax.ShapeDtypeStruct((batching.prompt_logprobs_chunk(key.bucket),), jnp.int32)
        return fns.prompt_logprobs.lower(runner.head_params, hidden, chunk, chunk)
    if key.kind == LOGPROBS:
        return fns.logprobs.lower(logits, sampled, key.num_logprobs)
    if not key.processed:
        return fns.sample.lower(logits, words, key.mode)
    rows = runner.processor_rows
    return fns.sample_processed.lower(logits, words, rows.state, runner.sampling.all_allowed_bitmask(key.bucket),
                                      rows.user_states(None, key.bucket), key.mode)


def executable_store(runner) -> compilation.ExecutableStore | None:
    """The store of a runner's executables, keyed by everything they are built from; none with
    users' logits processors (their code is not in the key), over several hosts or pipeline stages."""
    if runner.processor_rows.users or runner.config.parallel.num_hosts > 1 or runner.pipeline:
        return None  # (a pipeline's stages run on other devices than the store's)
    weights = [runner.weights] + ([runner.draft_weights] if runner.draft_weights else [])
    params = [(w.treedef, [(p.shape, p.dtype, p.sharding) for p in w.params]) for w in weights]
    caches = [(k.shape, k.dtype, k.sharding) for k, *_ in runner.kv_cache.caches + (runner.kv_cache.draft_caches or [])]
    key = "\n".join(map(repr, (runner.config, params, caches,  # the buckets follow the config
                               compilation.source_digest(), compilation.trace_choices())))
    return compilation.ExecutableStore.maybe(key, list(runner.mesh.devices.flat))
