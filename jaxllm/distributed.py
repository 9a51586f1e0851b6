"""Several processes, one mesh: joining the jax.distributed group, and the coordination
service's barrier (jaxllm/executor/multihost.py runs a multi-host engine on them)."""


def init_distributed(num_hosts: int, host_rank: int, coordinator_address: str | None) -> None:
    """Join the jax.distributed group (before JAX touches a device); on CPU, through gloo."""
    if num_hosts == 1:
        return
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_hosts, process_id=host_rank)


def barrier(name: str, timeout_s: float = 900) -> None:
    """Wait until every host is here (the coordination service's barrier, not a collective).
    Before the first collective of a phase whose length differs between hosts (loading,
    compiling): a collective's communicator set-up waits only 30 s for the other hosts."""
    import jax
    if jax.process_count() == 1:
        return
    from jax._src import distributed
    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))
