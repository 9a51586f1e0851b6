"""EngineCore: one step is schedule -> run the model -> update the requests; and
EngineCoreProc, the same core in a process of its own behind ZMQ sockets.

With asynchronous scheduling the core keeps two steps in flight: it schedules and
dispatches step N+1, then waits for step N's sampled ids and applies them, so the
host's work for one step overlaps the device's work for the other.
"""
import collections
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

import cloudpickle
import jax
import zmq
from jax.profiler import TraceAnnotation

from jaxllm import compilation
from jaxllm.config import Config
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler, SchedulerOutput
from jaxllm.engine import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType,
                           UtilityOutput)
from jaxllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from jaxllm.executor.multihost import IterationPublisher, init_distributed
from jaxllm.request import Request, RequestStatus, check_token_ids
from jaxllm.worker.model_runner import ModelRunner
from jaxllm.worker.step_output import StepOutput

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # multi-host: the longest host 0 is silent to the other hosts
DP_RANK_ENV = "JAXLLM_DATA_PARALLEL_RANK"  # a data-parallel replica's index, set by dp_client.py
# Messages of the process protocol that are not msgpack structs.
READY, STARTUP_FAILED, ENGINE_CORE_DEAD = b"READY", b"STARTUP_FAILED", b"ENGINE_CORE_DEAD"


