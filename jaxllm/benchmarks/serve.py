"""`jaxllm bench serve`: a running server's latency and throughput, measured as vLLM's
`vllm bench serve` measures them, over streamed /v1/completions requests.

Datasets: `random` (prompts of token ids uniform in [0, --random-vocab-size), each length
uniform in [len * (1 - r), len * (1 + r)] as in `bench throughput`, after a prefix of
--random-prefix-len random ids shared by every prompt; a token-id prompt needs no
tokenizer on either side) or `sharegpt` (a ShareGPT-format JSON file: each entry's first
turn is the prompt, the second's length, counted by the server's /tokenize, the output
length; entries that are too short or too long are skipped, as vLLM does).

Requests start at --request-rate per second (Poisson arrivals, or gamma ones with
--burstiness != 1; inf: all at once), at most --max-concurrency at a time. For each: TTFT
is the time to the first chunk holding text, ITL each gap between text chunks after it,
TPOT (latency - TTFT) / (output tokens - 1), E2EL the whole request; output tokens come from
the stream's usage chunk. Exits 1 if a request failed.

`--endpoint /v1/chat/completions` sends each prompt as one user message: a random prompt's ids
as the words "w<id>" (one token each with `python -m jaxllm.benchmarks.dummy_tokenizer word`),
counted in the prompt's length as the server's usage says after its chat template; a streamed
chunk of content, reasoning or tool-call deltas is a token's arrival. `--num-tools N` adds N
function tools to each chat request with tool_choice "auto": against the same run without them,
what tool calling costs a request (the tools' longer prompt, the server's tool parser on the
stream).
"""
import argparse
import asyncio
import json
import os
import random
import time
from datetime import datetime

import numpy as np

from jaxllm.benchmarks.common import (non_negative_int, positive_int, random_lengths, random_token_prompts,
                                      range_ratio, write_json)

