"""LLMEngine: prompts in, RequestOutputs out. Tokenizing, validation, detokenizing
and stop strings happen here, in the caller's process; the engine core runs in a
process of its own (SyncMPClient) or, with enable_multiprocessing=False, in this one."""
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable

import jax

from jaxllm.config import Config, EngineArgs
from jaxllm.contracts.engine_core import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from jaxllm.device_facts import live_device_facts
from jaxllm.engine.core_client import InprocClient, SyncMPClient
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.parallel_sampling import ParentRequest
from jaxllm.engine.processor import Processor, PromptType
from jaxllm.lora.adapter import AdapterChecks
from jaxllm.lora.request import LoRARequest, lora_request_fields
from jaxllm.outputs import PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import POOLING_SAMPLING_PARAMS, PoolingParams
from jaxllm.sampling_params import SamplingParams
from jaxllm.tokenizer import default_sampling_fields, generation_eos_ids, get_tokenizer
from jaxllm.typecheck import check_field_types

logger = logging.getLogger(__name__)


def multiprocessing_enabled(args: EngineArgs) -> bool:
    if args.enable_multiprocessing is not None:
        return args.enable_multiprocessing
    return os.environ.get("JAXLLM_ENABLE_MULTIPROCESSING", "1") != "0"


def data_parallel(args: EngineArgs) -> bool:
    """Whether `args` asks for replicas (several engine cores, or Ray's)."""
    check_field_types(args)
    replicas = args.data_parallel_size > 1 or args.distributed_executor_backend == "ray"
    if replicas and args.enable_multiprocessing is False:
        raise ValueError("data_parallel_size > 1 (or the ray backend) runs each replica's engine core in a "
                         "process of its own: enable_multiprocessing must not be False")
    return replicas


def in_process_config(args: EngineArgs, mesh: jax.sharding.Mesh | None) -> Config:
    """The Config of an engine core in this process, tensor-parallel over `mesh`'s devices if given."""
    if args.enable_multiprocessing or data_parallel(args) or args.num_hosts > 1:
        raise ValueError("params= and mesh= run the engine core in this process, on this process's devices: "
                         "enable_multiprocessing, data_parallel_size > 1 and num_hosts > 1 do not apply")
    if mesh is None:
        return args.create_config(live_device_facts())
    if args.pipeline_parallel_size > 1:
        raise ValueError("mesh= is one tensor-parallel mesh: pipeline_parallel_size > 1 takes the first "
                         "pipeline_parallel_size x tensor_parallel_size devices instead (leave mesh unset)")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    config = dataclasses.replace(args, tensor_parallel_size=mesh.devices.size).create_config(live_device_facts())
    ids = tuple(d.id for d in mesh.devices.flat)
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, device_ids=ids))


