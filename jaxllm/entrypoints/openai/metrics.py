"""The server's Prometheus metrics (vLLM's names, with a `jaxllm:` prefix) and the
periodic one-line stats log.

Everything is computed in the server's process from what the engine core's outputs carry:
the RequestOutputs (monotonic timestamps of one clock: the engine core shares the machine)
and, for the gauges, the preemptions and the prefix cache, the SchedulerStats that come
with each step's outputs (AsyncLLM.stats_listeners); a scrape asks the core nothing. The
prefix-cache counters are vLLM's prefix_cache_queries and prefix_cache_hits (prompt tokens
looked up at admission, and those the cache held), the stats' increments; so are the
speculative decoding counters (vLLM's spec_decode_*: requests' steps with drafts, draft
tokens, accepted ones, and accepted ones by position). The intervals are vLLM's:
queue = arrival .. first scheduled, prefill = first scheduled .. first token,
decode = first token .. last token, inference = first scheduled .. last token,
end-to-end = arrival .. the server saw the request finish. A mixture-of-experts model's
moe_expert_tokens counts the tokens each expert of each MoE layer took (a token once per expert
of its top k), from the stats' per-step counts, kept as one array and rendered at a scrape.
"""
import asyncio
import collections
import logging
import os
import time

import numpy as np
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily

from jaxllm.contracts.engine_core import SchedulerStats
from jaxllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

PREFIX = "jaxllm:"
LOG_STATS_INTERVAL_S = float(os.environ.get("JAXLLM_LOG_STATS_INTERVAL", "10"))
_HIT_RATE_INTERVALS = 6  # the stats log's prefix cache hit rate: over this many recent intervals with lookups

# Seconds. A decode step of a small model on an H200 takes a few ms, so ITL starts at 1 ms.
_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
_REQUEST_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0]


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets + [max_model_len]
            buckets.append(m * scale)
        scale *= 10