HELP = "a running server's latency and throughput (vLLM's bench serve figures)"
METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_cli_args(parser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (jaxllm serve, or any "
                        "OpenAI-compatible one)")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", help="the model name to request (default: the server's first)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                        help="LoRA adapters the server serves (by their model names): each request names one "
                             "of them, chosen at random (vLLM's)")
    parser.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random")
    parser.add_argument("--dataset-path", help="the ShareGPT JSON file (for --dataset-name sharegpt)")
    parser.add_argument("--num-prompts", type=positive_int, default=1000)
    parser.add_argument("--random-input-len", type=positive_int, default=1024)
    parser.add_argument("--random-output-len", type=positive_int, default=128)
    parser.add_argument("--random-range-ratio", type=range_ratio, default=0.0)
    parser.add_argument("--random-prefix-len", "--prefix-len", type=non_negative_int, default=0,
                        help="random token ids shared by every prompt, before its own --random-input-len ones")
    parser.add_argument("--random-vocab-size", type=positive_int, default=256,
                        help="random prompts' ids are uniform in [0, this): 256 is valid for every model")
    parser.add_argument("--sharegpt-output-len", type=positive_int, default=None,
                        help="every ShareGPT request's output length (default: its answer's)")
    parser.add_argument("--request-rate", type=_positive_float, default=float("inf"),
                        help="requests per second (default inf: all at once)")
    parser.add_argument("--burstiness", type=_positive_float, default=1.0,
                        help="gamma shape of the arrivals: 1 is Poisson, < 1 burstier, > 1 steadier")
    parser.add_argument("--max-concurrency", type=positive_int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="every request generates its whole output length")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--request-timeout-s", type=_positive_float, default=6 * 3600.0)
    parser.add_argument("--num-tools", type=non_negative_int, default=0,
                        help="with the chat endpoint: this many function tools in each request, tool_choice auto")
    parser.add_argument("--output-json", help="write the results to this file")


# ---- datasets: (prompt, prompt length, output length) ----
def random_requests(num_prompts: int, input_len: int, output_len: int, ratio: float, vocab_size: int,
                    seed: int, prefix_len: int = 0) -> list[tuple[list[int], int, int]]:
    rng = np.random.default_rng(seed)
    own_lens, output_lens = random_lengths(num_prompts, input_len, output_len, ratio, rng)
    prompts = random_token_prompts(own_lens, vocab_size, rng, prefix_len)
    return [(prompt, len(prompt), m) for prompt, m in zip(prompts, output_lens)]


async def sharegpt_requests(session, base_url: str, path: str, num_prompts: int, output_len: int | None,
                            max_model_len: int, seed: int) -> list[tuple[str, int, int]]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file holds a JSON list of {{'conversations': [...]}}")
    pairs = [(d["conversations"][0]["value"], d["conversations"][1]["value"]) for d in data
             if isinstance(d, dict) and len(d.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, answer in pairs:
        if len(requests) == num_prompts:
            break
        prompt_len = len(await _tokenize(session, base_url, prompt))
        out_len = output_len or len(await _tokenize(session, base_url, answer, add_special_tokens=False))
        # vLLM's filter: too short to say anything, or longer than a typical context.
        if prompt_len < 4 or (output_len is None and out_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + out_len > min(2048, max_model_len):
            continue
        requests.append((prompt, prompt_len, out_len))
    if len(requests) < num_prompts:
        raise ValueError(f"{path} has only {len(requests)} usable conversations, fewer than --num-prompts "
                         f"{num_prompts}")
    return requests


async def _tokenize(session, base_url: str, text: str, add_special_tokens: bool = True) -> list[int]:
    async with session.post(f"{base_url}/tokenize", json={"prompt": text,
                                                          "add_special_tokens": add_special_tokens}) as r:
        body = await r.json()
        if r.status != 200:
            raise ValueError(f"{base_url}/tokenize failed ({r.status}): {body}")
        return body["tokens"]


def sample_tools(n: int) -> list[dict]:
    """n function tools of the shape agents send: a name, a description, typed parameters."""
    return [{"type": "function", "function": {
        "name": f"lookup_record_{i}", "description": f"Look up a record of table {i} by its id and return its fields.",
        "parameters": {"type": "object", "required": ["id"], "properties": {
            "id": {"type": "string", "description": "the record's id"},
            "fields": {"type": "array", "items": {"type": "string"}, "description": "the fields to return"},
            "limit": {"type": "integer", "description": "at most this many rows"}}}}} for i in range(n)]


def chat_text(prompt) -> str:
    """A prompt as a user message's text: itself, or a random prompt's ids as words "w<id>"."""
    return prompt if isinstance(prompt, str) else " ".join(f"w{i}" for i in prompt)


# ---- one request ----
async def send_request(session, url: str, headers: dict, payload: dict) -> dict:
    """Stream one completion; its timings (seconds) and what came back."""
    result = {"success": False, "ttft": 0.0, "itl": [], "latency": 0.0, "prompt_tokens": 0, "output_tokens": 0,
              "text": "", "error": ""}
    start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                result["error"] = f"HTTP {response.status}: {await response.text()}"
                return result
            chunks = 0
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                body = json.loads(data)
                if "error" in body:
                    result["error"] = body["error"].get("message", str(body["error"]))
                    return result
                if body.get("usage"):
                    result["prompt_tokens"] = body["usage"]["prompt_tokens"]
                    result["output_tokens"] = body["usage"]["completion_tokens"]
                for choice in body.get("choices", ()):
                    delta = choice.get("delta") or {}
                    text = choice.get("text") or delta.get("content") or ""
                    if not (text or delta.get("reasoning_content") or delta.get("tool_calls")):
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        result["ttft"] = now - start
                    else:
                        result["itl"].append(now - last)
                    last, chunks = now, chunks + 1
                    result["text"] += text
            result["latency"] = time.perf_counter() - start
            result["success"] = chunks > 0 or result["output_tokens"] > 0
            if not result["success"]:
                result["error"] = "the stream held no output"
    except Exception as e:  # a refused connection, a timeout, a malformed chunk
        result["error"] = f"{type(e).__name__}: {e}"
    return result


async def _arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator):
    """Yield 0..n-1, spaced by gamma intervals of mean 1 / rate (Poisson for burstiness 1)."""
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


# ---- the bench ----
def summarize(outputs: list[dict], requests, duration: float, percentiles: list[float],
              served_prompt_lens: bool = False) -> dict:
    """vLLM's figures and JSON keys. served_prompt_lens: each prompt's length is the server's count
    (a chat request's, after its template), not the dataset's."""
    if served_prompt_lens:
        requests = [(prompt, o["prompt_tokens"], m) for o, (prompt, _, m) in zip(outputs, requests)]
    done = [(o, r) for o, r in zip(outputs, requests) if o["success"]]
    output_lens = [o["output_tokens"] for o, _ in done]
    total_input = sum(r[1] for _, r in done)
    total_output = sum(output_lens)
    samples = {
        "ttft": [o["ttft"] for o, _ in done],
        "tpot": [(o["latency"] - o["ttft"]) / (o["output_tokens"] - 1) for o, _ in done if o["output_tokens"] > 1],
        "itl": [gap for o, _ in done for gap in o["itl"]],
        "e2el": [o["latency"] for o, _ in done],
    }
    result = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [r[1] for r in requests],
        "output_lens": [o["output_tokens"] for o in outputs],
        "ttfts": [o["ttft"] for o in outputs],
        "itls": [o["itl"] for o in outputs],
        "generated_texts": [o["text"] for o in outputs],
        "errors": [o["error"] for o in outputs],
    }
    for metric, values in samples.items():
        ms = np.asarray(values or [0.0]) * 1000
        result[f"mean_{metric}_ms"] = float(np.mean(ms))
        result[f"median_{metric}_ms"] = float(np.median(ms))
        result[f"std_{metric}_ms"] = float(np.std(ms))
        for p in percentiles:
            result[f"p{p:g}_{metric}_ms"] = float(np.percentile(ms, p))
    return result


async def run_serve_bench(ns) -> dict:
    import aiohttp

    chat = ns.endpoint.rstrip("/").endswith("/chat/completions")
    if ns.num_tools and not chat:
        raise ValueError(f"--num-tools needs the chat endpoint (--endpoint /v1/chat/completions), not {ns.endpoint}")
    tools = {"tools": sample_tools(ns.num_tools), "tool_choice": "auto"} if ns.num_tools else {}
    base_url = ns.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    percentiles = [float(p) for p in ns.metric_percentiles.split(",") if p.strip()]
    timeout = aiohttp.ClientTimeout(total=ns.request_timeout_s)
    # One connection per request in flight; the limit is the concurrency's (0: none).
    connector = aiohttp.TCPConnector(limit=ns.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.get(f"{base_url}/v1/models", headers=headers) as r:
            if r.status != 200:
                raise ValueError(f"{base_url}/v1/models answered {r.status}: {await r.text()}")
            cards = (await r.json())["data"]
        model = ns.model or cards[0]["id"]
        served = {card["id"] for card in cards}
        unknown = sorted(set(ns.lora_modules or ()) - served)
        if unknown:
            raise ValueError(f"--lora-modules {unknown} are not among the server's models {sorted(served)}")
        max_model_len = next((c.get("max_model_len") for c in cards if c["id"] == model), None) or 2**31
        if ns.dataset_name == "sharegpt":
            if not ns.dataset_path:
                raise ValueError("--dataset-name sharegpt needs --dataset-path")
            requests = await sharegpt_requests(session, base_url, ns.dataset_path, ns.num_prompts,
                                               ns.sharegpt_output_len, max_model_len, ns.seed)
        else:
            requests = random_requests(ns.num_prompts, ns.random_input_len, ns.random_output_len,
                                       ns.random_range_ratio, ns.random_vocab_size, ns.seed, ns.random_prefix_len)
            longest = max(n + m for _, n, m in requests)
            if longest > max_model_len:
                raise ValueError(f"the longest request needs {longest} tokens (prompt + output), more than the "
                                 f"server's max_model_len ({max_model_len})")

        url = base_url + ns.endpoint

        # Each request's model: the one asked for, or one of the adapters at random.
        names = random.Random(ns.seed).choices(ns.lora_modules, k=len(requests)) if ns.lora_modules else \
            [model] * len(requests)

        def payload(prompt, output_len: int, name: str) -> dict:
            asked = {"messages": [{"role": "user", "content": chat_text(prompt)}], **tools} if chat else \
                {"prompt": prompt}
            return {"model": name, **asked, "max_tokens": output_len, "temperature": ns.temperature,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ns.ignore_eos}

        test = await send_request(session, url, headers, payload(requests[0][0], min(requests[0][2], 4), names[0]))
        if not test["success"]:
            raise ValueError(f"the test request failed: {test['error']}")

        limit = asyncio.Semaphore(ns.max_concurrency or len(requests))
        rng = np.random.default_rng(ns.seed)

        async def one(i: int) -> dict:
            async with limit:
                prompt, _, output_len = requests[i]
                return await send_request(session, url, headers, payload(prompt, output_len, names[i]))

        start = time.perf_counter()
        tasks = [asyncio.ensure_future(one(i)) async for i in _arrivals(len(requests), ns.request_rate,
                                                                       ns.burstiness, rng)]
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "base_url": base_url,
              "endpoint": ns.endpoint, "model_id": model, "lora_modules": ns.lora_modules,
              "dataset_name": ns.dataset_name,
              "random_prefix_len": ns.random_prefix_len if ns.dataset_name == "random" else 0,
              "num_prompts": len(requests), "request_rate": ns.request_rate, "burstiness": ns.burstiness,
              "max_concurrency": ns.max_concurrency, "ignore_eos": ns.ignore_eos, "seed": ns.seed,
              "num_tools": ns.num_tools}
    result.update(summarize(outputs, requests, duration, percentiles, served_prompt_lens=chat))
    return result


def print_result(result: dict, percentiles: list[float]) -> None:
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Benchmark duration (s)", f"{result['duration']:.2f}"),
            ("Total input tokens", result["total_input_tokens"]),
            ("Total generated tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}")]
    print(f"{' Serving Benchmark Result ':=^50}")
    for name, value in rows:
        print(f"{name + ':':<40}{value:>10}")
    for metric in METRICS:
        print(f"{' ' + _METRIC_NAMES[metric] + ' ':-^50}")
        short = metric.upper()
        print(f"{f'Mean {short} (ms):':<40}{result[f'mean_{metric}_ms']:>10.2f}")
        print(f"{f'Median {short} (ms):':<40}{result[f'median_{metric}_ms']:>10.2f}")
        for p in percentiles:
            print(f"{f'P{p:g} {short} (ms):':<40}{result[f'p{p:g}_{metric}_ms']:>10.2f}")
    print("=" * 50)
    for error in sorted({e for e in result["errors"] if e})[:5]:
        print(f"error: {error}")


def main(ns) -> int:
    result = asyncio.run(run_serve_bench(ns))
    write_json(ns.output_json, result)
    print_result(result, [float(p) for p in ns.metric_percentiles.split(",") if p.strip()])
    return 1 if result["failed"] else 0
