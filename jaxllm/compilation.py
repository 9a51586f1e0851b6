"""XLA compilation bookkeeping: the persistent cache and a compile counter.

The counter listens to JAX's own backend-compile event, so it sees every
compilation in the process (the step function and any stray eager op), and the
tests assert it stays flat after warm-up.
"""
import os
import threading

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_counts = {"compiles": 0, "cache_hits": 0}
_installed = False


def _on_duration(event: str, duration_s: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        with _lock:
            _counts["compiles"] += 1


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT_EVENT:
        with _lock:
            _counts["cache_hits"] += 1


def install_compile_counter() -> None:
    global _installed
    if not _installed:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _installed = True


def num_compilations() -> int:
    """XLA compilations so far in this process, persistent-cache hits included."""
    with _lock:
        return _counts["compiles"] + _counts["cache_hits"]


def enable_persistent_cache(cache_dir: str | None = None) -> None:
    """Keep compiled executables on disk so the second start skips compilation.
    JAXLLM_COMPILATION_CACHE=off disables it; a path overrides the location."""
    setting = os.environ.get("JAXLLM_COMPILATION_CACHE", cache_dir or "")
    if setting == "off":
        return
    path = setting or os.path.join(os.path.expanduser("~"), ".cache", "jaxllm", "xla")
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
