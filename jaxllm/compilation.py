"""XLA compilation bookkeeping: the persistent cache, the executable store and a
compile counter.

JAX's persistent cache keys on the lowered module, so a warm start still traces and
lowers every executable (18 of the 8B's 23 s of compile phase on an H200) and only
skips XLA's compile. The executable store keeps the engine's compiled executables
themselves, under a key of everything they were built from, and a warm start loads
them without tracing.

The counter listens to JAX's own backend-compile event, so it sees every
compilation in the process (the step function and any stray eager op), and the
tests assert it stays flat after warm-up.
"""
import hashlib
import importlib.util
import logging
import os
import pickle
import shutil
import threading

import jax
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

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


def cache_dir() -> str | None:
    """Where compiled executables are kept: JAXLLM_COMPILATION_CACHE (a path, or "off": None),
    else ~/.cache/jaxllm/xla."""
    setting = os.environ.get("JAXLLM_COMPILATION_CACHE", "")
    if setting == "off":
        return None
    return setting or os.path.join(os.path.expanduser("~"), ".cache", "jaxllm", "xla")


def enable_persistent_cache() -> None:
    """Keep XLA's compiled executables on disk so the second start skips compilation: those that
    took 0.5 s or more, unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise."""
    path = cache_dir()
    if path is not None and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", path)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# The environment variables that pick what a model traces (a kernel, latent attention's prefill form):
# part of an executable's key, as its code is, so a stored executable of another choice is never loaded.
TRACE_CHOICES = ("JAXLLM_MOE_KERNEL", "JAXLLM_SSD_KERNEL", "JAXLLM_SSD_UPDATE", "JAXLLM_MLA_PREFILL", "JAXLLM_FP8_FUSED")


def trace_choices() -> dict[str, str | None]:
    """Each of TRACE_CHOICES with its value in this process (None: unset)."""
    return {name: os.environ.get(name) for name in TRACE_CHOICES}


def source_digest() -> str:
    """SHA-256 over the .py files of jaxllm's three parts (jaxllm/, kernels/ and models/ in the
    repository), wherever they are installed: a code change is a new key."""
    digest = hashlib.sha256()
    for name in ("jaxllm", "jaxllm.kernels", "jaxllm.models"):
        root = os.path.dirname(importlib.util.find_spec(name).origin)
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for file in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, file)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


KEPT_KEYS = 8  # the store keeps the executables of the 8 keys last used (tens of MB each for an 8B)


def prune_folders(parent: str, keep: int) -> None:
    """Remove all but the `keep` most recently modified folders in `parent` (a start that was
    loading from one compiles what it can no longer read)."""
    folders = sorted((e for e in os.scandir(parent) if e.is_dir()), key=lambda e: e.stat().st_mtime, reverse=True)
    for entry in folders[keep:]:
        shutil.rmtree(entry.path, ignore_errors=True)


class ExecutableStore:
    """Compiled executables on disk, one file per name, in a folder named by the digest of
    `key`: the caller's description of everything they were built from (its config, the
    arguments' shapes and shardings, its code's source_digest); the JAX version, the devices
    and XLA_FLAGS are added here. A load that fails for any reason (no file, another JAX, a
    truncated write) is a miss, and the caller compiles."""

    def __init__(self, key: str, devices: list, folder: str):
        material = "\n".join([key, jax.__version__, jax.lib.__version__, os.environ.get("XLA_FLAGS", ""),
                               repr([(d.platform, d.device_kind, d.id) for d in devices])])
        self.devices = devices
        self.folder = os.path.join(folder, hashlib.sha256(material.encode()).hexdigest()[:32])

    @classmethod
    def maybe(cls, key: str, devices: list) -> "ExecutableStore | None":
        """A store in cache_dir()/executables on GPUs. JAXLLM_EXECUTABLE_STORE=on|off|a folder
        overrides. Off on CPU by default: XLA:CPU can fail to find a function of a loaded
        executable once one process has loaded and compiled several of the same names (as a
        test session that starts many engines does)."""
        setting = os.environ.get("JAXLLM_EXECUTABLE_STORE", "auto")
        if setting == "off" or (setting == "auto" and devices[0].platform != "gpu"):
            return None
        if setting not in ("auto", "on"):
            return cls(key, devices, setting)
        return None if cache_dir() is None else cls(key, devices, os.path.join(cache_dir(), "executables"))

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, hashlib.sha256(name.encode()).hexdigest()[:32] + ".exe")

    def load(self, name: str) -> jax.stages.Compiled | None:
        try:
            with open(self._path(name), "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                 execution_devices=self.devices)
            os.utime(self.folder)  # in use: the last to be pruned (prune_folders)
            return compiled
        except FileNotFoundError:
            return None
        except Exception as e:  # a stale or broken file: compile instead
            logger.warning("could not load the stored executable %s (%s: %s); compiling it", name, type(e).__name__, e)
            return None

    def save(self, name: str, compiled: jax.stages.Compiled) -> None:
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            if not os.path.isdir(self.folder):
                os.makedirs(self.folder, exist_ok=True)
                prune_folders(os.path.dirname(self.folder), keep=KEPT_KEYS)
            tmp = f"{self._path(name)}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(name))  # whole or not at all, for a concurrent start
        except Exception as e:  # an executable that does not serialize is compiled again next time
            logger.warning("could not store the executable %s (%s: %s)", name, type(e).__name__, e)
