"""Data parallelism: `data_parallel_size` engine cores, each in a process of its own on its
own `pipeline_parallel_size` x `tensor_parallel_size` GPUs (CUDA_VISIBLE_DEVICES), on this host or (with
distributed_executor_backend="ray") in Ray actors across a cluster, behind one client
with the methods of the single-core clients (core_client.py).

A new request goes to the replica with the fewest unfinished requests. Outputs of
every replica come through one queue; each carries its replica's SchedulerStats,
which the client replaces with the sum over replicas (the last stats of each), so
gauges such as running requests and KV cache usage describe the whole engine. If one
replica dies, the engine is dead. Request seeds are drawn in the front end, so a
request's output does not depend on the replica that serves it.
"""
import asyncio
import concurrent.futures
import dataclasses
import os
import queue

from jaxllm.config import Config
from jaxllm.contracts.engine_core import DP_RANK_ENV, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from jaxllm.engine.core_client import AsyncMPClient, SyncMPClient, _CoreProcess


def replica_env(rank: int, num_gpus: int) -> dict[str, str]:
    """The environment of replica `rank`: its own slice of `num_gpus` of the visible GPUs."""
    env = dict(os.environ)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range((rank + 1) * num_gpus)]
    mine = ids[rank * num_gpus:(rank + 1) * num_gpus]
    if len(mine) < num_gpus:
        raise ValueError(f"data_parallel_size x pipeline_parallel_size x tensor_parallel_size needs more GPUs than "
                         f"CUDA_VISIBLE_DEVICES lists ({visible!r})")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    env[DP_RANK_ENV] = str(rank)
    return env


def _ray_core_process(replica: Config, show_progress: bool, rank: int) -> _CoreProcess:
    """Replica `rank`'s core in a Ray actor, wherever Ray places it (engine/ray_dp.py)."""
    from jaxllm.engine.ray_dp import RayCore, front_end_address, init_ray
    init_ray()
    return _CoreProcess(replica, show_progress, tcp_host=front_end_address(), launch=lambda i, o: RayCore(
        replica, show_progress, i, o, rank))


class _DPClient:
    def __init__(self, config: Config, ray: bool, show_progress: bool, make_client):
        n, gpus = config.parallel.data_parallel_size, config.parallel.devices_per_replica
        replica = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1))
        # Start every replica, then wait for each: they warm up side by side.
        processes = []
        try:
            for rank in range(n):
                show = show_progress and rank == 0
                if ray:
                    processes.append(_ray_core_process(replica, show, rank))
                else:
                    processes.append(_CoreProcess(replica, show, replica_env(rank, gpus)))
            self.clients = [make_client(replica, process) for process in processes]
        except BaseException:
            for process in processes:
                process.close()
            raise
        self.config = config
        self.description = f"{n} data-parallel replicas; each: {self.clients[0].description}"
        self._load = [0] * n  # unfinished requests per replica
        self._replica_of: dict[str, int] = {}
        self._stats: list[SchedulerStats] = [SchedulerStats() for _ in range(n)]

    @property
    def dead(self) -> bool:
        return any(c.dead for c in self.clients)

    def add_request(self, request: EngineCoreRequest) -> None:
        replica = min(range(len(self.clients)), key=self._load.__getitem__)
        self.clients[replica].add_request(request)
        self._load[replica] += 1
        self._replica_of[request.request_id] = replica

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            replica = self._forget(request_id)
            if replica is not None:
                by_replica.setdefault(replica, []).append(request_id)
        for replica, ids in by_replica.items():
            self.clients[replica].abort_requests(ids)

    def _forget(self, request_id: str) -> int | None:
        replica = self._replica_of.pop(request_id, None)
        if replica is not None:
            self._load[replica] -= 1
        return replica

    def _merge(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Forget finished requests; the stats become the whole engine's."""
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self._forget(output.request_id)
        stats = outputs.scheduler_stats
        if stats is not None:
            self._stats[outputs.engine_index] = stats
            all_stats = self._stats
            outputs.scheduler_stats = SchedulerStats(
                sum(s.num_running_reqs for s in all_stats), sum(s.num_waiting_reqs for s in all_stats),
                sum(s.kv_cache_usage for s in all_stats) / len(all_stats), sum(s.num_preemptions for s in all_stats),
                # increments: this replica's own
                stats.prefix_cache_queries, stats.prefix_cache_hits, stats.spec_decoding, stats.expert_tokens)
        return outputs

    @staticmethod
    def _combine(method: str, results: list):
        """One answer from every replica's: counters add up, flags must all hold."""
        if method == "get_stats":
            return {key: sum(r[key] for r in results) for key in results[0]}
        if method == "reset_prefix_cache":
            return all(results)
        return results[0]

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()


# Utility calls that every replica answers; the others go to replica 0 (profiling, timing, describe).
_ALL_REPLICAS = ("get_stats", "reset_prefix_cache")


class DPSyncClient(_DPClient):
    def __init__(self, config: Config, ray: bool, show_progress: bool = True):
        self._outputs: queue.Queue = queue.Queue()
        super().__init__(config, ray, show_progress,
                         lambda replica, process: SyncMPClient(replica, show_progress, process, self._outputs))

    def get_output(self) -> EngineCoreOutputs:
        item = self._outputs.get()
        if isinstance(item, Exception):
            self._outputs.put(item)
            raise item
        return self._merge(item)

    def call_utility(self, method: str, *args):
        clients = self.clients if method in _ALL_REPLICAS else self.clients[:1]
        futures = []
        for client in clients:
            future = concurrent.futures.Future()
            client._send_utility(future, method, args)
            futures.append(future)
        return self._combine(method, [f.result() for f in futures])


class DPAsyncClient(_DPClient):
    def __init__(self, config: Config, ray: bool, show_progress: bool = True):
        super().__init__(config, ray, show_progress,
                         lambda replica, process: AsyncMPClient(replica, show_progress, process))
        self._outputs: asyncio.Queue | None = None

    def _ensure_readers(self) -> None:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
            for client in self.clients:
                client._ensure_reader(self._outputs)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_readers()
        item = await self._outputs.get()
        if isinstance(item, Exception):
            self._outputs.put_nowait(item)
            raise item
        return self._merge(item)

    async def call_utility_async(self, method: str, *args):
        self._ensure_readers()
        clients = self.clients if method in _ALL_REPLICAS else self.clients[:1]
        results = await asyncio.gather(*(c.call_utility_async(method, *args) for c in clients))
        return self._combine(method, list(results))
