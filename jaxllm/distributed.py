"""Several processes, one mesh: joining the jax.distributed group, and the coordination
service's barrier (jaxllm/executor/multihost.py runs a multi-host engine on them)."""
import socket

# Ports past the coordinator's: host 0 publishes the runner calls on + 1 and hears the workers on + 2
# (executor/multihost.py); host r's transfer server listens on + TRANSFER_PORT_OFFSET + r.
TRANSFER_PORT_OFFSET = 3


def init_distributed(num_hosts: int, host_rank: int, coordinator_address: str | None,
                     cross_host_transfers: bool = False) -> None:
    """Join the jax.distributed group (before JAX touches a device); on CPU, through gloo.
    cross_host_transfers: arrays will move between devices of different hosts with jax.device_put
    (pipeline stages on hosts of their own), so each host starts JAX's transfer server, on the
    address it reaches the coordinator from, unless jax_cross_host_transfer_socket_address is set."""
    if num_hosts == 1:
        return
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cross_host_transfers and not jax.config.read("jax_cross_host_transfer_socket_address"):
        host, _, port = coordinator_address.rpartition(":")
        jax.config.update("jax_cross_host_transfer_socket_address",
                          f"{_local_address(host, int(port))}:{int(port) + TRANSFER_PORT_OFFSET + host_rank}")
    jax.distributed.initialize(coordinator_address, num_processes=num_hosts, process_id=host_rank)


def _local_address(host: str, port: int) -> str:
    """This host's address on the interface that reaches host:port (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def barrier(name: str, timeout_s: float = 900) -> None:
    """Wait until every host is here (the coordination service's barrier, not a collective).
    Before the first collective of a phase whose length differs between hosts (loading,
    compiling): a collective's communicator set-up waits only 30 s for the other hosts."""
    import jax
    if jax.process_count() == 1:
        return
    from jax._src import distributed
    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))