class EngineCore:
    def __init__(self, config: Config, show_progress: bool = True):
        self.config = config
        self.runner = ModelRunner(config, show_progress)
        self.runner.warm_up(show_progress)
        logger.info(self.runner.describe())
        kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size, self.runner.kv_layout,
                            config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, kv)
        self.batch_queue_size = 2 if config.scheduler.async_scheduling else 1
        self.batch_queue: collections.deque[tuple[SchedulerOutput, StepOutput]] = collections.deque()
        self._grammar_compiler = None  # made for the first request with structured outputs
        self._rejected: list[EngineCoreOutput] = []  # requests that failed on arrival, for the next step's outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one the core cannot take ends at once with an error, alone."""
        if request.request_id in self.scheduler.requests:  # the front ends never send one: nothing to answer
            logger.error("request %s: the id is already in use; the request is dropped", request.request_id)
            return
        try:
            check_token_ids(request, self.config.model.arch.vocab_size)
            core_request = Request.from_engine_core_request(request)
        except Exception as e:
            logger.exception("request %s: rejected", request.request_id)
            self._rejected.append(EngineCoreOutput(request.request_id, [], "error", error=f"{type(e).__name__}: {e}"))
            return
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            try:
                core_request.grammar = self._grammar_matcher(structured)
            except Exception as e:
                logger.exception("request %s: its grammar failed to compile", request.request_id)
                self._rejected.append(EngineCoreOutput(request.request_id, [], "error",
                                                       error=f"structured_outputs: {type(e).__name__}: {e}"))
                return
        self.scheduler.add_request(core_request)

    def _grammar_matcher(self, params):
        if self._grammar_compiler is None:
            from jaxllm.structured_output import GrammarCompiler
            from jaxllm.tokenizer import generation_eos_ids, get_tokenizer
            tokenizer = get_tokenizer(self.config.model)
            self._grammar_compiler = GrammarCompiler(tokenizer, self.config.model.arch.vocab_size,
                                                     generation_eos_ids(self.config.model, tokenizer))
        return self._grammar_compiler.matcher(params)

    def abort_requests(self, request_ids) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue) or bool(self._rejected)

    def step(self) -> EngineCoreOutputs:
        """Dispatch the next step if there is room for it; then, once the queue is full
        (or nothing new could be scheduled), wait for the oldest step and apply it."""
        if self._rejected:
            rejected, self._rejected = self._rejected, []
            return EngineCoreOutputs(rejected, time.monotonic(), self.scheduler.make_stats())
        scheduled = False
        if len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            with TraceAnnotation("schedule"):
                sched = self.scheduler.schedule()
            if not sched.is_empty:
                try:
                    with TraceAnnotation("execute_model"):
                        self.batch_queue.append((sched, self.runner.execute_model(sched)))
                except Exception as e:
                    return self._fail_steps(e, sched)
                scheduled = True
        if not self.batch_queue or (scheduled and len(self.batch_queue) < self.batch_queue_size):
            return EngineCoreOutputs()
        sched, step = self.batch_queue.popleft()
        try:
            with TraceAnnotation("wait"):
                token_ids, logprobs, prompt_logprobs = step.token_ids(), step.host_logprobs(), step.host_prompt_logprobs()
        except Exception as e:
            return self._fail_steps(e, sched)
        with TraceAnnotation("update"):
            outputs = self.scheduler.update_from_output(sched, token_ids, logprobs, prompt_logprobs, step.failed)
            return EngineCoreOutputs(outputs, time.monotonic(), self.scheduler.make_stats())

    def _fail_steps(self, error: Exception, sched: SchedulerOutput) -> EngineCoreOutputs:
        """A failed step may have consumed the donated KV caches: every request it or a
        step still in flight ran loses its KV and ends with the error; fresh caches
        serve the requests still waiting."""
        logger.exception("model step failed")
        requests = {s.request.request_id: s.request for s in sched.requests}
        requests.update((r.request_id, r) for r in self.scheduler.running)
        for queued, _ in self.batch_queue:
            requests.update((s.request.request_id, s.request) for s in queued.requests)
        self.batch_queue.clear()
        ids = [i for i, r in requests.items() if not r.is_finished]
        for r in requests.values():
            r.num_output_placeholders = 0
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        self.runner.reset_kv_caches()
        if not self.scheduler.reset_prefix_cache():  # the cached blocks' KV is gone with the caches
            logger.error("the prefix cache could not be reset after a failed step: a request still holds blocks")
        message = f"{type(error).__name__}: {error}"
        return EngineCoreOutputs([EngineCoreOutput(i, [], "error", error=message) for i in ids],
                                 time.monotonic(), self.scheduler.make_stats())

    # ---- utility calls (the clients' call_utility) ----
    def get_stats(self) -> dict:
        pool = self.scheduler.kv.pool
        return {"num_blocks": pool.num_blocks, "num_free_blocks": pool.num_free_blocks,
                "num_requests": len(self.scheduler.requests), "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting), "num_preemptions": self.scheduler.num_preemptions,
                "num_cached_blocks": pool.num_cached_blocks, "num_compilations": compilation.num_compilations(),
                "prefix_cache_queries": self.scheduler.prefix_cache_totals[0],
                "prefix_cache_hits": self.scheduler.prefix_cache_totals[1]}

    def describe(self) -> str:
        return self.runner.describe()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def time_widest_step(self, num_iters: int = 20) -> float:
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("time_widest_step needs an idle engine")
        while self.batch_queue:  # a step of requests that ended meanwhile
            self.step()
        return self.runner.time_widest_step(num_iters)

    def start_profile(self, log_dir: str, python_tracer: bool = False) -> None:
        """Record a jax.profiler trace of this process into `log_dir` (see jaxllm.profiling).
        Python's tracer (every Python call in the trace) slows the host several-fold: off by default."""
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = int(python_tracer)
        jax.profiler.start_trace(log_dir, profiler_options=options)

    def stop_profile(self) -> None:
        jax.profiler.stop_trace()

    def shutdown(self) -> None:
        self.batch_queue.clear()
        self.runner.shutdown()


