"""AsyncLLM: the engine for asyncio code (and the server): `async for out in
llm.generate(prompt, params, request_id)`, and on an engine with runner="pooling"
`llm.encode(prompt, pooling_params, request_id)` for a prompt's vector.

The engine core runs in its own process (AsyncMPClient). One output-handler task
reads the core's outputs, detokenizes them and hands each request's RequestOutput
to that request's collector, which its `generate` awaits. Leaving `generate` early
(break, cancellation of the consuming task) aborts the request in the core.
"""
import asyncio
import logging
from collections.abc import AsyncGenerator

from jaxllm.config import EngineArgs
from jaxllm.engine.core_client import AsyncMPClient
from jaxllm.engine.exceptions import EngineDeadError
from jaxllm.engine.llm_engine import FrontEnd, data_parallel
from jaxllm.engine.processor import PromptType
from jaxllm.lora.request import LoRARequest, lora_request_fields
from jaxllm.outputs import PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class RequestOutputCollector:
    """The newest output of one request, until its consumer takes it. A DELTA output
    not yet taken absorbs the next one, so a slow consumer gets fewer, larger deltas
    and loses nothing; other kinds keep only the newest of each of the n samples."""

    def __init__(self, output_kind: RequestOutputKind):
        self.output_kind = output_kind
        self._pending: RequestOutput | Exception | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        pending = self._pending
        if isinstance(pending, RequestOutput) and isinstance(item, RequestOutput):
            pending.add(item, aggregate=self.output_kind == RequestOutputKind.DELTA)
        elif not isinstance(pending, Exception):
            self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._pending is None:
            await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, Exception):
            raise item
        return item


