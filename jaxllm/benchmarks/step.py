"""`jaxllm bench step`: engine step time at fixed batch sizes (decode-dominated).

For each batch size B: B requests of `input_len` random tokens each generate
`output_len` tokens (ignore_eos). The step time is the median interval between
consecutive steps in which all B requests got a token, on the engine core's clock
(so the front end's own pace does not count). The device time is the widest step
in which all B requests decode (with their drafts), replayed back to back on the device
with no host work in between: the floor the step time would reach if the host cost nothing. With --profile-dir,
the core records a jax.profiler trace of `profile_steps` steps in the middle of the decode
(left out of the step time), and the table adds the device's busy and idle time per step in that trace (jaxllm.profiling):
idle time is the host on the critical path. `--sampling all` turns on every sampling
feature's cost at once (penalties, top-p, logprobs; with --structured-requests N, N of
each batch's requests JSON-constrained, which needs a tokenizer: `--tokenizer` for a
dummy model). `--draft-tokens 0,1,4` times the verification of speculative decoding: each
batch again with every decoding request scheduled with k random draft tokens (rejected, so
a step still gives one token each), on one engine that speculates up to the most k (in
this process), k = 0 its plain decode step. With `--speculative-config` naming a draft model
(and no `--draft-tokens`), the replayed step is the verification of its k drafts and the
draft's k steps after it. Exits 1 when a request got the wrong number of tokens or anything
compiled after warm-up.
"""
import dataclasses
import itertools
import os
import time

import numpy as np

from jaxllm.benchmarks.common import positive_int, report_failures, write_json

HELP = "engine step time at fixed batch sizes"


def batch_sizes(text: str) -> str:
    """Checks a comma-separated list of positive ints; the text stays as main splits it."""
    for size in text.split(","):
        positive_int(size)
    return text


def add_cli_args(parser) -> None:
    parser.add_argument("--batch-sizes", type=batch_sizes, default="1,64")
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--output-json", "--json", dest="json", help="also write the results to this file")
    parser.add_argument("--profile-dir", help="record a jax.profiler trace of each batch's decode here, and summarize it")
    parser.add_argument("--sampling", choices=("greedy", "all"), default="greedy",
                        help="greedy, or every feature's cost: temperature 0.8, top-p 0.9, repetition, presence and "
                             "frequency penalties, logprobs=5")
    parser.add_argument("--structured-requests", type=int, default=0,
                        help="with --sampling all: this many requests of each batch follow a JSON schema")
    parser.add_argument("--draft-tokens", type=draft_counts, default="0",
                        help="comma-separated k: each batch with k random draft tokens per decoding request")


def draft_counts(text: str) -> str:
    for k in text.split(","):
        if not k.isdigit():
            raise ValueError(f"--draft-tokens takes comma-separated ints >= 0, got {text!r}")
    return text


class RandomDrafts:
    """A proposer of k random draft tokens for every decoding request: the cost of verifying k
    drafts, which the model rejects (nearly always), so each step gives one token per request."""

    def __init__(self, k: int, vocab_size: int, seed: int = 0):
        self.k, self.vocab_size, self.rng = k, vocab_size, np.random.default_rng(seed)

    def propose(self, request, max_tokens: int) -> list[int]:
        return self.rng.integers(0, self.vocab_size, min(self.k, max_tokens)).tolist()

    def forget(self, request_id: str) -> None:
        pass


