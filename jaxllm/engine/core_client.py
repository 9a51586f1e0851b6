"""The front end's handle on the engine core. Three clients, one set of methods
(add_request, abort_requests, get_output, call_utility, shutdown):

- InprocClient: the core in this process; each get_output runs one step (tests, debugging).
- SyncMPClient: the core in its own process (EngineCoreProc) behind ZMQ; a thread
  reads its outputs. What LLM and LLMEngine use by default.
- AsyncMPClient: the same process, read by an asyncio task (AsyncLLM).

The core process runs `jaxllm.engine.core_proc.run_engine_core` in a fresh interpreter (JAX is not
fork-safe), which never re-runs the user's script. If it dies, every pending and
every later call raises EngineDeadError.
"""
import asyncio
import concurrent.futures
import itertools
import logging
import pickle
import queue
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import cloudpickle
import zmq
import zmq.asyncio

from jaxllm.config import Config
from jaxllm.contracts.engine_core import (ENGINE_CORE_DEAD, READY, EngineCoreOutputs, EngineCoreRequest,
                                          EngineCoreRequestType)
from jaxllm.engine.exceptions import EngineDeadError
from jaxllm.contracts.serial import MsgpackDecoder, MsgpackEncoder

_SHUTDOWN_TIMEOUT_S = 5.0
_CORE_MAIN = "import sys; from jaxllm.engine.core_proc import run_engine_core; sys.exit(run_engine_core(*sys.argv[1:]))"
logger = logging.getLogger(__name__)


class InprocClient:
    def __init__(self, config: Config, show_progress: bool = True, params=None):
        from jaxllm.engine.core import EngineCore  # the model and kernels: only where they run
        self.core = EngineCore(config, show_progress, params)
        self.config = config
        self.description = self.core.describe()
        self._finalizer = weakref.finalize(self, self.core.shutdown)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step() if self.core.has_work() else EngineCoreOutputs()

    def call_utility(self, method: str, *args):
        return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        self._finalizer()


