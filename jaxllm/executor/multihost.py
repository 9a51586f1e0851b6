"""Several hosts, one mesh: `num_hosts` processes (one per host) join through
jax.distributed (jaxllm/distributed.py), and the mesh spans every process's devices. JAX is
multi-controller: each process must run the same jitted steps in the same order, each
feeding its own devices. So every host holds a model runner, and host 0, which runs the
engine core and the front end, sends each runner call (a step's SchedulerOutput, its
TokenMasks, a collective_rpc) to the other hosts' runners before it makes the call
itself. Only host 0 reads a step's outputs.

The calls go over ZMQ on the coordinator's host: host 0 publishes them on the coordinator
port + 1, and the workers' acknowledgements of the start-up handshake come back on port + 2.
Idle, host 0 sends an empty message each HEARTBEAT_S; a worker that hears nothing for a
minute takes host 0 for gone and exits.
"""
import logging
import os
import time

import zmq

from jaxllm.config import Config
from jaxllm.contracts.serial import MsgpackDecoder, MsgpackEncoder
from jaxllm.contracts.step import SchedulerOutput, TokenMasks
from jaxllm.distributed import init_distributed
from jaxllm.executor.uniproc import UniprocExecutor
from jaxllm.worker.step_output import StepOutput

logger = logging.getLogger(__name__)

_HELLO, _ACK, _CALL = b"hello", b"ack", b"call"
_HANDSHAKE_POLL_MS = 100
_HANDSHAKE_TIMEOUT_S = 900  # the workers warm up too: as long as a cold start may take
HEARTBEAT_S = 1.0  # the longest host 0 is silent to the other hosts
_SILENCE_TIMEOUT_MS = 60_000
_HEARTBEAT, _SHUTDOWN = "", "shutdown"  # calls that are not the runner's methods
_DECODERS = {"execute_model": MsgpackDecoder(SchedulerOutput), "sample_tokens": MsgpackDecoder(TokenMasks)}
_ARGS = MsgpackDecoder(list)


def _ports(coordinator_address: str) -> tuple[str, int]:
    host, _, port = coordinator_address.rpartition(":")
    return host, int(port)


class CallPublisher:
    """Host 0's side: each runner call, as (method, encoded arguments), to every worker."""

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

    def publish(self, method: str, payload: bytes = b"") -> None:
        self.pub.send_multipart([_CALL, method.encode(), payload])

    def close(self) -> None:
        self.pub.close(linger=5000)


class CallSubscriber:
    """A worker's side: host 0's runner calls, in order."""

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

    def next_call(self) -> tuple[str, bytes]:
        """(method, encoded arguments) of host 0's next call."""
        while True:
            if not self.sub.poll(_SILENCE_TIMEOUT_MS):
                raise RuntimeError(f"host 0 has sent nothing for {_SILENCE_TIMEOUT_MS // 1000} s: it is gone")
            first, *frames = self.sub.recv_multipart()
            if first == _CALL:
                method, payload = frames
                return method.decode(), payload


class MultiHostExecutor(UniprocExecutor):
    """Host 0's executor: its own runner, and every call sent to the other hosts' runners first."""
    needs_heartbeat = True

    def __init__(self, config: Config, show_progress: bool = True):
        super().__init__(config, show_progress)
        self._ctx = zmq.Context()
        self._encoder = MsgpackEncoder()
        self._publisher = CallPublisher(self._ctx, config.parallel.coordinator_address,
                                        config.parallel.num_hosts - 1)  # ready once every host is

    def execute_model(self, sched: SchedulerOutput) -> StepOutput | None:
        self._publisher.publish("execute_model", self._encoder.encode(sched))
        return super().execute_model(sched)

    def sample_tokens(self, masks: TokenMasks) -> StepOutput:
        self._publisher.publish("sample_tokens", self._encoder.encode(masks))
        return super().sample_tokens(masks)

    def collective_rpc(self, method: str, *args):
        self._publisher.publish(method, self._encoder.encode(list(args)))
        return super().collective_rpc(method, *args)

    def heartbeat(self) -> None:
        self._publisher.publish(_HEARTBEAT)

    def shutdown(self) -> None:
        self._publisher.publish(_SHUTDOWN)
        self._publisher.close()
        self._ctx.destroy(linger=5000)
        super().shutdown()


def run_worker(engine_args) -> int:
    """`jaxllm worker`: host `host_rank` > 0 of a multi-host engine. Builds the same runner as
    host 0's and makes host 0's runner calls until host 0 shuts down."""
    if engine_args.num_hosts < 2 or engine_args.host_rank == 0:
        raise ValueError("jaxllm worker runs hosts 1 .. num_hosts - 1 of a multi-host engine: "
                         f"got num_hosts={engine_args.num_hosts}, host_rank={engine_args.host_rank}")
    init_distributed(engine_args.num_hosts, engine_args.host_rank, engine_args.coordinator_address,
                     engine_args.pipeline_parallel_size > 1)
    config = engine_args.create_config()
    executor = UniprocExecutor(config, show_progress=False)
    ctx = zmq.Context()
    calls = CallSubscriber(ctx, engine_args.coordinator_address)
    logger.info("host %d of %d follows host 0 (pid %d)", engine_args.host_rank, engine_args.num_hosts, os.getpid())
    try:
        while True:
            method, payload = calls.next_call()
            if method == _SHUTDOWN:
                return 0
            if method == _HEARTBEAT:
                continue
            decoder = _DECODERS.get(method)
            if decoder is not None:  # a step: its outputs are host 0's to read
                getattr(executor, method)(decoder.decode(payload))
            else:
                executor.collective_rpc(method, *_ARGS.decode(payload))
    finally:
        executor.shutdown()
        ctx.destroy(linger=0)
