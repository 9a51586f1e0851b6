"""One large request does not stall the server: /health answers within 100 ms while it is
handled, a stream in flight finishes with its normal output, and what no request may carry
(a body over --max-request-body-bytes, more sequences than --max-seqs-per-request, a prompt
longer than max_model_len) is refused with a 4xx naming the field. Before, a 10 MB prompt
held /health for 11 s while it was tokenized on the event loop, and 10 MB of 1-token
prompts held it for 120 s and never got an answer."""
import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME, StreamsInFlight, start_server

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("warm_up_every_engine")]

MAX_BODY_BYTES = 12_000_000
# A blocked event loop (tokenizing a 10 MB prompt on it) stalls /health for seconds; a busy
# 2-core machine alone can delay one poll past 100 ms.
HEALTH_MS = 300


@pytest.fixture(scope="module")
def byte_server(byte_llama, tmp_path_factory):
    """The byte-level tokenizer bounds the characters of a token, so a text too long is refused
    by its length alone."""
    server = start_server(byte_llama, tmp_path_factory, "large", "--max-request-body-bytes", str(MAX_BODY_BYTES),
                          "--max-seqs-per-request", "1024")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def streams_in_flight(byte_server):
    with StreamsInFlight(byte_server) as streams:
        yield streams


# Polls /health every 10 ms until its stdin closes, then prints the latencies (ms); says
# "ready" after the first. A process of its own: a thread of the test's would wait on the
# interpreter the test's sending thread holds, and count that as the server's latency.
_POLLER = """
import json, sys, threading, time, httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies = []
with httpx.Client(timeout=30.0) as client:
    while not stop.is_set():
        start = time.perf_counter()
        assert client.get(sys.argv[1]).status_code == 200
        latencies.append((time.perf_counter() - start) * 1000)
        if len(latencies) == 1:
            print("ready", flush=True)
        time.sleep(0.01)
print(json.dumps(latencies))
"""


class HealthWatch:
    """/health polled every 10 ms by another process, for as long as the `with` block runs."""

    def __init__(self, server):
        self.url, self.latencies_ms = server.url + "/health", []

    def __enter__(self) -> "HealthWatch":
        self._poller = subprocess.Popen([sys.executable, "-c", _POLLER, self.url], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self._poller.stdout.readline() == "ready\n"
        return self

    def __exit__(self, *exc_info) -> None:
        out, _ = self._poller.communicate("", timeout=60)
        self.latencies_ms = json.loads(out)[1:]  # the first poll, before the request, opened the connection

    def assert_answered_throughout(self) -> None:
        assert len(self.latencies_ms) >= 3, f"/health answered {len(self.latencies_ms)} times"
        assert max(self.latencies_ms) < HEALTH_MS, \
            f"/health took up to {max(self.latencies_ms):.0f} ms over {len(self.latencies_ms)} polls"


def post_watched(server, body: dict, route: str = "/v1/completions", headers: dict | None = None):
    """The response to `body`, sent while /health is watched; and the seconds it took."""
    content = json.dumps(body).encode()
    with HealthWatch(server) as health:
        start = time.perf_counter()
        r = httpx.post(server.url + route, content=content, timeout=120.0,
                       headers={"content-type": "application/json", **(headers or {})})
        elapsed = time.perf_counter() - start
    health.assert_answered_throughout()
    return r, elapsed


def assert_names(r, status: int, param: str, words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_10mb_text_prompt_is_refused_by_its_length_before_it_is_tokenized(byte_server, streams_in_flight):
    r, elapsed = post_watched(byte_server, {"model": MODEL_NAME, "prompt": "x" * 10_000_000, "max_tokens": 2})
    assert_names(r, 400, "prompt", f"maximum context length is {MAX_MODEL_LEN} tokens")
    assert "10000000 characters" in r.json()["error"]["message"]
    assert elapsed < 3  # tokenizing it takes ~20 s here


def test_10mb_of_one_token_prompts_is_refused_for_their_number(byte_server, streams_in_flight):
    r, _ = post_watched(byte_server, {"model": MODEL_NAME, "prompt": [[5]] * 2_000_000, "max_tokens": 2})
    assert_names(r, 400, "prompt", "holds 2000000 prompts, more than a request may start (1024")


def test_a_10mb_token_id_prompt_is_refused_for_its_length(byte_server, streams_in_flight):
    r, _ = post_watched(byte_server, {"model": MODEL_NAME, "prompt": [5] * 3_000_000, "max_tokens": 2})
    assert_names(r, 400, "prompt", f"has 3000000 tokens, more than max_model_len ({MAX_MODEL_LEN})")


def test_10mb_of_a_field_other_than_prompt_is_refused_for_its_number_of_values(byte_server, streams_in_flight):
    r, _ = post_watched(byte_server, {"model": MODEL_NAME, "prompt": "x", "stop_token_ids": [5] * 3_000_000})
    assert_names(r, 400, "stop_token_ids", "one value too many")
    r, _ = post_watched(byte_server, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                                      "chat_template_kwargs": {"x": [{}] * 2_000_000}}, "/v1/chat/completions")
    assert_names(r, 400, "chat_template_kwargs", "one value too many")


def test_1000_prompts_in_one_request_are_served_while_health_answers(byte_server, streams_in_flight):
    r, _ = post_watched(byte_server, {"model": MODEL_NAME, "prompt": [f"prompt {i}" for i in range(1000)],
                                      "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(1000))


def test_more_sequences_than_a_request_may_start_are_refused_naming_n(byte_server, streams_in_flight):
    r = httpx.post(byte_server.url + "/v1/completions", timeout=60.0,
                   json={"model": MODEL_NAME, "prompt": ["a"] * 600, "n": 2, "max_tokens": 2})
    assert_names(r, 400, "n", "1200 sequences, more than a request may start (1024")
    r = httpx.post(byte_server.url + "/v1/chat/completions", timeout=60.0,
                   json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}], "n": 2000})
    assert_names(r, 400, "n", "more than a request may start")


def test_a_body_over_the_limit_is_a_413_as_soon_as_that_is_known(byte_server, streams_in_flight):
    too_large = json.dumps({"model": MODEL_NAME, "prompt": "x" * MAX_BODY_BYTES}).encode()
    start = time.perf_counter()
    r = httpx.post(byte_server.url + "/v1/completions", content=too_large, timeout=60.0,
                   headers={"content-type": "application/json"})
    assert_names(r, 413, None, f"larger than the server's limit of {MAX_BODY_BYTES} bytes")
    assert time.perf_counter() - start < 5

    def chunks():  # no Content-Length: refused once the chunks read pass the limit
        for i in range(0, len(too_large), 1 << 20):
            yield too_large[i:i + (1 << 20)]
    r = httpx.post(byte_server.url + "/v1/completions", content=chunks(), timeout=60.0,
                   headers={"content-type": "application/json"})
    assert_names(r, 413, None, "--max-request-body-bytes")


def test_a_text_prompt_is_tokenized_off_the_event_loop(server):
    # The character tokenizer bounds nothing (an unknown word is one token): this prompt is
    # tokenized, about 2M tokens, in a worker thread, and refused by its token count.
    r, _ = post_watched(server, {"model": MODEL_NAME, "prompt": "x" * 2_000_000, "max_tokens": 2},
                        headers={"Authorization": f"Bearer {API_KEY}"})
    assert_names(r, 400, "prompt", "the prompt has 2000000 tokens")


def test_the_streams_in_flight_meanwhile_finished_with_their_normal_output(streams_in_flight):
    streams_in_flight.assert_all_normal()