class ExpertTokens:
    """jaxllm:moe_expert_tokens_total{layer, expert}: a series per MoE layer (the model's layer index) and
    expert, 6,144 for Qwen3-30B-A3B's 48 layers of 128. The counts add up in one array as the stats
    come (a labelled Counter would take a lookup per series and step); a scrape renders them."""

    def __init__(self, model_name: str, moe_layers: tuple[int, ...]):
        self.model_name, self.moe_layers = model_name, moe_layers
        self.totals: np.ndarray | None = None  # [moe_layers, experts] int64

    def add(self, counts: np.ndarray) -> None:
        counts = counts.astype(np.int64)
        self.totals = counts if self.totals is None else self.totals + counts

    def collect(self):
        family = CounterMetricFamily(PREFIX + "moe_expert_tokens", "Tokens routed to each expert of each MoE layer.",
                                     labels=["model_name", "layer", "expert"])
        if self.totals is not None:
            for (i, expert), count in np.ndenumerate(self.totals):
                family.add_metric([self.model_name, str(self.moe_layers[i]), str(expert)], int(count))
        yield family


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, max_loras: int = 0, moe_layers: tuple[int, ...] = ()):
        """max_loras: with LoRA, the engine's (the lora_requests_info gauge's max_lora label); moe_layers: a
        mixture-of-experts model's MoE layers (MoeConfig.sparse_layers), for moe_expert_tokens."""
        disable_created_metrics()  # no `_created` series beside every counter and histogram
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        labels = {"model_name": model_name}
        reg = dict(registry=self.registry, labelnames=["model_name"])

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, **reg).labels(**labels)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, **reg).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, buckets=buckets, **reg).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Share of the KV cache's blocks in use (0 to 1).")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (their KV freed, to be recomputed).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                        registry=self.registry, labelnames=["model_name", "finished_reason"])
        self._model_name = model_name
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Requests' steps with draft tokens.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_decode_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their position.",
            registry=self.registry, labelnames=["model_name", "position"])
        # vLLM's, with LoRA: one series, its labels the adapters' names (comma-separated), its value when seen.
        self._lora_info = Gauge(PREFIX + "lora_requests_info", "Running and waiting LoRA adapters.",
                                registry=self.registry,
                                labelnames=["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
                                ) if max_loras else None
        self._max_loras = max_loras
        tokens = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.",
                                                   tokens)
        self.request_params_n = histogram("request_params_n", "The n request parameter.", [1, 2, 5, 10, 20])
        self.request_params_max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter.",
                                                   tokens)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between successive tokens.",
                                             _ITL_BUCKETS)
        self.time_per_output_token = histogram("request_time_per_output_token_seconds",
                                               "A request's decode time over its tokens after the first.",
                                               _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                            _REQUEST_BUCKETS)
        self.request_inference_time = histogram("request_inference_time_seconds", "First scheduled to last token.",
                                                _REQUEST_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                              _REQUEST_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds", "First token to last token.",
                                             _REQUEST_BUCKETS)
        # Plain totals for the stats log's rates.
        self.total_prompt_tokens = self.total_generation_tokens = 0
        self.total_queries = self.total_hits = 0
        self.total_drafts = self.total_accepted = 0
        self.scheduler_stats = SchedulerStats()  # the newest
        self.expert_tokens = ExpertTokens(model_name, moe_layers)
        if moe_layers:
            self.registry.register(self.expert_tokens)

    def request_success(self, finished_reason: str) -> None:
        self._request_success.labels(model_name=self._model_name, finished_reason=finished_reason).inc()

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """One step's SchedulerStats: the gauges, the preemptions (a total since start-up) and
        the prefix cache's increments."""
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions > self.scheduler_stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions - self.scheduler_stats.num_preemptions)
        self._add_prefix_cache(stats.prefix_cache_queries, stats.prefix_cache_hits)
        if (spec := stats.spec_decoding) is not None:
            self.spec_decode_num_drafts.inc(spec.num_drafts)
            self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.num_accepted_tokens_per_pos):
                self._spec_decode_per_pos.labels(model_name=self._model_name, position=str(position)).inc(count)
            self.total_drafts += spec.num_drafts
            self.total_accepted += spec.num_accepted_tokens
        if self._lora_info is not None:
            self._lora_info.clear()
            self._lora_info.labels(max_lora=str(self._max_loras),
                                   running_lora_adapters=",".join(stats.running_lora_adapters),
                                   waiting_lora_adapters=",".join(stats.waiting_lora_adapters)).set_to_current_time()
        if stats.expert_tokens is not None:
            self.expert_tokens.add(stats.expert_tokens)
        self.scheduler_stats = stats

    def _add_prefix_cache(self, queries: int, hits: int) -> None:
        if queries:
            self.prefix_cache_queries.inc(queries)
            self.total_queries += queries
        if hits:
            self.prefix_cache_hits.inc(hits)
            self.total_hits += hits

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """One request's metrics, fed each RequestOutput as the server takes it (DELTA or
    FINAL_ONLY: each output's token_ids are new tokens). Outputs that arrive merged
    (a slow consumer) spread their interval evenly over their tokens."""

    def __init__(self, metrics: ServerMetrics, n: int, max_tokens: int):
        self.metrics = metrics
        self.n, self.max_tokens = n, max_tokens
        self.num_prompt_tokens = 0
        self.num_generated = 0
        self._last_time: float | None = None
        self._out: RequestOutput | None = None
        self._finish_reasons: dict[int, str] = {}  # by sample index
        self._finished = False

    def update(self, out: RequestOutput) -> None:
        self._out = out
        for c in out.outputs:
            if c.finish_reason is not None:
                self._finish_reasons[c.index] = c.finish_reason
        self._count_tokens(out)
        if out.finished:
            self.finish()

    def _count_tokens(self, out: RequestOutput) -> None:
        num_new = sum(len(c.token_ids) for c in out.outputs)
        m = out.metrics
        if not num_new or m is None or m.last_token_time is None:
            return
        metrics = self.metrics
        metrics.generation_tokens.inc(num_new)
        metrics.total_generation_tokens += num_new
        self.num_generated += num_new
        if self._last_time is None:  # prefill done
            self.num_prompt_tokens = len(out.prompt_token_ids)
            metrics.prompt_tokens.inc(self.num_prompt_tokens)
            metrics.total_prompt_tokens += self.num_prompt_tokens
            first = m.first_token_time if m.first_token_time is not None else m.last_token_time
            metrics.time_to_first_token.observe(max(0.0, first - m.arrival_time))
            self._last_time, num_new = first, num_new - 1
        if num_new > 0:
            interval = max(0.0, m.last_token_time - self._last_time) / num_new
            for _ in range(num_new):
                metrics.inter_token_latency.observe(interval)
        self._last_time = m.last_token_time

    def reject(self) -> None:
        """The engine refused the request: it counts in no metric."""
        self._finished = True

    def finish(self, default_reason: str = "abort") -> None:
        """The request ended: each sample counts with its finish reason (`default_reason`
        for one that had none: the client went away, the engine died)."""
        if self._finished:
            return
        self._finished = True
        metrics = self.metrics
        for index in range(self.n):
            metrics.request_success(self._finish_reasons.get(index, default_reason))
        metrics.request_params_n.observe(self.n)
        metrics.request_params_max_tokens.observe(self.max_tokens)
        out = self._out
        if out is None or out.metrics is None:
            return
        m = out.metrics
        finished = getattr(m, "finished_time", None) or time.monotonic()
        metrics.e2e_request_latency.observe(max(0.0, finished - m.arrival_time))
        metrics.request_prompt_tokens.observe(len(out.prompt_token_ids))
        metrics.request_generation_tokens.observe(self.num_generated)
        scheduled = getattr(m, "first_scheduled_time", None)
        if scheduled is not None:
            metrics.request_queue_time.observe(max(0.0, scheduled - m.arrival_time))
        if m.first_token_time is None or m.last_token_time is None:
            return
        decode = max(0.0, m.last_token_time - m.first_token_time)
        metrics.request_decode_time.observe(decode)
        if self.num_generated > 1:
            metrics.time_per_output_token.observe(decode / (self.num_generated - 1))
        if scheduled is not None:
            metrics.request_prefill_time.observe(max(0.0, m.first_token_time - scheduled))
            metrics.request_inference_time.observe(max(0.0, m.last_token_time - scheduled))


