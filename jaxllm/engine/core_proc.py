"""EngineCoreProc: the engine core (engine/core.py) in a process of its own behind ZMQ sockets,
its main (run_engine_core, for a fresh interpreter) and its life wherever it runs (serve_engine_core,
also a Ray actor's)."""
import gc
import logging
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
import traceback

import zmq

from jaxllm.config import Config
from jaxllm.contracts.engine_core import (DP_RANK_ENV, ENGINE_CORE_DEAD, READY, STARTUP_FAILED, EngineCoreOutputs,
                                          EngineCoreRequest, EngineCoreRequestType, UtilityOutput)
from jaxllm.contracts.serial import MsgpackDecoder, MsgpackEncoder
from jaxllm.distributed import init_distributed
from jaxllm.engine.core import EngineCore
from jaxllm.executor.multihost import HEARTBEAT_S

logger = logging.getLogger(__name__)


class EngineCoreProc:
    """The engine core's process: a busy loop over EngineCore.step. One thread reads
    and decodes requests from the input socket, another encodes and sends outputs, so
    (de)serialization overlaps the step. With nothing to do, the loop sleeps on the
    input queue."""

    def __init__(self, core: EngineCore, input_address: str, output_address: str, ctx: zmq.Context,
                 engine_index: int = 0):
        self.core = core
        self.engine_index = engine_index  # its data-parallel replica
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=_read_requests, args=(ctx, input_address, self.input_queue),
                             name="core-input", daemon=True),
            threading.Thread(target=_send_outputs, args=(ctx, output_address, self.output_queue),
                             name="core-output", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def run_busy_loop(self) -> None:
        while True:
            if not self._process_input_queue():
                break
            if self.core.has_work():
                outputs = self.core.step()
                if outputs.outputs or outputs.scheduler_stats is not None:  # stats: the metrics count each
                    outputs.engine_index = self.engine_index
                    self.output_queue.put(outputs)

    def _process_input_queue(self) -> bool:
        """Handle every message waiting (block for one when idle); False on shutdown."""
        block = not self.core.has_work()
        # Idle with other hosts: a heartbeat each HEARTBEAT_S tells them host 0 lives.
        timeout = HEARTBEAT_S if block and self.core.executor.needs_heartbeat else None
        while True:
            try:
                kind, message = self.input_queue.get(block=block, timeout=timeout)
            except queue.Empty:
                if block:
                    self.core.executor.heartbeat()
                return True
            block = False
            if kind == EngineCoreRequestType.SHUTDOWN:
                return False
            result = apply_message(self.core, kind, message)
            if result is not None:
                self.output_queue.put(EngineCoreOutputs(utility_output=result))
            elif kind == EngineCoreRequestType.ABORT and not self.core.has_work():
                # No step will follow to carry the stats: the front end's gauges would keep the aborted requests.
                self.output_queue.put(EngineCoreOutputs([], time.monotonic(), self.core.scheduler.make_stats(),
                                                        engine_index=self.engine_index))

    def shutdown(self) -> None:
        self.output_queue.put(None)  # the output thread sends what is queued, then stops
        self._threads[1].join(timeout=5)
        self.core.shutdown()


_DECODERS = {EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
             EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
             EngineCoreRequestType.UTILITY: MsgpackDecoder(tuple[int, str, list])}


def apply_message(core: EngineCore, kind: EngineCoreRequestType, message) -> UtilityOutput | None:
    """Apply one message from the front end (not SHUTDOWN); a utility call returns its UtilityOutput."""
    if kind == EngineCoreRequestType.ADD:
        core.add_request(message)
    elif kind == EngineCoreRequestType.ABORT:
        core.abort_requests(message)
    else:
        call_id, method, args = message
        try:
            if method.startswith("_"):
                raise AttributeError(f"{method} is not a utility call")
            return UtilityOutput(call_id, getattr(core, method)(*args))
        except Exception as e:
            return UtilityOutput(call_id, failure=f"{type(e).__name__}: {e}")
    return None


def _read_requests(ctx: zmq.Context, address: str, requests: queue.Queue) -> None:
    """Decode the front end's messages as they come: (kind, message)."""
    socket = ctx.socket(zmq.PULL)
    socket.connect(address)
    while True:
        kind, payload = socket.recv_multipart()
        kind = EngineCoreRequestType(kind)
        decoder = _DECODERS.get(kind)
        requests.put((kind, None if decoder is None else decoder.decode(payload)))
        if kind == EngineCoreRequestType.SHUTDOWN:
            return


def _send_outputs(ctx: zmq.Context, address: str, outputs: queue.Queue) -> None:
    encoder = MsgpackEncoder()
    socket = ctx.socket(zmq.PUSH)
    socket.connect(address)
    while (item := outputs.get()) is not None:
        socket.send(ENGINE_CORE_DEAD if isinstance(item, bytes) else encoder.encode(item))
    socket.close(linger=5000)


def _exit_when_parent_dies() -> None:
    """The parent holds our stdin open; EOF means it is gone, and so must we be."""
    while os.read(sys.stdin.fileno(), 1 << 16):
        pass
    os._exit(1)


def run_engine_core(input_address: str, output_address: str) -> int:
    """The engine core process's main: (Config, show_progress) come on stdin as a
    length-prefixed pickle; READY (with the core's description) or STARTUP_FAILED (with
    the exception) goes out first on the output socket, then the busy loop serves
    until SHUTDOWN."""
    # Ctrl-C in a terminal reaches the whole process group: it is the user's program's to handle
    # (LLM.generate aborts its requests and the engine serves on), and the front end ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    (size,) = struct.unpack("<Q", sys.stdin.buffer.read(8))
    config, show_progress = pickle.loads(sys.stdin.buffer.read(size))
    threading.Thread(target=_exit_when_parent_dies, daemon=True).start()
    return serve_engine_core(config, show_progress, input_address, output_address,
                             int(os.environ.get(DP_RANK_ENV, "0")))


def serve_engine_core(config: Config, show_progress: bool, input_address: str, output_address: str,
                      engine_index: int = 0) -> int:
    """Build the engine core, say READY (or STARTUP_FAILED) on the output socket, and serve
    until SHUTDOWN: the core process's life, wherever it runs (its own process, a Ray actor)."""
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.PUSH)
    handshake.connect(output_address)
    try:
        parallel = config.parallel
        init_distributed(parallel.num_hosts, parallel.host_rank, parallel.coordinator_address,
                         parallel.pipeline_parallel_size > 1)
        core = EngineCore(config, show_progress)  # with other hosts: ready once every host is
    except BaseException as e:
        e.add_note(f"in the engine core process:\n{traceback.format_exc()}")
        try:
            payload = pickle.dumps(e)
        except Exception:
            payload = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
        handshake.send_multipart([STARTUP_FAILED, payload])
        handshake.close(linger=5000)
        return 1
    # What start-up made lives as long as the process: keep the collector from walking it every few steps.
    gc.collect()
    gc.freeze()
    handshake.send_multipart([READY, core.describe().encode()])
    handshake.close(linger=5000)

    proc = EngineCoreProc(core, input_address, output_address, ctx, engine_index)
    try:
        proc.run_busy_loop()
    except BaseException:
        logger.exception("the engine core's busy loop failed")
        proc.output_queue.put(ENGINE_CORE_DEAD)
        proc.shutdown()
        return 1
    proc.shutdown()
    return 0
