"""Many clients at once: every streamed request completes with its full token count, clients
that go away mid-request are aborted in the engine, and /metrics counts all of it and shows
the KV cache empty afterwards."""
import asyncio
import json
import time

import aiohttp
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, metric, scrape, wait_for_idle_engine

pytestmark = pytest.mark.timeout(300)

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def success(text: str, reason: str) -> float:
    return metric(text, "jaxllm:request_success_total", f'{{finished_reason="{reason}",model_name="{MODEL_NAME}"}}')


async def stream_completion(session, url: str, body: dict) -> dict:
    """A streamed completion's text, finish reason and usage (read from its SSE lines)."""
    got = {"text": "", "finish_reason": None, "usage": None, "error": None}
    async with session.post(url + "/v1/completions", json=body, headers=HEADERS) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            got["error"] = chunk.get("error") or got["error"]
            got["usage"] = chunk.get("usage") or got["usage"]
            for choice in chunk.get("choices", ()):
                got["text"] += choice["text"]
                got["finish_reason"] = choice["finish_reason"] or got["finish_reason"]
    return got


def test_1000_concurrent_streams_complete_and_metrics_count_them(server):
    num_requests, max_tokens = 1000, 3
    prompts = [[3 + (i * 7 + j) % 250 for j in range(1 + i % 4)] for i in range(num_requests)]
    before = wait_for_idle_engine(server)

    async def run():
        connector = aiohttp.TCPConnector(limit=num_requests)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=240)) as session:
            bodies = [{"model": MODEL_NAME, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                      for p in prompts]
            return await asyncio.gather(*(stream_completion(session, server.url, b) for b in bodies))

    results = asyncio.run(run())
    assert [r["error"] for r in results] == [None] * num_requests
    assert all(r["finish_reason"] == "length" for r in results)
    assert all(r["usage"]["completion_tokens"] == max_tokens for r in results)
    assert [r["usage"]["prompt_tokens"] for r in results] == [len(p) for p in prompts]

    after = wait_for_idle_engine(server)
    assert metric(after, "jaxllm:num_requests_running") == 0 and metric(after, "jaxllm:num_requests_waiting") == 0
    assert metric(after, "jaxllm:kv_cache_usage_perc") == 0.0
    assert success(after, "length") - success(before, "length") == num_requests
    generated = metric(after, "jaxllm:generation_tokens_total") - metric(before, "jaxllm:generation_tokens_total")
    assert generated == num_requests * max_tokens
    prompted = metric(after, "jaxllm:prompt_tokens_total") - metric(before, "jaxllm:prompt_tokens_total")
    assert prompted == sum(map(len, prompts))
    ttfts = (metric(after, "jaxllm:time_to_first_token_seconds_count")
             - metric(before, "jaxllm:time_to_first_token_seconds_count"))
    e2es = (metric(after, "jaxllm:e2e_request_latency_seconds_count")
            - metric(before, "jaxllm:e2e_request_latency_seconds_count"))
    itls = (metric(after, "jaxllm:inter_token_latency_seconds_count")
            - metric(before, "jaxllm:inter_token_latency_seconds_count"))
    assert ttfts == e2es == num_requests and itls == num_requests * (max_tokens - 1)
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds"):
        count = metric(after, f"jaxllm:{name}_count") - metric(before, f"jaxllm:{name}_count")
        assert count == num_requests, name


async def open_request(port: int, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A POST /v1/completions on a bare connection, which the test can drop at any byte."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (API_KEY.encode(), len(payload),
                                                                                 payload))
    await writer.drain()
    return reader, writer


def drop(writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()  # at once, as a client that crashed or lost its network


def test_clients_that_leave_mid_stream_are_aborted_in_the_engine_and_free_their_blocks(server):
    num_streams, max_tokens = 100, 400
    before = wait_for_idle_engine(server)

    async def leave_after_first_chunk(i: int) -> bytes:
        reader, writer = await open_request(server.port, {"model": MODEL_NAME, "prompt": f"leave {i}",
                                                          "max_tokens": max_tokens, "ignore_eos": True,
                                                          "stream": True})
        head = await asyncio.wait_for(reader.readuntil(b"data: "), 60)
        drop(writer)
        return head

    async def run():
        return await asyncio.gather(*(leave_after_first_chunk(i) for i in range(num_streams)))

    heads = asyncio.run(run())
    assert all(h.startswith(b"HTTP/1.1 200") for h in heads)
    after = wait_for_idle_engine(server)
    assert metric(after, "jaxllm:num_requests_running") == 0 and metric(after, "jaxllm:num_requests_waiting") == 0
    assert metric(after, "jaxllm:kv_cache_usage_perc") == 0.0  # no block leaked
    assert success(after, "abort") - success(before, "abort") == num_streams
    assert success(after, "length") == success(before, "length")
    generated = metric(after, "jaxllm:generation_tokens_total") - metric(before, "jaxllm:generation_tokens_total")
    assert generated < num_streams * max_tokens / 4  # they stopped when their clients left


def test_a_client_that_leaves_before_its_whole_response_is_aborted_in_the_engine(server):
    num_clients, n, max_tokens = 10, 8, 400
    before = wait_for_idle_engine(server)

    async def run():
        connections = [await open_request(server.port, {"model": MODEL_NAME, "prompt": f"wait {i}", "n": n,
                                                        "max_tokens": max_tokens, "ignore_eos": True})
                       for i in range(num_clients)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the engine holds them all
            text = await asyncio.to_thread(scrape, server)
            if metric(text, "jaxllm:num_requests_running") + metric(text, "jaxllm:num_requests_waiting") \
                    >= num_clients * n:
                break
            await asyncio.sleep(0.01)
        for _, writer in connections:
            drop(writer)

    asyncio.run(run())
    after = wait_for_idle_engine(server)
    assert metric(after, "jaxllm:kv_cache_usage_perc") == 0.0
    assert success(after, "abort") - success(before, "abort") == num_clients * n
    assert success(after, "length") == success(before, "length")