async def log_stats_periodically(engine, metrics: ServerMetrics, interval_s: float = LOG_STATS_INTERVAL_S) -> None:
    """Every interval, one line of throughput and cache usage (as vLLM's LoggingStatLogger),
    from what the metrics have recorded; silent while the engine stays idle. The prefix cache
    hit rate is over the recent lookups, as vLLM's (which counts its last 1000 requests):
    here, those of the last _HIT_RATE_INTERVALS intervals that had any, so that an interval
    of decode alone still shows the rate of the prompts before it."""
    last = time.monotonic()
    last_prompt, last_generation, last_queries, last_hits = 0, 0, 0, 0
    last_drafts, last_accepted = 0, 0
    recent = collections.deque(maxlen=_HIT_RATE_INTERVALS)  # (queries, hits) of intervals with lookups
    was_idle = True
    while not engine.errored:
        await asyncio.sleep(interval_s)
        stats = metrics.scheduler_stats
        now = time.monotonic()
        elapsed, last = now - last, now
        prompt = metrics.total_prompt_tokens - last_prompt
        generation = metrics.total_generation_tokens - last_generation
        queries, hits = metrics.total_queries - last_queries, metrics.total_hits - last_hits
        last_prompt, last_generation = metrics.total_prompt_tokens, metrics.total_generation_tokens
        last_queries, last_hits = metrics.total_queries, metrics.total_hits
        if queries:
            recent.append((queries, hits))
        recent_queries = sum(q for q, _ in recent)
        hit_rate = sum(h for _, h in recent) / recent_queries if recent_queries else 0.0
        idle = not (prompt or generation or stats.num_running_reqs or stats.num_waiting_reqs)
        if idle and was_idle:
            continue
        was_idle = idle
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    prompt / elapsed, generation / elapsed, stats.num_running_reqs, stats.num_waiting_reqs,
                    100 * stats.kv_cache_usage, 100 * hit_rate)
        drafts, accepted = metrics.total_drafts - last_drafts, metrics.total_accepted - last_accepted
        last_drafts, last_accepted = metrics.total_drafts, metrics.total_accepted
        if drafts:  # vLLM's mean acceptance length: the tokens a step with drafts gives, the one after them included
            logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Drafts: %d, Accepted tokens: %d",
                        1 + accepted / drafts, drafts, accepted)
