"""EngineCore: one step is schedule -> run the model -> update the requests."""
import logging

from jaxllm.config import Config
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import EngineCoreOutput, Scheduler
from jaxllm.request import Request, RequestStatus
from jaxllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: Config, show_progress: bool = True):
        self.config = config
        self.runner = ModelRunner(config)
        self.runner.warm_up(show_progress)
        logger.info(self.runner.describe())
        self.scheduler = Scheduler(config.scheduler, KVCacheManager(self.runner.num_blocks, config.cache.block_size))

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            sampled = self.runner.execute(sched)
        except Exception as e:
            # The step may have consumed the donated KV caches: every running request loses
            # its KV and ends with the error; fresh caches serve the requests still waiting.
            logger.exception("model step failed")
            ids = [r.request_id for r in self.scheduler.running]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            self.runner.reset_kv_caches()
            return [EngineCoreOutput(i, [], "error", error=f"{type(e).__name__}: {e}") for i in ids]
        return self.scheduler.update_from_output(sched, sampled)


class InprocClient:
    """EngineCoreClient that calls the core in this process (the multiprocess
    ZMQ client will implement the same four methods)."""

    def __init__(self, core: EngineCore):
        self.core = core

    def add_request(self, request: Request) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()
