"""Executors: what stands between the engine core and the model runners that own the devices.

- UniprocExecutor (uniproc.py): this process drives every local device through one runner.
- MultiHostExecutor (multihost.py): one runner per host, one mesh over all their devices; host 0's
  core sends each runner call to the other hosts' runners (`jaxllm worker`) before it makes it.

Data-parallel replicas are whole engine cores, not runners: engine/dp_client.py starts them,
as local processes or, across a Ray cluster, as Ray actors (jaxllm/engine/ray_dp.py).
"""
from jaxllm.config import Config


def make_executor(config: Config, show_progress: bool = True, params=None):
    """The executor `config.parallel` asks for, its runners built and warmed up (on `params` in
    memory if given: one process only)."""
    if config.parallel.num_hosts > 1:
        if params is not None:
            raise ValueError("params in memory need one process: num_hosts must be 1")
        from jaxllm.executor.multihost import MultiHostExecutor
        return MultiHostExecutor(config, show_progress)
    from jaxllm.executor.uniproc import UniprocExecutor
    return UniprocExecutor(config, show_progress, params)
