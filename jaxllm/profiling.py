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
# Kernel kinds by name: cuBLAS / cuBLASLt / CUTLASS / XLA's Triton GEMMs, and the attention
# kernels (ours are named for it; Mosaic GPU's and Pallas' carry their function's name).
_KERNEL_KINDS = (("collective", _COLLECTIVE),
                 ("gemm", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|triton_dot|__dot", re.IGNORECASE)),
                 ("attention", re.compile(r"attention|attn|mosaic|pallas", re.IGNORECASE)))
_TOP_KERNELS = 12


def kernel_kind(name: str) -> str:
    """'gemm', 'attention', 'collective' or 'other' (XLA's fusions: norms, rope, sampling, ...)."""
    return next((kind for kind, pattern in _KERNEL_KINDS if pattern.search(name)), "other")


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
    and idle time (the rest of the span from the first kernel to the last; also in total over
    the trace, with the idle share of the span), the time in
    collectives (and their share of the busy time), the number of kernels, the kernels'
    time by kind (kernel_kind) and of the longest-running kernel names (top_kernels:
    name, ms and launches per step; GPU traces only), and the time in each host phase.
    The device is GPU 0; on a machine without one, XLA's CPU runtime (its thunks)."""
    data = ProfileData.from_file(path)
    planes = {plane.name: plane for plane in data.planes}
    kernels, cpu_thunks, host, collectives = [], [], {}, []
    by_name: dict[str, list[int]] = {}  # kernel name -> [total ns, count]
    if "/device:GPU:0" in planes:
        for line in planes["/device:GPU:0"].lines:
            for e in line.events:
                if e.duration_ns > 0:
                    kernels.append((e.start_ns, e.start_ns + e.duration_ns))
                    if _COLLECTIVE.search(e.name):
                        collectives.append(kernels[-1])
                    total = by_name.setdefault(e.name, [0, 0])
                    total[0] += e.duration_ns
                    total[1] += 1
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
    kind_ns: dict[str, int] = {}
    for name, (ns, _) in by_name.items():
        kind = kernel_kind(name)
        kind_ns[kind] = kind_ns.get(kind, 0) + ns
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:_TOP_KERNELS]
    return {"steps": steps, "device_busy_ms": ms(busy_ns), "device_idle_ms": ms(span_ns - busy_ns),
            # over the whole trace: the idle share of the span is the host's share of the critical path
            "total_busy_ms": round(busy_ns / 1e6, 3), "total_idle_ms": round((span_ns - busy_ns) / 1e6, 3),
            "device_idle_share": round((span_ns - busy_ns) / span_ns, 4) if span_ns else 0.0,
            "collective_ms": ms(collective_ns), "collective_share": round(collective_ns / busy_ns, 3),
            "kernels_per_step": round(len(kernels) / steps, 1),
            "kernel_ms": {kind: ms(ns) for kind, ns in sorted(kind_ns.items())},
            "top_kernels": [{"name": name[:120], "ms": ms(ns), "per_step": round(n / steps, 1)}
                            for name, (ns, n) in top],
            "host_ms": {name: ms(sum(d)) for name, d in sorted(host.items())}}