# A schema whose output a random model never finishes (strings run on): the mask is made every step.
BENCH_SCHEMA = {"type": "array", "items": {"type": "object", "required": ["name", "tags"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}}


def sampling_params(sampling: str, output_len: int, structured: bool):
    from jaxllm import RequestOutputKind, SamplingParams
    from jaxllm.sampling_params import StructuredOutputsParams
    fields = {"temperature": 0.0}
    if sampling == "all":
        fields = {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.1, "presence_penalty": 0.2,
                  "frequency_penalty": 0.2, "logprobs": 5}
        if structured:
            fields["structured_outputs"] = StructuredOutputsParams(json=BENCH_SCHEMA)
    return SamplingParams(max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA, **fields)


def run_step_bench(engine_args, batch_sizes: list[int], input_len: int, output_len: int, seed: int = 0,
                   profile_dir: str | None = None, profile_steps: int = 32, sampling: str = "greedy",
                   structured_requests: int = 0, draft_tokens: tuple[int, ...] = (0,)) -> dict:
    from jaxllm.engine.llm_engine import LLMEngine

    if max(draft_tokens):  # the core in this process, to hand its scheduler each k's proposer (a host one)
        spec = {"method": "ngram", "num_speculative_tokens": max(draft_tokens)}
        engine_args = dataclasses.replace(engine_args, enable_multiprocessing=False, async_scheduling=False,
                                          speculative_config=spec)
    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args)
    startup_s = time.perf_counter() - start
    vocab = engine.config.model.arch.vocab_size
    rng = np.random.default_rng(seed)
    compiles_before = engine.get_stats()["num_compilations"]
    rows = []
    for batch, k in itertools.product(batch_sizes, draft_tokens):
        if max(draft_tokens):
            engine.engine_core.core.scheduler.proposer = RandomDrafts(k, vocab, seed) if k else None
        for i in range(batch):
            engine.add_request(f"b{batch}-k{k}-{i}", {"prompt_token_ids": rng.integers(0, vocab, input_len).tolist()},
                               sampling_params(sampling, output_len, i < structured_requests))
        tokens: dict[str, list[int]] = {}
        full_steps = []  # core timestamps of the steps that gave every request a token
        # The trace covers `profile_steps` steps in mid-decode; the step time leaves them out.
        trace_dir = profile_dir and os.path.join(profile_dir, f"batch{batch}" + (f"-k{k}" if k else ""))
        window = range(max(1, (output_len - profile_steps) // 2), 0)
        if trace_dir:
            window = range(window.start, window.start + profile_steps)
        profiling = False
        engine.engine_core.call_utility("record_widest_step")
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            outs = engine.step()
            for out in outs:
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if len(outs) == batch:
                full_steps.append(outs[0].metrics.last_token_time)
                if trace_dir and len(full_steps) == window.start:
                    engine.engine_core.call_utility("start_profile", trace_dir)
                    profiling = True
                elif profiling and len(full_steps) == window.stop:
                    engine.engine_core.call_utility("stop_profile")
                    profiling = False
        if profiling:  # a staggered batch has fewer steps in which every request decodes
            engine.engine_core.call_utility("stop_profile")
        wall_s = time.perf_counter() - start
        # Interval k runs from full step k to k + 1 (counted from 1); the traced ones are slower.
        intervals = [b - a for k, (a, b) in enumerate(zip(full_steps, full_steps[1:]), 1)
                     if not window.start <= k <= window.stop]
        step_ms = 1e3 * float(np.median(intervals)) if intervals else float("nan")
        device_ms = 1e3 * engine.engine_core.call_utility("time_widest_step", 20)
        rows.append({
            "batch": batch, "draft_tokens": k if max(draft_tokens) else engine.config.num_speculative_tokens,
            "input_len": input_len, "output_len": output_len,
            "decode_step_ms": round(step_ms, 3), "device_step_ms": round(device_ms, 3),
            "decode_tok_s": round(batch / step_ms * 1e3, 1),
            "wall_s": round(wall_s, 3),
            "all_lengths_ok": len(tokens) == batch and all(len(t) == output_len for t in tokens.values()),
            "distinct_tokens": len({t for seq in tokens.values() for t in seq}),
        })
        if trace_dir and len(full_steps) >= window.start:
            from jaxllm.profiling import latest_trace, summarize_trace
            try:
                rows[-1]["profile"] = summarize_trace(latest_trace(trace_dir))
            except ValueError as e:  # a trace the profiler cut short: the timings still stand
                rows[-1]["profile_error"] = str(e)
    draft = engine.config.speculative and engine.config.speculative.draft
    result = {"model": engine.config.model.path, "draft_model": draft.path if draft else None,
              "dtype": str(np.dtype(engine.config.model.dtype)),
              "sampling": sampling, "structured_requests": structured_requests,
              "attention_backend": engine.config.attention_backend,
              "async_scheduling": engine.config.scheduler.async_scheduling,
              "startup_s": round(startup_s, 1), "kv_cache": engine.engine_core.description,
              "compiles_after_warm_up": engine.get_stats()["num_compilations"] - compiles_before, "rows": rows}
    engine.shutdown()
    return result


def print_table(res: dict) -> None:
    drafted = f", drafted by {res['draft_model']}" if res.get("draft_model") else ""
    print(f"\n{res['model']}{drafted} ({res['dtype']}, attention={res['attention_backend']}, "
          f"async_scheduling={res['async_scheduling']}, sampling={res['sampling']}, "
          f"structured_requests={res['structured_requests']}), startup {res['startup_s']} s, "
          f"compiles after warm-up: {res['compiles_after_warm_up']}")
    profiled = any("profile" in r for r in res["rows"])
    print(f"{'batch':>6} {'drafts':>6} {'in':>6} {'out':>5} {'step ms':>9} {'device ms':>10} {'tok/s':>9} {'wall s':>8} {'ok':>4}"
          + (f" {'busy ms':>8} {'idle ms':>8}  host ms per phase" if profiled else ""))
    for r in res["rows"]:
        line = (f"{r['batch']:>6} {r.get('draft_tokens', 0):>6} {r['input_len']:>6} {r['output_len']:>5} {r['decode_step_ms']:>9} "
                f"{r['device_step_ms']:>10} {r['decode_tok_s']!s:>9} {r['wall_s']:>8} {str(r['all_lengths_ok']):>4}")
        if "profile" in r:
            p = r["profile"]
            phases = " ".join(f"{name}={ms}" for name, ms in p["host_ms"].items())
            line += f" {p['device_busy_ms']:>8} {p['device_idle_ms']:>8}  {phases}"
        print(line)
    for r in res["rows"]:
        if r.get("profile", {}).get("top_kernels"):
            p = r["profile"]
            kinds = " ".join(f"{kind}={ms}" for kind, ms in p["kernel_ms"].items())
            print(f"\nbatch {r['batch']}: kernel ms per step by kind: {kinds}; longest-running kernels:")
            for k in p["top_kernels"]:
                print(f"  {k['ms']:>8} ms {k['per_step']:>6}x  {k['name']}")


def main(ns, engine_args) -> int:
    batch_sizes = [int(b) for b in ns.batch_sizes.split(",")]
    engine_args = dataclasses.replace(engine_args, max_num_seqs=max(engine_args.max_num_seqs or 1, *batch_sizes))
    if ns.structured_requests and ns.sampling != "all":
        raise ValueError("--structured-requests needs --sampling all")
    if ns.draft_tokens != "0" and engine_args.speculative_config:
        raise ValueError("--draft-tokens times random drafts; with --speculative-config the step is its method's")
    result = run_step_bench(engine_args, batch_sizes, ns.input_len, ns.output_len, profile_dir=ns.profile_dir,
                            sampling=ns.sampling, structured_requests=ns.structured_requests,
                            draft_tokens=tuple(int(k) for k in ns.draft_tokens.split(",")))
    write_json(ns.json, result)
    print_table(result)
    failed = [f"batch {r['batch']}: wrong output lengths" for r in result["rows"] if not r["all_lengths_ok"]]
    if result["compiles_after_warm_up"]:
        failed.append(f"{result['compiles_after_warm_up']} compilations after warm-up")
    return report_failures(failed)