class EngineCoreProc:
    """The engine core's process: a busy loop over EngineCore.step. One thread reads
    and decodes requests from the input socket, another encodes and sends outputs, so
    (de)serialization overlaps the step. With nothing to do, the loop sleeps on the
    input queue."""

    def __init__(self, core: EngineCore, input_address: str, output_address: str, ctx: zmq.Context,
                 engine_index: int = 0, publisher=None):
        self.core = core
        self.engine_index = engine_index  # its data-parallel replica
        self.publisher = publisher  # multi-host: sends each iteration's messages to the other hosts
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
                if outputs.outputs:
                    outputs.engine_index = self.engine_index
                    self.output_queue.put(outputs)

    def _process_input_queue(self) -> bool:
        """Handle every message waiting (block for one when idle); False on shutdown.
        With other hosts, they get this iteration's messages before it steps."""
        block = not self.core.has_work()
        # Idle with other hosts: an empty iteration each HEARTBEAT_S tells them host 0 lives.
        timeout = HEARTBEAT_S if block and self.publisher is not None else None
        frames, shutdown = [], False
        while not shutdown:
            try:
                kind, message, raw = self.input_queue.get(block=block, timeout=timeout)
            except queue.Empty:
                break
            block = False
            frames += [kind.value, raw]
            shutdown = kind == EngineCoreRequestType.SHUTDOWN
            result = None if shutdown else apply_message(self.core, kind, message)
            if result is not None:
                self.output_queue.put(EngineCoreOutputs(utility_output=result))
        if self.publisher is not None:
            self.publisher.publish(frames)
        return not shutdown

    def shutdown(self) -> None:
        self.output_queue.put(None)  # the output thread sends what is queued, then stops
        self._threads[1].join(timeout=5)
        if self.publisher is not None:
            self.publisher.close()
        self.core.shutdown()


_DECODERS = {EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
             EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
             EngineCoreRequestType.UTILITY: MsgpackDecoder(tuple[int, str, list])}


def decode_message(kind: EngineCoreRequestType, payload: bytes):
    decoder = _DECODERS.get(kind)
    return None if decoder is None else decoder.decode(payload)


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
    """Decode the front end's messages as they come: (kind, message, the raw payload)."""
    socket = ctx.socket(zmq.PULL)
    socket.connect(address)
    while True:
        kind, payload = socket.recv_multipart()
        kind = EngineCoreRequestType(kind)
        requests.put((kind, decode_message(kind, payload), payload))
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
    """The engine core process's main: (EngineArgs, show_progress) come on stdin as a
    length-prefixed pickle; READY (with the resolved Config) or STARTUP_FAILED (with
    the exception) goes out first on the output socket, then the busy loop serves
    until SHUTDOWN."""
    # Ctrl-C in a terminal reaches the whole process group: it is the user's program's to handle
    # (LLM.generate aborts its requests and the engine serves on), and the front end ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    (size,) = struct.unpack("<Q", sys.stdin.buffer.read(8))
    engine_args, show_progress = pickle.loads(sys.stdin.buffer.read(size))
    threading.Thread(target=_exit_when_parent_dies, daemon=True).start()
    return serve_engine_core(engine_args, show_progress, input_address, output_address,
                             int(os.environ.get(DP_RANK_ENV, "0")))


def serve_engine_core(engine_args, show_progress: bool, input_address: str, output_address: str,
                      engine_index: int = 0) -> int:
    """Build the engine core, say READY (or STARTUP_FAILED) on the output socket, and serve
    until SHUTDOWN: the core process's life, wherever it runs (its own process, a Ray actor)."""
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.PUSH)
    handshake.connect(output_address)
    try:
        init_distributed(engine_args.num_hosts, engine_args.host_rank, engine_args.coordinator_address)
        config = engine_args.create_config()
        core = EngineCore(config, show_progress)
        publisher = None
        if engine_args.num_hosts > 1:  # ready once every host is
            publisher = IterationPublisher(ctx, engine_args.coordinator_address, engine_args.num_hosts - 1)
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
    # By value: the config holds the user's logits processor classes, which may live in a script's __main__.
    handshake.send_multipart([READY, cloudpickle.dumps((config, core.describe()))])
    handshake.close(linger=5000)

    proc = EngineCoreProc(core, input_address, output_address, ctx, engine_index, publisher)
    try:
        proc.run_busy_loop()
    except BaseException:
        logger.exception("the engine core's busy loop failed")
        proc.output_queue.put(ENGINE_CORE_DEAD)
        proc.shutdown()
        return 1
    proc.shutdown()
    return 0
