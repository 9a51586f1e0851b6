"""EngineCore: one step is schedule -> run the model -> update the requests (engine/core_proc.py
serves it in a process of its own behind ZMQ sockets).

With asynchronous scheduling the core keeps two steps in flight: it schedules and
dispatches step N+1, then waits for step N's sampled ids and applies them, so the
host's work for one step overlaps the device's work for the other. Under pipeline
parallelism it keeps one step per stage in flight (vLLM's batch queue), each of other
requests (or of the next prefill chunks), so every stage has a step to run. A step with
requests under token masks (structured outputs, multi-token bad words) dispatches its
forward pass, applies the steps before it (their tokens advance the grammars), makes
the masks, and then dispatches its sampling: the masks are made while the forward runs.
"""
import collections
import logging
import time

import jax
from jax.profiler import TraceAnnotation

from jaxllm import compilation
from jaxllm.config import Config
from jaxllm.contracts.engine_core import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from jaxllm.contracts.step import SchedulerOutput
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler
from jaxllm.core.token_masks import make_token_masks
from jaxllm.executor import make_executor
from jaxllm.lora.request import LoRARequest
from jaxllm.request import Request, RequestStatus, check_token_ids
from jaxllm.spec_decode import make_proposer
from jaxllm.speculative_config import EAGLE_METHODS
from jaxllm.worker.step_output import StepOutput

logger = logging.getLogger(__name__)



PAUSE_MODES = ("wait", "abort", "keep")


