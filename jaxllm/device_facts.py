"""What the engine needs to know of the devices to resolve its config (the platform, the local
device count, the fastest attention backend).

For an engine core in a process of its own (device_facts): what a fresh process with this
environment sees, found without starting a JAX backend here, where it would take device
memory the core's process needs. A machine without NVIDIA devices, or with JAX_PLATFORMS
set to CPU, is a CPU one (its device count from XLA_FLAGS); otherwise a short-lived child
process asks JAX, once per environment. For a core in this process (live_device_facts):
JAX itself."""
import dataclasses
import functools
import glob
import json
import os
import re
import subprocess
import sys


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    platform: str           # JAX's default backend: "gpu" or "cpu"
    local_device_count: int
    attention_backend: str  # the fastest for the platform (kernels/attention.py default_backend)


def device_facts() -> DeviceFacts:
    if not _nvidia_devices() or _platforms_exclude_gpu():
        forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
        count = int(forced.group(1)) if forced else int(os.environ.get("JAX_NUM_CPU_DEVICES", "1"))
        return DeviceFacts("cpu", count, "reference")
    return _probe(*(os.environ.get(k, "") for k in ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS", "XLA_FLAGS")))


def live_device_facts() -> DeviceFacts:
    import jax

    from jaxllm.kernels.attention import default_backend
    return DeviceFacts(jax.default_backend(), jax.local_device_count(), default_backend())


def _nvidia_devices() -> list[str]:
    return [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]


def _platforms_exclude_gpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return bool(platforms) and not any(p in platforms for p in ("cuda", "gpu"))


@functools.lru_cache(maxsize=8)
def _probe(*environment: str) -> DeviceFacts:
    """The facts of a fresh process (`environment`: what they depend on, the cache's key)."""
    code = ("import dataclasses, json; from jaxllm.device_facts import live_device_facts; "
            "print(json.dumps(dataclasses.asdict(live_device_facts())))")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # the probe takes no device memory
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"could not read this machine's devices through JAX:\n{result.stderr[-2000:]}")
    return DeviceFacts(**json.loads(result.stdout.strip().splitlines()[-1]))
