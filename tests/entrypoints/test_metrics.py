"""The server's prefix-cache metrics: vLLM's prefix_cache_queries and prefix_cache_hits
counters (prompt tokens) under jaxllm:, fed by the stats that come with the engine core's
outputs, and the hit rate in the periodic stats log."""
import asyncio
import logging

import httpx
import pytest

from jaxllm.contracts.engine_core import SchedulerStats, SpecDecodingStats
from jaxllm.entrypoints.openai.metrics import ServerMetrics, log_stats_periodically
from tests.entrypoints.conftest import MODEL_NAME, metric_values

pytestmark = pytest.mark.timeout(300)
LABELS = f'{{model_name="{MODEL_NAME}"}}'
QUERIES, HITS = "jaxllm:prefix_cache_queries_total", "jaxllm:prefix_cache_hits_total"


def step_stats(queries: int, hits: int, running: int = 1, preemptions: int = 0) -> SchedulerStats:
    """What one step's outputs carry: its prefix-cache increments, the gauges, the preemptions since start-up."""
    return SchedulerStats(num_running_reqs=running, kv_cache_usage=0.5, num_preemptions=preemptions,
                          prefix_cache_queries=queries, prefix_cache_hits=hits)


def counted(metrics: ServerMetrics) -> tuple[float, float]:
    text = metrics.render().decode()
    return metric_values(text, QUERIES)[LABELS], metric_values(text, HITS)[LABELS]


def test_the_counters_add_up_each_steps_increments():
    metrics = ServerMetrics(MODEL_NAME, 512)
    assert counted(metrics) == (0.0, 0.0)
    metrics.record_scheduler_stats(step_stats(100, 40))
    metrics.record_scheduler_stats(step_stats(0, 0))  # a step with nothing new counts nothing
    assert counted(metrics) == (100.0, 40.0)
    metrics.record_scheduler_stats(step_stats(150, 100))
    assert counted(metrics) == (250.0, 140.0)
    assert (metrics.total_queries, metrics.total_hits) == (250, 140)


def test_the_gauges_and_the_preemptions_follow_the_newest_stats():
    metrics = ServerMetrics(MODEL_NAME, 512)
    metrics.record_scheduler_stats(step_stats(0, 0, running=3, preemptions=2))
    metrics.record_scheduler_stats(step_stats(0, 0, running=1, preemptions=5))
    text = metrics.render().decode()
    assert metric_values(text, "jaxllm:num_requests_running")[LABELS] == 1.0
    assert metric_values(text, "jaxllm:kv_cache_usage_perc")[LABELS] == 0.5
    assert metric_values(text, "jaxllm:num_preemptions_total")[LABELS] == 5.0


def test_the_speculative_decoding_counters_add_up_each_steps_drafts(caplog):
    metrics = ServerMetrics(MODEL_NAME, 512)
    for drafts, accepted, per_pos in ((4, 6, [3, 2, 1]), (2, 1, [1, 0, 0])):
        metrics.record_scheduler_stats(SchedulerStats(spec_decoding=SpecDecodingStats(drafts, 3 * drafts, accepted,
                                                                                        per_pos)))
    metrics.record_scheduler_stats(step_stats(0, 0))  # a step without drafts
    text = metrics.render().decode()
    assert metric_values(text, "jaxllm:spec_decode_num_drafts_total")[LABELS] == 6.0
    assert metric_values(text, "jaxllm:spec_decode_num_draft_tokens_total")[LABELS] == 18.0
    assert metric_values(text, "jaxllm:spec_decode_num_accepted_tokens_total")[LABELS] == 7.0
    per_position = metric_values(text, "jaxllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert [per_position[f'{{model_name="{MODEL_NAME}",position="{p}"}}'] for p in "012"] == [4.0, 2.0, 1.0]
    done = iter([False, True])

    class Engine:
        errored = property(lambda self: next(done))

    with caplog.at_level(logging.INFO, logger="jaxllm.entrypoints.openai.metrics"):
        asyncio.run(asyncio.wait_for(log_stats_periodically(Engine(), metrics, 0.01), 10))
    assert any("Mean acceptance length: 2.17" in r.getMessage() for r in caplog.records)


def test_the_stats_log_prints_the_hit_rate_of_the_recent_lookups(caplog):
    metrics = ServerMetrics(MODEL_NAME, 512)
    # 100 looked up, 40 found; then an interval of decode alone; then 100 more, all found.
    intervals = iter([step_stats(100, 40), step_stats(0, 0), step_stats(100, 100)])

    class Engine:
        @property
        def errored(self):  # the log task checks it each interval: feed the next stats, or end it
            stats = next(intervals, None)
            if stats is not None:
                metrics.record_scheduler_stats(stats)
            return stats is None

    with caplog.at_level(logging.INFO, logger="jaxllm.entrypoints.openai.metrics"):
        asyncio.run(asyncio.wait_for(log_stats_periodically(Engine(), metrics, 0.01), 10))
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