class _LocalCore:
    """The engine core in a fresh interpreter on this machine (JAX is not fork-safe)."""

    def __init__(self, config: Config, show_progress: bool, input_address: str, output_address: str,
                 env: dict[str, str] | None):
        self.proc = subprocess.Popen([sys.executable, "-c", _CORE_MAIN, input_address, output_address],
                                     stdin=subprocess.PIPE, env=env)
        # cloudpickle: a logits processor class defined in the user's script (__main__) travels by value.
        payload = cloudpickle.dumps((config, show_progress))
        try:
            self.proc.stdin.write(struct.pack("<Q", len(payload)) + payload)
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the core died at once: wait_ready reports its exit code

    def exit_code(self) -> int | None:
        """None while the core runs."""
        return self.proc.poll()

    def wait(self) -> None:
        self.proc.wait()

    def stop(self, timeout_s: float) -> None:
        """Wait for the core to exit, then kill it."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdin.close()


class _CoreProcess:
    """The core process, the sockets to it, and the thread that watches it. `close`
    needs nothing of the client, so it can be the client's finalizer. `launch(input_address,
    output_address)` starts the core (a _LocalCore, or engine/ray_dp.py's actor); the
    sockets are ipc ones on this machine, TCP ones on `tcp_host` for a core elsewhere."""

    def __init__(self, config: Config, show_progress: bool, env: dict[str, str] | None = None,
                 launch=None, tcp_host: str | None = None):
        self.ctx = zmq.Context()
        self.dir = tempfile.mkdtemp(prefix="jaxllm-")
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # never block the caller while the core is alive
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        if tcp_host is None:
            self.input_address, self.output_address = f"ipc://{self.dir}/input", f"ipc://{self.dir}/output"
            self.input.bind(self.input_address)
            self.output.bind(self.output_address)
        else:
            self.input_address = f"tcp://{tcp_host}:{self.input.bind_to_random_port(f'tcp://{tcp_host}')}"
            self.output_address = f"tcp://{tcp_host}:{self.output.bind_to_random_port(f'tcp://{tcp_host}')}"
        self.dead = False
        self.reader: threading.Thread | None = None  # SyncMPClient's
        self._send_lock = threading.Lock()
        self._closed = False
        if launch is None:
            self.core = _LocalCore(config, show_progress, self.input_address, self.output_address, env)
        else:
            self.core = launch(self.input_address, self.output_address)
        self.monitor = threading.Thread(target=_watch_process, args=(self.core, self.ctx, self.output_address),
                                        name="core-monitor", daemon=True)

    @property
    def proc(self) -> subprocess.Popen | None:
        """The local core's process (None for a core elsewhere)."""
        return getattr(self.core, "proc", None)

    def exited(self) -> bool:
        return self.core.exit_code() is not None

    def wait_ready(self) -> str:
        """The core's description, once it has warmed up; a start-up failure in the core is
        raised here as the exception it was there."""
        try:
            while not self.output.poll(100):
                if self.exited():
                    raise RuntimeError(f"the engine core process exited with code {self.core.exit_code()} "
                                       "during start-up")
            kind, payload = self.output.recv_multipart()
            if kind != READY:
                raise pickle.loads(payload)
        except BaseException:
            self.close()
            raise
        self.monitor.start()
        return payload.decode()

    def send(self, kind: EngineCoreRequestType, payload: bytes) -> None:
        with self._send_lock:
            while True:
                if self.dead or self.exited():
                    raise EngineDeadError()
                try:
                    self.input.send_multipart([kind.value, payload], flags=zmq.NOBLOCK)
                    return
                except zmq.Again:  # the core has not connected yet
                    time.sleep(0.001)

    def close(self) -> None:
        """Stop the core (politely, then by force), its threads, and the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.exited():
            try:
                self.input.send_multipart([EngineCoreRequestType.SHUTDOWN.value, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.core.stop(_SHUTDOWN_TIMEOUT_S)
        for thread in (self.monitor, self.reader):
            if thread is not None and thread.is_alive():
                thread.join(_SHUTDOWN_TIMEOUT_S)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)


def _watch_process(core, ctx: zmq.Context, output_address: str) -> None:
    """When the core exits, tell the output reader in-band, after what it sent."""
    core.wait()
    socket = ctx.socket(zmq.PUSH)
    socket.connect(output_address)
    socket.send(ENGINE_CORE_DEAD)
    socket.close(linger=1000)


def _route(message: bytes, decoder: MsgpackDecoder, put_output, futures: dict, process: _CoreProcess) -> bool:
    """Deliver one message from the core: a utility result to its future, outputs to
    the queue. False once the core is dead (every waiter then has EngineDeadError)."""
    if message == ENGINE_CORE_DEAD:
        process.dead = True
        error = EngineDeadError()
        for future in list(futures.values()):
            if not future.done():
                future.set_exception(error)
        futures.clear()
        put_output(error)
        return False
    outputs: EngineCoreOutputs = decoder.decode(message)
    result = outputs.utility_output
    if result is None:
        put_output(outputs)
        return True
    future = futures.pop(result.call_id, None)
    if future is not None and not future.done():
        if result.failure is None:
            future.set_result(result.result)
        else:  # the caller's mistake stays its kind (a ValueError naming the field); anything else is the core's
            kind, _, message = result.failure.partition(": ")
            error = {"ValueError": ValueError, "TypeError": TypeError}.get(kind)
            future.set_exception(error(message) if error else
                                 RuntimeError(f"engine core utility call failed: {result.failure}"))
    return True


class _MPClient:
    def __init__(self, config: Config, show_progress: bool = True, process: _CoreProcess | None = None):
        """`process`: a core process already started (data parallelism starts them all, then waits)."""
        self._process = process or _CoreProcess(config, show_progress)
        self._finalizer = weakref.finalize(self, self._process.close)
        self.config = config
        self.description = self._process.wait_ready()
        self._encoder = MsgpackEncoder()
        self._futures: dict[int, object] = {}
        self._call_ids = itertools.count()

    @property
    def proc(self) -> subprocess.Popen | None:
        return self._process.proc

    @property
    def dead(self) -> bool:
        """True once the core process has exited, even before a reader has noticed."""
        return self._process.dead or self._process.exited()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._process.send(EngineCoreRequestType.ADD, self._encoder.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._process.send(EngineCoreRequestType.ABORT, self._encoder.encode(list(request_ids)))

    def _send_utility(self, future, method: str, args) -> None:
        call_id = next(self._call_ids)
        self._futures[call_id] = future
        if self._process.dead:
            raise EngineDeadError()
        self._process.send(EngineCoreRequestType.UTILITY, self._encoder.encode((call_id, method, list(args))))

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(_MPClient):
    def __init__(self, config: Config, show_progress: bool = True, process: _CoreProcess | None = None,
                 outputs: queue.Queue | None = None):
        """`outputs`: a queue that the reader fills (data parallelism gives every replica's reader one)."""
        super().__init__(config, show_progress, process)
        self._outputs: queue.Queue = queue.Queue() if outputs is None else outputs
        reader = threading.Thread(target=_read_outputs, name="core-output-reader", daemon=True,
                                  args=(self._process, self._outputs.put, self._futures))
        self._process.reader = reader
        reader.start()

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs; blocks until the core sends them."""
        item = self._outputs.get()
        if isinstance(item, Exception):
            self._outputs.put(item)  # and to every later caller
            raise item
        return item

    def call_utility(self, method: str, *args):
        future = concurrent.futures.Future()
        self._send_utility(future, method, args)
        return future.result()


def _read_outputs(process: _CoreProcess, put_output, futures: dict) -> None:
    decoder = MsgpackDecoder(EngineCoreOutputs)
    try:
        while _route(process.output.recv(), decoder, put_output, futures, process):
            pass
    except Exception:  # a reader that cannot go on leaves no caller waiting
        logger.exception("reading the engine core's outputs failed")
        _route(ENGINE_CORE_DEAD, decoder, put_output, futures, process)


class AsyncMPClient(_MPClient):
    """Reads the core's outputs in an asyncio task, started in the running loop at first use."""

    def __init__(self, config: Config, show_progress: bool = True, process: _CoreProcess | None = None):
        super().__init__(config, show_progress, process)
        self._outputs: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None

    def _ensure_reader(self, outputs: asyncio.Queue | None = None) -> None:
        """Start the reader task in the running loop; it fills `outputs` if given (data parallelism)."""
        if self._reader is None:
            self._outputs = asyncio.Queue() if outputs is None else outputs
            socket = zmq.asyncio.Socket.from_socket(self._process.output)
            self._reader = asyncio.get_running_loop().create_task(
                _read_outputs_async(socket, self._process, self._outputs.put_nowait, self._futures))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_reader()
        item = await self._outputs.get()
        if isinstance(item, Exception):
            self._outputs.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, method: str, *args):
        self._ensure_reader()
        future = asyncio.get_running_loop().create_future()
        self._send_utility(future, method, args)
        return await future

    def shutdown(self) -> None:
        if self._reader is not None and not self._reader.get_loop().is_closed():
            self._reader.cancel()
        super().shutdown()


async def _read_outputs_async(socket, process: _CoreProcess, put_output, futures: dict) -> None:
    decoder = MsgpackDecoder(EngineCoreOutputs)
    try:
        while _route(await socket.recv(), decoder, put_output, futures, process):
            pass
    except Exception:
        logger.exception("reading the engine core's outputs failed")
        _route(ENGINE_CORE_DEAD, decoder, put_output, futures, process)
