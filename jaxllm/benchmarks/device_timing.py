"""How the kernel and device benches time: medians after a warm-up, on random data.

- median_s: the host's clock around a call that blocks (block_until_ready); for calls long
  enough that dispatch (tens of us) does not matter.
- median_loop_s: one jitted fori_loop of many calls on the device, so host dispatch stays out
  of short kernels' figures.
- torch_median_s and torch_copy_tbps: PyTorch on the GPU's own clock (CUDA events), for the
  baselines that need PyTorch (the device-to-device copy rate); optional, as PyTorch is no
  dependency of jaxllm.
"""
import math
import statistics
import time

import jax
import jax.numpy as jnp


def median_s(run, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds of `run()` on the host's clock, after `warmup` untimed calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_loop_s(fn, arg_sets, reps: int = 7, min_loop_s: float = 0.02) -> float:
    """Median seconds per call of fn, timed on the device: one jitted fori_loop calls fn on each
    argument set in turn, enough times to last `min_loop_s`, so host dispatch (about 50 us a call)
    stays out of the figure; the median of `reps` such loops. Each call reads its set's own buffers:
    an optimization barrier ties them to the loop's counter each iteration, which keeps XLA from
    hoisting the calls out of the loop without copying anything (a stacked copy indexed by the
    counter would be a dynamic slice, which XLA copies before a custom call: a slice of weights
    costs as much as the matmul that reads it). The loop's length is an argument, so it compiles
    once; a first timed loop sets it."""
    arg_sets = list(arg_sets) * (2 if len(arg_sets) == 1 else 1)
    num_sets = len(arg_sets)

    @jax.jit
    def loop(num_rounds, arg_sets):
        def body(j, acc):
            sets, acc = jax.lax.optimization_barrier((arg_sets, acc))
            for args in sets:
                acc = acc + fn(*args).reshape(-1)[0].astype(jnp.float32)
            return acc
        return jax.lax.fori_loop(0, num_rounds, body, jnp.float32(0))

    def loop_s(num_calls: int) -> float:
        start = time.perf_counter()
        jax.block_until_ready(loop(num_calls // num_sets, arg_sets))
        return time.perf_counter() - start

    loop_s(num_sets)  # compile + warm-up
    per_call_s = loop_s(num_sets) / num_sets  # dispatch included: an upper bound
    num_calls = num_sets * max(1, math.ceil(min_loop_s / per_call_s / num_sets))
    loop_s(num_calls)
    return statistics.median(loop_s(num_calls) / num_calls for _ in range(reps))


def torch_median_s(run, warmup: int, iters: int) -> float:
    """Median seconds of `run()` on the GPU's clock: CUDA events around each call."""
    import torch
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def torch_copy_tbps(num_bytes: int = 4 << 30) -> float:
    """A device-to-device copy through PyTorch, bytes read + written per second (TB/s): the
    memory roofline the kernels are held against. NaN, with a line saying why, where there is
    no PyTorch, no CUDA or not the memory."""
    try:
        import torch
        seconds = _torch_copy_s(torch, num_bytes)
    except (ImportError, RuntimeError, AssertionError) as e:  # a CPU-only torch asserts
        print("copy not measured:", repr(e)[:200], flush=True)
        return float("nan")
    torch.cuda.empty_cache()  # the buffers went with _torch_copy_s: their memory back for JAX
    return 2 * num_bytes / seconds / 1e12


def _torch_copy_s(torch, num_bytes: int) -> float:
    src = torch.randn(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return torch_median_s(lambda: dst.copy_(src), warmup=3, iters=12)
