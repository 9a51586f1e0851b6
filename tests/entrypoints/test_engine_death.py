"""Killing the engine core under a running server: in-flight requests end with an error
(an error event in a stream, a 503 otherwise), later requests get a 503, /health fails,
and nothing hangs."""
import asyncio
import json
import os
import signal

import httpx
import pytest

from tests.entrypoints.conftest import MODEL_NAME, start_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def doomed_server(char_llama, tmp_path_factory):
    server = start_server(char_llama, tmp_path_factory, "doomed")
    try:
        yield server
    finally:
        server.stop()


def test_killing_the_engine_core_fails_requests_with_errors_and_503s(doomed_server):
    server = doomed_server
    body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 120, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as client:
            started = asyncio.Event()

            async def stream(i: int) -> list[dict]:
                events = []
                async with client.stream("POST", "/v1/completions", json={**body, "prompt": f"s{i}",
                                                                          "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            started.set()
                return events

            streams = [asyncio.ensure_future(stream(i)) for i in range(4)]
            whole = [asyncio.ensure_future(client.post("/v1/completions", json={**body, "prompt": f"w{i}"}))
                     for i in range(2)]
            await asyncio.wait_for(started.wait(), 60)
            os.kill(server.engine_core_pid(), signal.SIGKILL)
            return (await asyncio.wait_for(asyncio.gather(*streams), 10),
                    await asyncio.wait_for(asyncio.gather(*whole), 10))

    streams, whole = asyncio.run(run())
    for events in streams:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and "died" in error["message"]
    for r in whole:
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    for path, kwargs in [("/v1/completions", {"json": body}), ("/v1/completions", {"json": {**body, "stream": True}}),
                         ("/v1/chat/completions", {"json": {"model": MODEL_NAME, "max_tokens": 2,
                                                            "messages": [{"role": "user", "content": "hi"}]}})]:
        r = httpx.post(server.url + path, timeout=5.0, **kwargs)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert httpx.get(server.url + "/health", timeout=5.0).status_code == 503
    assert httpx.get(server.url + "/metrics", timeout=5.0).status_code == 200
    assert server.proc.poll() is None  # the server itself answers on, for a supervisor to restart it
