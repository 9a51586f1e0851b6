"""A real `jaxllm serve` in a subprocess on 127.0.0.1, for the server tests: the tiny Llama
with a character tokenizer (text in, text out, stop strings match) and a chat template
given by --chat-template. The server and its engine core are stopped at teardown, however
the tests ended."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import _SESSION_CHILDREN, free_ports, tiny_llama_with_tokenizer

API_KEY = "test-key"
MAX_MODEL_LEN = 512  # long enough that a request outlives the disconnect of its client
MODEL_NAME = "tiny-llama"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
_START_TIMEOUT_S = 240


class RemoteServer:
    def __init__(self, model: str, log_path: str, *args: str):
        self.port = free_ports()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxllm.cli", "serve", model, "--port", str(self.port),
                                      *args], stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server did not start in {_START_TIMEOUT_S} s:\n{self.log()}")

    def log(self, max_chars: int = 5000) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-max_chars:]

    def engine_core_pid(self) -> int:
        """The engine core: the server's child process (from /proc)."""
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == self.proc.pid and fields[0] != "Z":
                    return int(entry)
        raise RuntimeError("the server has no engine core process")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_server(model: str, tmp_path_factory, name: str, *args: str, chat_template: str = CHAT_TEMPLATE) -> RemoteServer:
    template = tmp_path_factory.mktemp(name) / "chat_template.jinja"
    template.write_text(chat_template)
    server = RemoteServer(model, str(template.parent / "server.log"), "--served-model-name", MODEL_NAME,
                          "--chat-template", str(template), "--max-model-len", str(MAX_MODEL_LEN),
                          "--max-num-seqs", "32", "--max-num-batched-tokens", "128", "--block-size", "16",
                          "--num-gpu-blocks-override", "1200", "--uvicorn-log-level", "warning", *args)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def server(char_llama, tmp_path_factory):
    """One server for the tests that leave it serving (all but the engine death test)."""
    server = start_server(char_llama, tmp_path_factory, "server", "--api-key", API_KEY)
    _SESSION_CHILDREN.add(server.proc.pid)  # lives as long as the session: not a test's leftover
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(server):
    """An httpx client with the API key."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60.0) as c:
        yield c


def metric_values(text: str, name: str) -> dict[str, float]:
    """A Prometheus exposition's samples of one metric: {label text: value}."""
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            values[key[len(name):]] = float(value)
    return values


def scrape(server) -> str:
    return httpx.get(server.url + "/metrics").text


def metric(text: str, name: str, labels: str = f'{{model_name="{MODEL_NAME}"}}') -> float:
    return metric_values(text, name).get(labels, 0.0)


def wait_for_idle_engine(server, timeout_s: float = 20.0) -> str:
    """/metrics once the engine holds no request (aborts reach the core asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(server)
        busy = (metric(text, "jaxllm:num_requests_running") or metric(text, "jaxllm:num_requests_waiting")
                or metric(text, "jaxllm:kv_cache_usage_perc"))
        if not busy or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def write_byte_tokenizer(folder: str, added: tuple[str, ...] = ()) -> None:
    """A GPT-2-style byte-level tokenizer for the tiny models' 256 ids: 0-2 are <unk>, <s>,
    </s>, every other id one byte (all but 0xF5-0xF7, which UTF-8 never uses). Unlike the
    character tokenizer, llguidance can read it, so structured outputs work. `added`: tokens
    of their own in the last ids (not special: they stay in the text), in place of more
    bytes UTF-8 never uses (0xF8 on); byte b < 0xF5 is token b + 3 either way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    # GPT-2's bytes-to-characters table: printable bytes stand for themselves, the rest for chr(256 + k).
    others = [b for b in range(256) if b not in printable]
    char_of = {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(others)}}
    kept = [b for b in range(256) if b not in (0xF5, 0xF6, 0xF7) and not 0xF8 <= b < 0xF8 + len(added)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{char_of[b]: i + 3 for i, b in enumerate(kept)}}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.add_tokens(list(added))
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>"}, f)


@pytest.fixture(scope="session")
def byte_llama(tmp_path_factory) -> str:
    """The tiny Llama with a byte-level tokenizer."""
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("byte_llama"), write_byte_tokenizer)


THINK_END_ID = 255  # </think> in think_llama's vocabulary (<think> is 254)


@pytest.fixture(scope="session")
def think_llama(tmp_path_factory) -> str:
    """The tiny Llama with the byte-level tokenizer and <think>, </think> as tokens: a reasoning model's."""
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("think_llama"),
                                     lambda folder: write_byte_tokenizer(folder, ("<think>", "</think>")))


class StreamsInFlight:
    """Well-formed greedy streams, one after another in a thread, while a test sends other
    requests: each must end with [DONE] and the text the same request gets alone."""

    def __init__(self, server, headers: dict | None = None, max_tokens: int = 48):
        self.url, self.headers = server.url + "/v1/completions", headers or {}
        self.body = {"model": MODEL_NAME, "prompt": "in flight", "max_tokens": max_tokens, "temperature": 0.0,
                     "ignore_eos": True}
        r = httpx.post(self.url, json=self.body, headers=self.headers, timeout=60.0)
        assert r.status_code == 200, r.text
        self.expected = r.json()["choices"][0]["text"]
        self.results: list[tuple[str, str | None, bool]] = []  # (text, finish_reason, ended with [DONE])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "StreamsInFlight":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        with httpx.Client(headers=self.headers, timeout=60.0) as client:
            while not self._stop.is_set():
                text, finish, done = "", None, False
                with client.stream("POST", self.url, json={**self.body, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            for choice in json.loads(line[6:]).get("choices", ()):
                                text += choice["text"]
                                finish = choice["finish_reason"] or finish
                self.results.append((text, finish, done))

    def assert_all_normal(self) -> None:
        """Once the last stream has ended."""
        self.stop()
        assert not self._thread.is_alive(), "a stream in flight did not finish"
        assert self.results, "no stream finished meanwhile"
        assert self.results == [(self.expected, "length", True)] * len(self.results)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded SmolLM2's tokenizer, alone: a real BPE that splits tags such as <tool_call> into pieces."""
    from jaxllm.models.gguf import find_default_model, load_gguf_tokenizer
    return load_gguf_tokenizer(find_default_model())


def token_pieces(tokenizer, text: str) -> list[str]:
    """`text` as a detokenizer gives it, token by token (a token ending inside a character waits)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, sent = [], ""
    for i in range(len(ids)):
        decoded = tokenizer.decode(ids[:i + 1])
        if not decoded.endswith("\ufffd"):
            pieces.append(decoded[len(sent):])
            sent = decoded
    assert sent == text
    return pieces
