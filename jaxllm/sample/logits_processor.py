"""Users' own batch-level logits processors (vLLM v1's LogitsProcessor interface, in JAX).

A processor class goes in EngineArgs.logits_processors (the class, or its "module:Class"
name); the engine core makes one instance per engine, `cls(config)`. Every step the
sampler runs it on the whole batch, after the built-in processors (jaxllm/sample/
processors.py) and before temperature and top-k/top-p:

- `update_state(batch_update)` on the host, when requests join or leave the batch: they
  are known by their row, which stays theirs until they finish or are preempted;
- `state(rows)` on the host: the arrays `apply` reads this step, leading dimension the
  step's request bucket (rows[i] is request i's row, -1 a padding row);
- `apply(state, logits)` inside the jitted sampler: pure JAX, the same shapes every step
  of a bucket (traced once per bucket at warm-up), returning the new logits.

Per-request arguments come in SamplingParams.extra_args. A processor leaves alone the rows
of requests it does not apply to.
"""
import abc
import dataclasses
import importlib

import jax
import numpy as np

from jaxllm.sampling_params import SamplingParams


@dataclasses.dataclass
class AddedRequest:
    row: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # its tokens so far (a request resumed after preemption has some)


@dataclasses.dataclass
class BatchUpdate:
    added: list[AddedRequest]
    removed: list[int]  # rows of requests that finished or were preempted (removed before added)


class LogitsProcessor(abc.ABC):
    def __init__(self, config):
        """config: the engine's jaxllm.config.Config (vocab size: config.model.arch.vocab_size,
        rows: config.scheduler.max_num_seqs)."""

    @abc.abstractmethod
    def update_state(self, batch_update: BatchUpdate) -> None:
        ...

    @abc.abstractmethod
    def state(self, rows: np.ndarray):
        """rows [R] int32 -> a pytree of numpy arrays [R, ...] (the same shapes for every R)."""

    @abc.abstractmethod
    def apply(self, state, logits: jax.Array) -> jax.Array:
        """logits [R, vocab] float32 -> [R, vocab] float32, traced inside the sampler."""


def resolve_logits_processors(entries) -> tuple[type, ...]:
    """EngineArgs.logits_processors (classes or "module:Class" / "module.Class" names) as
    LogitsProcessor subclasses; a ValueError names a bad entry."""
    classes = []
    for entry in entries or ():
        cls = entry
        if isinstance(entry, str):
            module, _, name = entry.rpartition(":") if ":" in entry else entry.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"logits_processors: cannot import {entry!r} ({e})") from None
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits_processors: {entry!r} is not a jaxllm LogitsProcessor subclass")
        classes.append(cls)
    return tuple(classes)