class EngineCore:
    def __init__(self, config: Config, show_progress: bool = True, params=None):
        """params: the model's params in memory (an engine in the caller's process), else its checkpoint's."""
        self.config = config
        self.executor = make_executor(config, show_progress, params)
        logger.info(self.executor.describe())
        kv = KVCacheManager(self.executor.num_blocks, config.cache.block_size, self.executor.kv_layout,
                            config.cache.enable_prefix_caching,
                            use_eagle=config.speculative is not None and config.speculative.method in EAGLE_METHODS,
                            num_state_slots=self.executor.num_state_slots)
        self.scheduler = Scheduler(config.scheduler, kv, make_proposer(config), config.num_speculative_tokens,
                                   config.lora.max_loras if config.lora else 0)
        # Steps in flight: two with asynchronous scheduling, one per stage under pipeline parallelism.
        self.batch_queue_size = max(2 if config.scheduler.async_scheduling else 1, config.parallel.pipeline_parallel_size)
        self.batch_queue: collections.deque[tuple[SchedulerOutput, StepOutput]] = collections.deque()
        self._grammar_compiler = None  # made for the first request with structured outputs
        # Outputs made outside a step (a request rejected on arrival, a failed token mask), for the next step's.
        self._pending: list[EngineCoreOutput] = []
        self._paused = False  # pause_generation: no request is admitted until resume
        self._sleep_level = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one the core cannot take ends at once with an error, alone."""
        if request.request_id in self.scheduler.requests:  # the front ends never send one: nothing to answer
            logger.error("request %s: the id is already in use; the request is dropped", request.request_id)
            return
        try:
            check_token_ids(request, self.config.model.arch.vocab_size)
            pooler = self.config.model.pooler_config
            if request.pooling_params is not None and pooler is None:
                raise ValueError("pooling_params: this engine does not pool (start it with runner='pooling')")
            if request.lora_request is not None and self.config.lora is None:
                raise ValueError("lora_request: this engine was started without enable_lora")
            core_request = Request.from_engine_core_request(request, pooler)
        except Exception as e:
            logger.exception("request %s: rejected", request.request_id)
            self._pending.append(EngineCoreOutput(request.request_id, [], "error", error=f"{type(e).__name__}: {e}"))
            return
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            try:
                core_request.grammar = self._grammar_matcher(structured)
            except Exception as e:
                logger.exception("request %s: its grammar failed to compile", request.request_id)
                self._pending.append(EngineCoreOutput(request.request_id, [], "error",
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
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue) or bool(self._pending)

    def step(self) -> EngineCoreOutputs:
        """Dispatch the next step if there is room for it; then, once the queue is full
        (or nothing new could be scheduled), wait for the oldest step and apply it."""
        outputs, self._pending = self._pending, []
        if outputs:
            return EngineCoreOutputs(outputs, time.monotonic(), self.scheduler.make_stats())
        scheduled = False
        if len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            with TraceAnnotation("schedule"):
                sched = self.scheduler.schedule()
            if not sched.is_empty:
                try:
                    with TraceAnnotation("execute_model"):
                        step = self.executor.execute_model(sched)
                        if step is None:  # its sampling waits for the token masks
                            outputs = self._apply_all()
                            step = self._sample_under_masks(sched)
                        self.batch_queue.append((sched, step))
                except Exception as e:
                    return self._fail_steps(e)
                scheduled = True
        if outputs:
            return EngineCoreOutputs(outputs, time.monotonic(), self.scheduler.make_stats())
        if not self.batch_queue or (scheduled and len(self.batch_queue) < self.batch_queue_size):
            return EngineCoreOutputs()
        try:
            outputs = self._apply_oldest()
        except Exception as e:
            return self._fail_steps(e)
        return EngineCoreOutputs(outputs, time.monotonic(), self.scheduler.make_stats())

    def _apply_oldest(self) -> list[EngineCoreOutput]:
        """Wait for the oldest step in flight and apply its output."""
        sched, step = self.batch_queue[0]
        with TraceAnnotation("wait"):
            output = step.get_output()
        self.batch_queue.popleft()
        with TraceAnnotation("update"):
            return self.scheduler.update_from_output(sched, output)

    def _apply_all(self) -> list[EngineCoreOutput]:
        outputs = []
        while self.batch_queue:
            outputs += self._apply_oldest()
        return outputs

    def _sample_under_masks(self, sched: SchedulerOutput) -> StepOutput:
        """Make the token masks of the step's host-masked requests that sample (their grammars hold
        every token before), and dispatch the step's sampling under them. A request whose mask
        fails ends alone, with the error, at the next step's outputs."""
        requests = [r for s, r in zip(sched.scheduled, self.scheduler.scheduled_requests(sched))
                    if s.samples and r.needs_host_mask and not r.is_finished]
        masks, failed = make_token_masks(requests, self.config.model.arch.vocab_size)
        if failed:
            self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
            self._pending += [EngineCoreOutput(i, [], "error", error=e) for i, e in failed.items()]
        return self.executor.sample_tokens(masks)

    def _fail_steps(self, error: Exception) -> EngineCoreOutputs:
        """A failed step may have consumed the donated KV caches: every request it or a
        step still in flight ran loses its KV and ends with the error; fresh caches
        serve the requests still waiting."""
        logger.exception("model step failed")
        requests = {r.request_id: r for r in self.scheduler.in_flight_requests()}
        requests.update((r.request_id, r) for r in self.scheduler.running)
        self.batch_queue.clear()
        self.scheduler.drop_in_flight()
        ids = [i for i, r in requests.items() if not r.is_finished]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        self.executor.collective_rpc("reset_kv_caches")
        if not self.scheduler.reset_prefix_cache():  # the cached blocks' KV is gone with the caches
            logger.error("the prefix cache could not be reset after a failed step: a request still holds blocks")
        message = f"{type(error).__name__}: {error}"
        return EngineCoreOutputs([EngineCoreOutput(i, [], "error", error=message) for i in ids],
                                 time.monotonic(), self.scheduler.make_stats())

    # ---- generation paused, weights updated, memory freed (an engine inside a training loop) ----
    def pause(self, mode: str = "wait") -> None:
        """Admit no request until resume. "wait": the running ones go on to their end (the front end
        waits for them); "abort": every unfinished request ends with finish_reason "abort";
        "keep": the running ones go back to waiting, their KV freed and their tokens kept, to go on
        (recomputing their KV, under new weights if there are) after resume."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._pending += self._apply_all()
        self._paused = True
        self.scheduler.paused = True
        if mode == "abort":
            ids = list(self.scheduler.requests)
            self.abort_requests(ids)
            self._pending += [EngineCoreOutput(i, [], "abort") for i in ids]
        elif mode == "keep":
            self.scheduler.preempt_all()

    def resume(self) -> None:
        self._paused = False
        self.scheduler.paused = self._sleep_level > 0

    def _check_quiet(self, what: str) -> None:
        """Only with no request running, and none waiting unless paused: their KV (and the prefix
        cache's) came from the weights being replaced or freed."""
        self._pending += self._apply_all()
        if self.scheduler.running or (self.scheduler.waiting and not self._paused):
            raise ValueError(f"{what} while requests run: pause_generation() first (mode 'wait', 'abort' or "
                             "'keep'), or let them finish")

    def update_weights(self, source) -> None:
        """New weights (params in memory, or a checkpoint's path; see ModelRunner.update_weights);
        the prefix cache forgets the old weights' KV."""
        self._check_quiet("update_weights")
        self.executor.collective_rpc("update_weights", source)
        self.scheduler.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and the prefix cache (level 1), and the weights too (level 2)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self._check_quiet("sleep")
        self.scheduler.reset_prefix_cache()
        self.executor.collective_rpc("sleep", level)
        self._sleep_level = max(self._sleep_level, level)
        self.scheduler.paused = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Make again what sleep freed ("weights", "kv_cache"; default both)."""
        tags = list(tags or ("weights", "kv_cache"))
        if bad := [t for t in tags if t not in ("weights", "kv_cache")]:
            raise ValueError(f"tags must be 'weights' and/or 'kv_cache', got {bad}")
        self.executor.collective_rpc("wake_up", tags)
        if "kv_cache" in tags:
            self._sleep_level = 0
            self.scheduler.paused = self._paused

    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    def get_params(self) -> dict:
        return self.executor.collective_rpc("get_params")

    # ---- LoRA adapters (vLLM's add_lora, remove_lora, list_loras) ----
    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> bool:
        """Read the adapter into the runner's host memory now; raises ValueError on a bad adapter."""
        self._check_lora("add_lora")
        self.executor.collective_rpc("add_lora", LoRARequest(lora_name, lora_int_id, lora_path))
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop the adapter from the runner's slots and host memory (False: not loaded, or still running)."""
        self._check_lora("remove_lora")
        return self.executor.collective_rpc("remove_lora", lora_int_id)

    def list_loras(self) -> list[int]:
        self._check_lora("list_loras")
        return self.executor.collective_rpc("list_loras")

    def _check_lora(self, what: str) -> None:
        if self.config.lora is None:
            raise ValueError(f"{what}: this engine was started without enable_lora")

    def collective_rpc(self, method: str, args: list | tuple = ()):
        """Call a method of every model runner (vLLM's collective_rpc); this host's result."""
        if method.startswith("_"):
            raise AttributeError(f"{method} is not a runner method")
        return self.executor.collective_rpc(method, *args)

    # ---- utility calls (the clients' call_utility) ----
    def get_stats(self) -> dict:
        pool = self.scheduler.kv.pool
        spec = self.scheduler.spec_totals
        spec_decode = {} if spec is None else {
            "spec_decode_num_drafts": spec.num_drafts, "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens}
        return {"num_blocks": pool.num_blocks, "num_free_blocks": pool.num_free_blocks,
                "num_requests": len(self.scheduler.requests), "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting), "num_preemptions": self.scheduler.num_preemptions,
                "num_cached_blocks": pool.num_cached_blocks, "num_compilations": compilation.num_compilations(),
                "prefix_cache_queries": self.scheduler.prefix_cache_totals[0],
                "prefix_cache_hits": self.scheduler.prefix_cache_totals[1], **spec_decode, **self._state_slot_stats()}

    def _state_slot_stats(self) -> dict:
        """A hybrid model's Mamba state slots (a pool apart from the KV blocks)."""
        slots = self.scheduler.kv.state_slots
        return {} if slots is None else {"num_state_slots": slots.num_blocks,
                                         "num_free_state_slots": slots.num_free_blocks}

    def describe(self) -> str:
        return self.executor.describe()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def record_widest_step(self) -> None:
        """For `jaxllm bench step`: keep the widest step's inputs from now on (time_widest_step)."""
        self.executor.collective_rpc("record_widest_step")

    def time_widest_step(self, num_iters: int = 20) -> float:
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("time_widest_step needs an idle engine")
        self._apply_all()  # a step of requests that ended meanwhile
        return self.executor.collective_rpc("time_widest_step", num_iters)

    def start_profile(self, log_dir: str, python_tracer: bool = False) -> None:
        """Record a jax.profiler trace of this process into `log_dir` (see jaxllm.profiling).
        Python's tracer (every Python call in the trace) slows the host several-fold: off by default."""
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = int(python_tracer)
        jax.profiler.start_trace(log_dir, profiler_options=options)

    def stop_profile(self) -> None:
        jax.profiler.stop_trace()

    def shutdown(self) -> None:
        """Wait for the steps still running (a device must not be freed under them), then free it."""
        for _, step in self.batch_queue:
            try:
                jax.block_until_ready(step.device_arrays())
            except Exception:  # a failed step has nothing left running
                logger.debug("a step in flight failed at shutdown", exc_info=True)
        self.batch_queue.clear()
        self.executor.shutdown()
