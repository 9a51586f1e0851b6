"""Data-parallel replicas anywhere in a Ray cluster (`distributed_executor_backend="ray"`,
the `ray` extra): each replica's engine core runs in a Ray actor that holds
`pipeline_parallel_size` x `tensor_parallel_size` GPUs (Ray sets the actor's CUDA_VISIBLE_DEVICES), on whichever
node has them, and talks to the front end over ZMQ on TCP: the same protocol as a
core in a local process (engine/core_client.py), so the data-parallel clients
(engine/dp_client.py) serve both alike. Ray places the replicas; it does not carry
the requests or the tokens.
"""
import socket


class _EngineCoreActor:
    """A Ray actor's body: one engine core until SHUTDOWN."""

    def run(self, config, show_progress: bool, input_address: str, output_address: str, rank: int) -> int:
        from jaxllm.engine.core_proc import serve_engine_core
        return serve_engine_core(config, show_progress, input_address, output_address, rank)


class RayCore:
    """A replica's engine core in a Ray actor, with the methods of core_client._LocalCore."""

    def __init__(self, config, show_progress: bool, input_address: str, output_address: str, rank: int):
        import ray
        self._ray = ray
        gpus = config.parallel.devices_per_replica if ray.cluster_resources().get("GPU", 0) else 0
        actor_class = ray.remote(num_gpus=gpus, num_cpus=1)(_EngineCoreActor)
        self.actor = actor_class.options(name=None, max_restarts=0).remote()
        self.done = self.actor.run.remote(config, show_progress, input_address, output_address, rank)

    def exit_code(self) -> int | None:
        ready, _ = self._ray.wait([self.done], timeout=0)
        if not ready:
            return None
        try:
            return self._ray.get(self.done)
        except Exception:  # the actor died
            return 1

    def wait(self) -> None:
        self._ray.wait([self.done], timeout=None)

    def stop(self, timeout_s: float) -> None:
        ready, _ = self._ray.wait([self.done], timeout=timeout_s)
        if not ready:
            self._ray.kill(self.actor)


def init_ray():
    """Join the Ray cluster of $RAY_ADDRESS, or start a local one."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'jaxllm[ray]'") from e
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True)
    return ray


def front_end_address() -> str:
    """This host's address that Ray's nodes reach (Ray's own idea of it)."""
    import ray
    try:
        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())