class AsyncLLM(FrontEnd):
    def __init__(self, engine_core: AsyncMPClient):
        super().__init__(engine_core)
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._output_handler: asyncio.Task | None = None
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, show_progress: bool = True) -> "AsyncLLM":
        """Resolve `args` into a Config here and start the engine core process (always a process
        of its own, whatever enable_multiprocessing says), or one per data-parallel replica;
        blocks until it has warmed up."""
        replicas = data_parallel(args)
        config = args.create_config()
        if replicas:
            from jaxllm.engine.dp_client import DPAsyncClient
            return cls(DPAsyncClient(config, args.distributed_executor_backend == "ray", show_progress))
        return cls(AsyncMPClient(config, show_progress))

    @property
    def errored(self) -> bool:
        """True once the engine core has died (no request can be served again)."""
        return self._dead is not None or self.engine_core.dead

    def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                 lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """This request's outputs as the engine makes them, per `sampling_params.output_kind`
        (FINAL_ONLY: one). A bad request raises ValueError or TypeError before any output.
        With n > 1, a streamed output holds the samples that changed since the last one
        taken (each CompletionOutput's index says which); FINAL_ONLY's holds all n.
        lora_request: the LoRA adapter it runs on (an engine with enable_lora)."""
        return self._outputs(request_id, prompt, sampling_params, lora_request)

    def encode(self, prompt: PromptType, pooling_params: PoolingParams,
               request_id: str) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request's one output (vLLM's AsyncLLM.encode), on an engine started with
        runner="pooling". A bad request raises ValueError or TypeError before it."""
        return self._outputs(request_id, prompt, pooling_params)

    async def _outputs(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                       lora_request: LoRARequest | None = None):
        """A request's outputs until its last; leaving early aborts it."""
        collector = self._add_request(request_id, prompt, params, lora_request)
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished and not self.errored:
                self._abort([request_id])

    def _add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                     lora_request: LoRARequest | None = None) -> RequestOutputCollector:
        if self._dead is not None:
            raise self._dead
        requests = self._make_requests(request_id, prompt, params, lora_request)
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
        collector = self._collectors[request_id] = RequestOutputCollector(kind)
        try:
            for request in requests:
                self.engine_core.add_request(request)
        except EngineDeadError:
            self._forget([request_id])
            del self._collectors[request_id]
            raise
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(self._handle_outputs())
        return collector

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort one request id or several: each generate call still iterating gets a last output
        with finish_reason "abort" (what it had not yet taken) and ends."""
        self._abort(request_id, final_outputs=True)

    def _abort(self, request_ids, final_outputs: bool = False) -> None:
        finals = [] if final_outputs else None
        core_ids = self._forget(request_ids, finals)
        for out in finals or ():
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self._collectors.pop(request_id, None)
        try:
            self.engine_core.abort_requests(core_ids)
        except EngineDeadError:
            pass  # nothing left to abort

    async def _handle_outputs(self) -> None:
        """The one task that moves the core's outputs to the requests' collectors."""
        try:
            while True:
                core_outputs = await self.engine_core.get_output_async()
                for out in self._process(core_outputs):
                    collector = self._collectors.get(out.request_id)
                    if collector is not None:
                        collector.put(out)
                    if out.finished:
                        self._collectors.pop(out.request_id, None)
                # A core that runs ahead leaves many steps queued, and a get from a non-empty
                # queue never yields: without this, the consumers (a server's streams, its
                # disconnect checks) would wait until the whole backlog was processed.
                await asyncio.sleep(0)
        except Exception as e:
            if not isinstance(e, EngineDeadError):
                logger.exception("AsyncLLM's output handler failed")
            self._dead = e if isinstance(e, EngineDeadError) else EngineDeadError(f"output handler failed: {e}")
            for collector in self._collectors.values():
                collector.put(self._dead)
            self._collectors.clear()

    async def get_stats(self) -> dict:
        """The core's counters: KV blocks (total, free), requests, preemptions, compilations."""
        if self._dead is not None:
            raise self._dead
        return await self.engine_core.call_utility_async("get_stats")

    async def reset_prefix_cache(self) -> bool:
        """As LLMEngine.reset_prefix_cache."""
        if self._dead is not None:
            raise self._dead
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    # ---- LoRA adapters: as LLMEngine's ----
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        self.lora_checks.check(lora_request)
        return await self.engine_core.call_utility_async("add_lora", *lora_request_fields(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.engine_core.call_utility_async("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return set(await self.engine_core.call_utility_async("list_loras"))

    # ---- inside a training loop (docs/jax.md); the core is in a process of its own ----
    async def pause_generation(self, mode: str = "wait") -> None:
        """Admit no request until resume_generation (new ones wait): "wait" returns once the
        running requests have finished, "abort" ends every unfinished one (finish_reason
        "abort"), "keep" sends the running ones back to waiting, to go on after resume."""
        await self.engine_core.call_utility_async("pause", mode)
        while mode == "wait" and (await self.get_stats())["num_running"]:
            await asyncio.sleep(0.01)

    async def resume_generation(self) -> None:
        await self.engine_core.call_utility_async("resume")

    async def update_weights(self, path: str) -> None:
        """New weights from a checkpoint's path (an HF folder, a .gguf file or an orbax folder: device
        arrays do not cross to the core's process), without a restart; see LLMEngine.update_weights."""
        if not isinstance(path, str):
            raise TypeError("AsyncLLM.update_weights takes a checkpoint's path: its engine core runs in a "
                            "process of its own; for params in memory use LLM(params=..., mesh=...)")
        await self.engine_core.call_utility_async("update_weights", path)

    async def sleep(self, level: int = 1) -> None:
        await self.engine_core.call_utility_async("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.engine_core.call_utility_async("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self.engine_core.call_utility_async("is_sleeping")

    async def collective_rpc(self, method: str, args: tuple = ()):
        return await self.engine_core.call_utility_async("collective_rpc", method, list(args))

    async def start_profile(self, log_dir: str | None = None) -> None:
        """As LLMEngine.start_profile."""
        await self.engine_core.call_utility_async("start_profile", self._profile_dir(log_dir))

    async def stop_profile(self) -> None:
        await self.engine_core.call_utility_async("stop_profile")

    def shutdown(self) -> None:
        if self._output_handler is not None and not self._output_handler.get_loop().is_closed():
            self._output_handler.cancel()
        super().shutdown()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