class FrontEnd:
    """What LLMEngine and AsyncLLM share: the tokenizer, the Processor and the
    OutputProcessor, over an engine core client that has started."""

    def __init__(self, engine_core):
        self.engine_core = engine_core
        self.config = engine_core.config
        try:
            self.tokenizer = get_tokenizer(self.config.model)
            self.eos_token_ids = generation_eos_ids(self.config.model, self.tokenizer)
            self.default_sampling_fields = default_sampling_fields(self.config.model)
        except BaseException:
            engine_core.shutdown()
            raise
        if self.default_sampling_fields:
            logger.info("default sampling params from the model's files: %s", self.default_sampling_fields)
        self.processor = Processor(self.config, self.tokenizer)
        self.lora_checks = AdapterChecks(self.config.lora, self.config.model.arch)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._arrivals = itertools.count()
        # Called with the SchedulerStats that come with the core's outputs (the server's metrics).
        self.stats_listeners: list[Callable[[SchedulerStats], None]] = []

    def _process(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput | PoolingRequestOutput]:
        """The RequestOutputs of one message of the core's; the requests a stop string ended are
        aborted in the core, and the stats go to the listeners."""
        outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs, core_outputs.timestamp)
        if stopped:
            self.engine_core.abort_requests(stopped)
        if core_outputs.scheduler_stats is not None:
            for listener in self.stats_listeners:
                listener(core_outputs.scheduler_stats)
        return outputs

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams with the model's recommended sampling fields (its
        generation_config.json or GGUF metadata, see jaxllm.tokenizer.default_sampling_fields)
        over vLLM's plain defaults. A bad value in the model's file raises here, naming it."""
        try:
            return SamplingParams(**self.default_sampling_fields)
        except (TypeError, ValueError) as e:
            raise type(e)(f"the model's default sampling params ({self.config.model.path}): {e}") from e

    def _make_requests(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                       lora_request: LoRARequest | None = None) -> list[EngineCoreRequest]:
        """Validate one request and register it with the output processor; a bad one
        raises ValueError (or TypeError) here, before it reaches the core. Returns what
        the core runs: the request, or with n > 1 its n children (ParentRequest)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("lora_request: pooling requests run on the base model")
            return [self._make_pooling_request(request_id, prompt, params)]
        self.lora_checks.check(lora_request)
        processed = self.processor.process(prompt, params)
        arrival_time = time.monotonic()
        parent = ParentRequest(request_id, params, arrival_time) if params.n > 1 else None
        core_ids = parent.child_ids if parent is not None else [request_id]
        self._check_unused([request_id, *core_ids])
        requests = []
        for index, core_id in enumerate(core_ids):
            child_params = parent.child_params(index) if parent is not None else params
            if index > 0 and child_params.prompt_logprobs is not None:
                # The children share the prompt: child 0 computes its logprobs for all n.
                child_params = dataclasses.replace(child_params, prompt_logprobs=None)
            # Without a seed of its own, a request draws from the engine seed and its arrival number.
            arrival = next(self._arrivals)
            seed = child_params.seed
            if seed is None:
                seed = hash((self.config.seed, arrival)) & (2**63 - 1)
            self.output_processor.add_request(core_id, processed.prompt, processed.prompt_token_ids, child_params,
                                              arrival_time, parent, index)
            requests.append(EngineCoreRequest(core_id, processed.prompt_token_ids, child_params, self.eos_token_ids,
                                              seed, arrival_time, processed.bad_words_token_ids,
                                              lora_request=lora_request))
        return requests

    def _make_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams) -> EngineCoreRequest:
        processed = self.processor.process_pooling(prompt, params)
        self._check_unused([request_id])
        self.output_processor.add_pooling_request(request_id, processed.prompt_token_ids)
        # A copy: the caller may change its params while the request runs in this process's core.
        return EngineCoreRequest(request_id, processed.prompt_token_ids, POOLING_SAMPLING_PARAMS, (), 0,
                                 time.monotonic(), pooling_params=dataclasses.replace(params))

    def _check_unused(self, request_ids: list[str]) -> None:
        for used in request_ids:
            if self.output_processor.in_use(used):
                raise ValueError(f"request_id {used!r} is already in use")

    def _forget(self, request_ids, final_outputs: list | None = None) -> list[str]:
        """Drop the requests from the output processor; returns the ids to abort in the core.
        With `final_outputs`, the unfinished requests' last RequestOutputs ("abort") go there."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return self.output_processor.abort(ids, final_outputs)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    @staticmethod
    def _profile_dir(log_dir: str | None) -> str:
        log_dir = log_dir or os.environ.get("JAXLLM_PROFILER_DIR")
        if not log_dir:
            raise ValueError("start_profile needs a log_dir (or JAXLLM_PROFILER_DIR set)")
        return os.path.abspath(log_dir)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class LLMEngine(FrontEnd):
    @classmethod
    def from_engine_args(cls, args: EngineArgs, show_progress: bool = True, params=None,
                         mesh: jax.sharding.Mesh | None = None) -> "LLMEngine":
        """The engine of `args`, resolved here into a Config, which is all the engine core gets.
        With `params` (the model's, in memory) or `mesh` (the devices to run on), the core runs in
        this process, on the mesh's devices: device arrays do not cross processes."""
        if params is not None or mesh is not None:
            return cls(InprocClient(in_process_config(args, mesh), show_progress, params))
        replicas = data_parallel(args)
        if not replicas and not multiprocessing_enabled(args) and args.num_hosts > 1:
            raise ValueError("num_hosts > 1 needs the engine core in a process of its own: "
                             "enable_multiprocessing must not be False")
        if replicas or multiprocessing_enabled(args):
            config = args.create_config()  # for a fresh process of this environment: its devices
            if replicas:
                from jaxllm.engine.dp_client import DPSyncClient
                return cls(DPSyncClient(config, args.distributed_executor_backend == "ray", show_progress))
            return cls(SyncMPClient(config, show_progress))
        return cls(InprocClient(args.create_config(live_device_facts()), show_progress))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue one request (with n > 1, its n children); a bad one raises
        ValueError and leaves the rest untouched. With n > 1 the RequestOutputs carry this
        request_id, and each CompletionOutput its child's index. With PoolingParams (an engine
        with runner="pooling"), a pooling request: one PoolingRequestOutput, with its vector.
        lora_request: the LoRA adapter it runs on (an engine with enable_lora; docs/lora.md)."""
        for request in self._make_requests(request_id, prompt, params, lora_request):
            self.engine_core.add_request(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort one request id or several (a parent's: all its children)."""
        self.engine_core.abort_requests(self._forget(request_ids))

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """The outputs of the next engine step (it blocks while the core computes)."""
        if not self.has_unfinished_requests():
            return []
        return self._process(self.engine_core.get_output())

    def get_stats(self) -> dict:
        """The core's counters: KV blocks (total, free, cached), requests, preemptions, compilations,
        and the prefix cache's tokens looked up and found since start-up."""
        return self.engine_core.call_utility("get_stats")

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens it held) since start-up."""
        stats = self.get_stats()
        return stats["prefix_cache_queries"], stats["prefix_cache_hits"]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing forgotten) while requests run."""
        return self.engine_core.call_utility("reset_prefix_cache")

    # ---- LoRA adapters (vLLM's names) ----
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check the adapter and read it into the engine's host memory now, before its first request."""
        self.lora_checks.check(lora_request)
        return self.engine_core.call_utility("add_lora", *lora_request_fields(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        """Drop a loaded adapter (False: not loaded, or a request still runs on it)."""
        return self.engine_core.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters the engine holds read (max_cpu_loras at most; those on the device among them)."""
        return set(self.engine_core.call_utility("list_loras"))

    def start_profile(self, log_dir: str | None = None) -> None:
        """Record a jax.profiler trace of the engine core into `log_dir` (default
        $JAXLLM_PROFILER_DIR) until stop_profile; see jaxllm.profiling."""
        self.engine_core.call_utility("start_profile", self._profile_dir(log_dir))

    def stop_profile(self) -> None:
        self.engine_core.call_utility("stop_profile")

    # ---- inside a JAX program (docs/jax.md) ----
    def _in_process_core(self, what: str):
        core = getattr(self.engine_core, "core", None)
        if core is None:
            raise ValueError(f"{what} needs the engine core in this process (LLM(params=..., mesh=...) or "
                             "enable_multiprocessing=False): device arrays do not cross processes")
        return core

    def get_params(self) -> dict:
        """The model's params in the engine's layout (a nested dict of the engine's own arrays:
        read them, do not donate or delete them)."""
        return self._in_process_core("get_params").get_params()

    def get_logprobs_fn(self):
        """fn(params, token_ids [S]) -> [S - 1] float32: the model's plain full-sequence logprobs
        of each next token (worker/sequence_logprobs.py), a pure function of params."""
        return self._in_process_core("get_logprobs_fn").executor.runner.logprobs_fn()

    def update_weights(self, source) -> None:
        """New weights without a restart (same executables): params in memory, in the engine's
        layout or HF names (an engine core in this process), or a checkpoint's path (an HF folder,
        a .gguf file or an orbax folder). Checked whole first; the prefix cache is forgotten.
        Raises ValueError while requests run unless generation is paused."""
        if not isinstance(source, str):
            self._in_process_core("update_weights with params in memory")
        self.engine_core.call_utility("update_weights", source)

    def pause_generation(self, mode: str = "wait") -> None:
        """Admit no request until resume_generation: "wait" lets the running ones finish (step()
        goes on giving their outputs), "abort" ends every unfinished request, "keep" sends the
        running ones back to waiting, to go on under the new weights after resume."""
        self.engine_core.call_utility("pause", mode)

    def resume_generation(self) -> None:
        self.engine_core.call_utility("resume")

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and the prefix cache (level 1), and the weights too (level 2)."""
        self.engine_core.call_utility("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Make again what sleep freed: tags "weights", "kv_cache" (default both)."""
        self.engine_core.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.call_utility("is_sleeping")

    def collective_rpc(self, method: str, args: tuple = ()):
        """Call a method of the model runner(s) (vLLM's collective_rpc); the result of this host's."""
        return self.engine_core.call_utility("collective_rpc", method, list(args))
