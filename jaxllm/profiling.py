"""What a jax.profiler trace of the engine core says about its steps.

`EngineCore.start_profile(log_dir)` / `stop_profile()` record a trace of the core's
process (open it in TensorBoard's or XProf's profile viewer). `summarize_trace`
reads the trace back and answers the question that matters for a step loop: how
long the device worked per step, and how long it sat idle waiting for the host.
The core marks its host phases with these annotations.
"""
import glob
import os
import re

from jax.profiler import ProfileData

HOST_PHASES = ("schedule", "execute_model", "dispatch", "wait", "update")  # dispatch is within execute_model
# Device kernels that move data between devices: NCCL's, and XLA's own collective kernels.
_COLLECTIVE = re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|"
                         r"collective[-_]?permute", re.IGNORECASE)


def latest_trace(log_dir: str) -> str:
    paths = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb trace under {log_dir}")
    return max(paths, key=os.path.getmtime)


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """Total length covered by [start, end) intervals: [(0, 5), (3, 8), (10, 11)] -> 9."""
    covered, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered


def summarize_trace(path: str) -> dict:
    """Per dispatched step, in ms: the device's busy time (the union of its kernels)
    and idle time (the rest of the span from the first kernel to the last), the time in
    collectives (and their share of the busy time), the number of kernels, and the time
    in each host phase.
    The device is GPU 0; on a machine without one, XLA's CPU runtime (its thunks)."""
    data = ProfileData.from_file(path)
    planes = {plane.name: plane for plane in data.planes}
    kernels, cpu_thunks, host, collectives = [], [], {}, []
    if "/device:GPU:0" in planes:
        for line in planes["/device:GPU:0"].lines:
            for e in line.events:
                if e.duration_ns > 0:
                    kernels.append((e.start_ns, e.start_ns + e.duration_ns))
                    if _COLLECTIVE.search(e.name):
                        collectives.append(kernels[-1])
    for line in planes["/host:CPU"].lines:
        for e in line.events:
            if e.name in HOST_PHASES:
                host.setdefault(e.name, []).append(e.duration_ns)
            elif not kernels and line.name.startswith("tf_XLA") and "hlo_module" in dict(e.stats):
                cpu_thunks.append((e.start_ns, e.start_ns + e.duration_ns))
    kernels = kernels or cpu_thunks
    steps = len(host.get("execute_model", []))
    if not kernels or not steps:
        raise ValueError(f"{path}: no device work or no step dispatches in the trace")
    span_ns = max(end for _, end in kernels) - min(start for start, _ in kernels)
    busy_ns = _union_ns(kernels)
    ms = lambda ns: round(ns / steps / 1e6, 3)
    collective_ns = _union_ns(collectives)
    return {"steps": steps, "device_busy_ms": ms(busy_ns), "device_idle_ms": ms(span_ns - busy_ns),
            "collective_ms": ms(collective_ns), "collective_share": round(collective_ns / busy_ns, 3),
            "kernels_per_step": round(len(kernels) / steps, 1),
            "host_ms": {name: ms(sum(d)) for name, d in sorted(host.items())}}
