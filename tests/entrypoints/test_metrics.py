"""The server's prefix-cache metrics: vLLM's prefix_cache_queries and prefix_cache_hits
counters (prompt tokens) under jaxllm:, fed from the engine core's stats, and the hit rate
in the periodic stats log."""
import asyncio
import logging

import httpx
import pytest

from jaxllm.contracts.engine_core import SchedulerStats
from jaxllm.entrypoints.openai.metrics import ServerMetrics, log_stats_periodically
from tests.entrypoints.conftest import MODEL_NAME, metric_values

pytestmark = pytest.mark.timeout(300)
LABELS = f'{{model_name="{MODEL_NAME}"}}'
QUERIES, HITS = "jaxllm:prefix_cache_queries_total", "jaxllm:prefix_cache_hits_total"


def core_stats(queries: int, hits: int, running: int = 1) -> dict:
    """What the core's get_stats() answers, its prefix-cache totals since start-up included."""
    return {"num_blocks": 10, "num_free_blocks": 5, "num_running": running, "num_waiting": 0,
            "num_preemptions": 0, "prefix_cache_queries": queries, "prefix_cache_hits": hits}


def counted(metrics: ServerMetrics) -> tuple[float, float]:
    text = metrics.render().decode()
    return metric_values(text, QUERIES)[LABELS], metric_values(text, HITS)[LABELS]


def test_the_counters_grow_by_the_cores_totals_since_the_last_stats():
    metrics = ServerMetrics(MODEL_NAME, 512)
    assert counted(metrics) == (0.0, 0.0)
    metrics.update_from_stats(core_stats(100, 40))
    metrics.update_from_stats(core_stats(100, 40))  # a second scrape with nothing new counts nothing
    assert counted(metrics) == (100.0, 40.0)
    metrics.update_from_stats(core_stats(250, 140))
    assert counted(metrics) == (250.0, 140.0)
    assert (metrics.total_queries, metrics.total_hits) == (250, 140)


def test_stats_without_prefix_cache_totals_leave_the_counters_at_zero():
    metrics = ServerMetrics(MODEL_NAME, 512)
    stats = core_stats(0, 0)
    del stats["prefix_cache_queries"], stats["prefix_cache_hits"]
    metrics.update_from_stats(stats)
    assert counted(metrics) == (0.0, 0.0)


def test_scheduler_stats_feed_their_increments_and_then_the_core_totals_count_no_more():
    metrics = ServerMetrics(MODEL_NAME, 512)
    metrics.record_scheduler_stats(SchedulerStats(prefix_cache_queries=64, prefix_cache_hits=48))
    metrics.record_scheduler_stats(SchedulerStats(prefix_cache_queries=16, prefix_cache_hits=0))
    metrics.update_from_stats(core_stats(80, 48))  # the same tokens, summed in the core: not again
    assert counted(metrics) == (80.0, 48.0)


def test_the_stats_log_prints_the_hit_rate_of_the_recent_lookups(caplog):
    class Engine:
        errored = False  # the log task's loop checks it first

        def __init__(self, stats):
            self._stats = iter(stats)

        async def get_stats(self):
            stats = next(self._stats, None)
            if stats is None:
                raise RuntimeError("the engine died")  # ends the log task
            return stats

    # 100 looked up, 40 found; then an interval of decode alone; then 100 more, all found.
    engine = Engine([core_stats(100, 40), core_stats(100, 40), core_stats(200, 140)])
    with caplog.at_level(logging.INFO, logger="jaxllm.entrypoints.openai.metrics"):
        asyncio.run(asyncio.wait_for(log_stats_periodically(engine, ServerMetrics(MODEL_NAME, 512), 0.01), 10))
    rates = [r.getMessage().rsplit("Prefix cache hit rate: ", 1)[1] for r in caplog.records
             if "Prefix cache hit rate" in r.getMessage()]
    assert rates == ["40.0%", "40.0%", "70.0%"]


def scrape(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=30.0).text


def test_metrics_exposes_the_prefix_cache_counters(server):
    text = scrape(server)
    for name in (QUERIES, HITS):
        assert LABELS in metric_values(text, name), f"{name} missing from /metrics"
        assert f"# TYPE {name} counter" in text
    queries, hits = metric_values(text, QUERIES)[LABELS], metric_values(text, HITS)[LABELS]
    assert 0 <= hits <= queries


def test_the_same_long_prompt_twice_hits_the_prefix_cache(server, client):
    prompt = "the metrics test's own long prompt, " * 9  # 324 characters, one token each
    before = scrape(server)
    for _ in range(2):
        r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200, r.text
    after = scrape(server)
    queries = metric_values(after, QUERIES)[LABELS] - metric_values(before, QUERIES).get(LABELS, 0.0)
    hits = metric_values(after, HITS)[LABELS] - metric_values(before, HITS).get(LABELS, 0.0)
    assert queries >= 2 * len(prompt)
    # The second request finds at least the first's full blocks of 16 but its last.
    assert hits >= 16 * (len(prompt) // 16 - 1)
