"""Several hosts, one mesh: `num_hosts` processes (one per host) join through
jax.distributed, and the mesh spans every process's devices. JAX is multi-controller:
each process must run the same jitted steps in the same order, each feeding its own
devices. So every host runs the same engine core (scheduler, KV cache manager, runner),
and host 0, which serves the front end, sends the others what it takes from the front
end in each iteration of its busy loop (requests, aborts, utility calls, shutdown),
before it steps. The scheduler is deterministic, so every host makes the same
SchedulerOutput and dispatches the same step; only host 0 sends outputs back.

The messages go over ZMQ on the coordinator's host: host 0 publishes each iteration's
messages on the coordinator port + 1, and the workers' acknowledgements of the start-up
handshake come back on port + 2. A worker that loses host 0 exits.
"""
import logging
import os
import time

import zmq

logger = logging.getLogger(__name__)

_HELLO, _ACK, _ITERATION = b"hello", b"ack", b"it"
_HANDSHAKE_POLL_MS = 100
_HANDSHAKE_TIMEOUT_S = 900  # the workers warm up too: as long as a cold start may take
_SILENCE_TIMEOUT_MS = 60_000  # host 0 sends an iteration at least each second (core.HEARTBEAT_S)


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


def _ports(coordinator_address: str) -> tuple[str, int]:
    host, _, port = coordinator_address.rpartition(":")
    return host, int(port)


class IterationPublisher:
    """Host 0's side: one message per busy-loop iteration, with the raw (kind, payload)
    frames it applied, to every worker."""

    def __init__(self, ctx: zmq.Context, coordinator_address: str, num_workers: int):
        _, port = _ports(coordinator_address)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(f"tcp://*:{port + 1}")
        acks = ctx.socket(zmq.PULL)
        acks.bind(f"tcp://*:{port + 2}")
        # PUB drops what it sends before a subscriber has joined: say hello until every worker has heard it.
        joined, deadline = 0, time.monotonic() + _HANDSHAKE_TIMEOUT_S
        while joined < num_workers:
            if time.monotonic() > deadline:
                acks.close(linger=0)
                raise RuntimeError(f"{joined} of the {num_workers} other hosts joined host 0 in "
                                   f"{_HANDSHAKE_TIMEOUT_S} s: start `jaxllm worker` on each")
            self.pub.send(_HELLO)
            while acks.poll(_HANDSHAKE_POLL_MS):
                acks.recv()
                joined += 1
        acks.close(linger=0)

    def publish(self, frames: list[bytes]) -> None:
        self.pub.send_multipart([_ITERATION, *frames])

    def close(self) -> None:
        self.pub.close(linger=5000)


class IterationSubscriber:
    """A worker's side: the iterations of host 0, in order."""

    def __init__(self, ctx: zmq.Context, coordinator_address: str):
        host, port = _ports(coordinator_address)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(f"tcp://{host}:{port + 1}")
        while self.sub.recv() != _HELLO:
            pass
        ack = ctx.socket(zmq.PUSH)
        ack.connect(f"tcp://{host}:{port + 2}")
        ack.send(_ACK)
        ack.close(linger=5000)

    def next_frames(self) -> list[bytes]:
        """The (kind, payload) frames of host 0's next iteration."""
        while True:
            if not self.sub.poll(_SILENCE_TIMEOUT_MS):
                raise RuntimeError(f"host 0 has sent nothing for {_SILENCE_TIMEOUT_MS // 1000} s: it is gone")
            first, *frames = self.sub.recv_multipart()
            if first == _ITERATION:
                return frames


def run_worker(engine_args) -> int:
    """`jaxllm worker`: host `host_rank` > 0 of a multi-host engine. Builds the same engine
    core as host 0 and follows its iterations until host 0 shuts down."""
    from jaxllm.engine import EngineCoreRequestType
    from jaxllm.engine.core import EngineCore, apply_message, decode_message

    if engine_args.num_hosts < 2 or engine_args.host_rank == 0:
        raise ValueError("jaxllm worker runs hosts 1 .. num_hosts - 1 of a multi-host engine: "
                         f"got num_hosts={engine_args.num_hosts}, host_rank={engine_args.host_rank}")
    init_distributed(engine_args.num_hosts, engine_args.host_rank, engine_args.coordinator_address)
    config = engine_args.create_config()
    core = EngineCore(config, show_progress=False)
    ctx = zmq.Context()
    iterations = IterationSubscriber(ctx, engine_args.coordinator_address)
    logger.info("host %d of %d follows host 0 (pid %d)", engine_args.host_rank, engine_args.num_hosts, os.getpid())
    try:
        while True:
            frames = iterations.next_frames()
            for kind, payload in zip(frames[::2], frames[1::2]):
                kind = EngineCoreRequestType(kind)
                if kind == EngineCoreRequestType.SHUTDOWN:
                    return 0
                apply_message(core, kind, decode_message(kind, payload))
            if core.has_work():
                core.step()
    finally:
        core.shutdown()
        ctx.destroy(linger=0)
