"""SIGTERM or SIGINT of `jaxllm serve` with streams running: every stream ends cleanly (its
normal end, or an error event saying the server is shutting down, then [DONE]), the server
exits within --shutdown-timeout and the engine's own stop, the engine core process is gone,
and nothing is logged as an exception (before, 20 streams printed 20 tracebacks of
"Exception in ASGI application ... CancelledError")."""
import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.entrypoints.conftest import MODEL_NAME, start_server

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("warm_up_every_engine")]

SHUTDOWN_TIMEOUT_S = 1.0
ENGINE_STOP_S = 8.0  # the core's polite stop (it is killed after 5 s) and the interpreter's exit
NUM_STREAMS = 20


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_every_stream_cleanly_and_the_server_exits_in_bounded_time(char_llama, tmp_path_factory, sig):
    server = start_server(char_llama, tmp_path_factory, f"shutdown_{sig.name}", "--shutdown-timeout",
                          str(SHUTDOWN_TIMEOUT_S), "--uvicorn-log-level", "info")
    try:
        core = server.engine_core_pid()
        body = {"model": MODEL_NAME, "max_tokens": 500, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as client:
                started = [asyncio.Event() for _ in range(NUM_STREAMS)]

                async def stream(i: int) -> list[str]:
                    events = []
                    async with client.stream("POST", "/v1/completions",
                                             json={**body, "prompt": f"s{i}", "stream": True}) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                                started[i].set()
                    return events

                streams = [asyncio.ensure_future(stream(i)) for i in range(NUM_STREAMS)]
                whole = asyncio.ensure_future(client.post("/v1/completions", json={**body, "prompt": "w"}))
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                os.kill(server.proc.pid, sig)
                signalled = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*streams), SHUTDOWN_TIMEOUT_S + 5)
                return results, await whole, time.monotonic() - signalled

        results, whole, streams_ended_s = asyncio.run(run())
        signalled = time.monotonic() - streams_ended_s
        server.proc.wait(SHUTDOWN_TIMEOUT_S + ENGINE_STOP_S)
        exited_s = time.monotonic() - signalled
    finally:
        server.stop()
    log = server.log(max_chars=10**7)

    ended_by_shutdown = 0
    for events in results:
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:
            assert last["error"]["code"] == "server_shutdown" and "shutting down" in last["error"]["message"]
            ended_by_shutdown += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert ended_by_shutdown > 0  # 500 tokens each: they were still running
    assert whole.status_code == 200 or (whole.status_code == 503
                                        and whole.json()["error"]["code"] == "server_shutdown"), whole.text
    assert streams_ended_s < SHUTDOWN_TIMEOUT_S + 3
    assert exited_s < SHUTDOWN_TIMEOUT_S + ENGINE_STOP_S
    assert server.proc.returncode in (0, -sig)
    assert not alive(core)
    for word in ("Traceback", "Exception", "ERROR", "Cancel"):
        assert word not in log, log[-5000:]
