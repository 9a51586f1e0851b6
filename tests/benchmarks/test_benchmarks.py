"""`jaxllm bench throughput` and `jaxllm bench latency` on the tiny Llama:
each runs through the CLI and writes vLLM's JSON keys, with values that agree; the
random dataset's shared prefix (--prefix-len) in both throughput benches, and
the device's idle share over a profiled throughput run (--profile-dir)."""
import contextlib
import io
import json
import math

import numpy as np
import pytest

from jaxllm.benchmarks.common import random_lengths, random_prompt, random_token_prompts
from jaxllm.benchmarks.serve import random_requests
from jaxllm.cli import main
from tests.conftest import tiny_model

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("warm_up_every_engine")]
ENGINE_FLAGS = ["--model", tiny_model("llama"), "--skip-tokenizer-init", "--max-model-len", "64",
                "--no-enable-multiprocessing", "--max-num-seqs", "16"]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, RATIO = 12, 16, 8, 0.5
BATCH_SIZE, NUM_ITERS = 3, 3
# Two full blocks of 16 shared, then each prompt's own 8 tokens; one request at a time, so
# each after the first finds the prefix its predecessor left in the cache.
PREFIX_PROMPTS, PREFIX_LEN, OWN_LEN = 6, 32, 8


def run_bench(tmp_path, name: str, *flags: str) -> dict:
    path = tmp_path / f"{name}.json"
    assert main(["bench", name, *ENGINE_FLAGS, *flags, "--output-json", str(path)]) == 0
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def throughput(tmp_path_factory) -> dict:
    return run_bench(tmp_path_factory.mktemp("throughput"), "throughput", "--num-prompts", str(NUM_PROMPTS),
                     "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                     "--random-range-ratio", str(RATIO))


@pytest.fixture(scope="module")
def prefixed(tmp_path_factory) -> dict:
    return run_bench(tmp_path_factory.mktemp("prefixed"), "throughput", "--num-prompts", str(PREFIX_PROMPTS),
                     "--prefix-len", str(PREFIX_LEN), "--input-len", str(OWN_LEN), "--output-len", "4",
                     "--max-num-seqs", "1", "--block-size", "16")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[dict, str]:
    """A throughput run under the profiler: its JSON and what it printed."""
    tmp = tmp_path_factory.mktemp("profiled")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        result = run_bench(tmp, "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "6",
                           "--random-range-ratio", "0.5", "--profile-dir", str(tmp / "trace"))
    return result, printed.getvalue()


@pytest.fixture(scope="module")
def latency(tmp_path_factory) -> dict:
    return run_bench(tmp_path_factory.mktemp("latency"), "latency", "--batch-size", str(BATCH_SIZE),
                     "--input-len", "8", "--output-len", "12", "--num-iters-warmup", "1",
                     "--num-iters", str(NUM_ITERS))


def test_throughput_json_has_vllms_keys_and_they_agree(throughput):
    r = throughput
    assert r["num_requests"] == NUM_PROMPTS
    assert r["total_num_tokens"] == sum(r["prompt_lens"]) + sum(r["output_lens"])
    assert r["total_num_tokens"] == r["total_prompt_tokens"] + r["total_output_tokens"]
    assert r["elapsed_time"] > 0
    assert math.isclose(r["requests_per_second"] * r["elapsed_time"], r["num_requests"], rel_tol=1e-9)
    assert math.isclose(r["tokens_per_second"] * r["elapsed_time"], r["total_num_tokens"], rel_tol=1e-9)
    assert math.isclose(r["output_tokens_per_second"] * r["elapsed_time"], sum(r["output_lens"]), rel_tol=1e-9)
    assert r["all_lengths_ok"]


def test_throughput_records_the_engine_settings_it_ran(throughput):
    engine = throughput["engine"]
    assert engine["model"] == tiny_model("llama") and engine["max_model_len"] == 64
    assert {"dtype", "max_num_seqs", "max_num_batched_tokens", "block_size", "attention_backend",
            "async_scheduling", "kv_cache"} <= engine.keys()


def test_throughput_compiles_nothing_in_the_timed_run(throughput):
    assert throughput["compiles_after_warm_up"] == 0


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_throughput_counts_the_preemptions_each_capacity_policy_makes(tmp_path, policy):
    # 16 blocks of 16 tokens for 16 requests of 16 + 32: about a third of them fit to the end.
    r = run_bench(tmp_path, "throughput", "--num-prompts", "16", "--input-len", "16", "--output-len", "32",
                  "--num-gpu-blocks-override", "16", "--block-size", "16", "--capacity-scheduler-policy", policy)
    assert r["engine"]["capacity_scheduler_policy"] == policy and r["all_lengths_ok"]
    assert (r["num_preemptions"] > 0) == (policy == "max_utilization")


def test_random_range_ratio_spreads_lengths_within_vllms_bounds(throughput):
    # 16 and 8 with r=0.5: prompts in [8, 24], outputs in [4, 12], both ends included.
    prompt_lens, output_lens = throughput["prompt_lens"], throughput["output_lens"]
    assert len(prompt_lens) == len(output_lens) == NUM_PROMPTS
    assert all(8 <= n <= 24 for n in prompt_lens) and all(4 <= n <= 12 for n in output_lens)
    assert len(set(prompt_lens)) > 1 and len(set(output_lens)) > 1


def test_random_lengths_reach_both_ends_and_no_further():
    prompt_lens, output_lens = random_lengths(2000, 10, 4, 0.5, np.random.default_rng(0))
    assert set(prompt_lens) == set(range(5, 16)) and set(output_lens) == set(range(2, 7))


def test_random_range_ratio_zero_gives_fixed_lengths():
    prompt_lens, output_lens = random_lengths(50, 10, 4, 0.0, np.random.default_rng(0))
    assert set(prompt_lens) == {10} and set(output_lens) == {4}


def test_random_token_prompts_share_one_prefix_and_draw_their_own_tokens():
    prompts = random_token_prompts([3, 5, 4], 1000, np.random.default_rng(0), prefix_len=7)
    assert [len(p) for p in prompts] == [10, 12, 11]
    assert prompts[0][:7] == prompts[1][:7] == prompts[2][:7]
    assert len({tuple(p[7:10]) for p in prompts}) == 3


def test_random_token_prompts_without_a_prefix_draw_as_before():
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    assert random_token_prompts([4, 6], 50, a) == [random_prompt(n, 50, b)["prompt_token_ids"] for n in (4, 6)]


def test_bench_serve_random_requests_count_the_prefix_in_the_prompt_length():
    requests = random_requests(5, 4, 3, 0.0, 256, seed=0, prefix_len=6)
    assert [(len(p), n, m) for p, n, m in requests] == [(10, 10, 3)] * 5
    assert len({tuple(p[:6]) for p, _, _ in requests}) == 1 and len({tuple(p[6:]) for p, _, _ in requests}) > 1


def test_throughput_prefix_len_adds_to_every_prompt(prefixed):
    r = prefixed
    assert r["prefix_len"] == PREFIX_LEN and r["prompt_lens"] == [PREFIX_LEN + OWN_LEN] * PREFIX_PROMPTS
    assert r["total_prompt_tokens"] == (PREFIX_LEN + OWN_LEN) * PREFIX_PROMPTS
    assert r["all_lengths_ok"] and r["compiles_after_warm_up"] == 0
    assert 0.0 <= r["prefix_cache_hit_rate"] <= 1.0 and r["prefix_cache_hits"] <= r["prefix_cache_queries"]


def test_throughput_with_a_shared_prefix_hits_the_prefix_cache(prefixed):
    # Every request after the first finds the prefix's two full blocks: 32 of its 40 tokens.
    assert prefixed["prefix_cache_hit_rate"] > 0
    assert prefixed["prefix_cache_hits"] == PREFIX_LEN * (PREFIX_PROMPTS - 1)
    assert prefixed["prefix_cache_queries"] == (PREFIX_LEN + OWN_LEN) * PREFIX_PROMPTS


def test_a_profiled_throughput_run_reports_the_devices_idle_share(profiled):
    r, _ = profiled
    p = r["profile"]
    assert {"steps", "total_busy_ms", "total_idle_ms", "device_idle_share", "kernel_ms_per_step",
            "host_ms_per_step", "trace"} <= p.keys()
    assert p["total_busy_ms"] > 0 and p["total_idle_ms"] >= 0
    assert 0.0 <= p["device_idle_share"] <= 1.0
    assert math.isclose(p["device_idle_share"], p["total_idle_ms"] / (p["total_busy_ms"] + p["total_idle_ms"]),
                        abs_tol=1e-3)
    # The kernels' span lies inside the timed call, which the trace covers.
    assert p["total_busy_ms"] + p["total_idle_ms"] <= r["elapsed_time"] * 1e3
    assert r["all_lengths_ok"] and r["compiles_after_warm_up"] == 0


def test_a_profiled_throughput_run_counts_the_engines_steps(profiled):
    # A step gives each request in it one token: the longest request needs max(output_lens)
    # steps, and no step goes without one.
    r, _ = profiled
    assert max(r["output_lens"]) <= r["profile"]["steps"] <= sum(r["output_lens"])


def test_a_profiled_throughput_run_prints_the_idle_share(profiled):
    r, printed = profiled
    p = r["profile"]
    lines = printed.splitlines()
    throughput_line = next(i for i, line in enumerate(lines) if line.startswith("Throughput: "))
    assert lines[throughput_line + 1] == (
        f"Device idle share: {100 * p['device_idle_share']:.1f}% (busy {p['total_busy_ms'] / 1e3:.2f} s, "
        f"idle {p['total_idle_ms'] / 1e3:.2f} s over {p['steps']} steps)")


def test_a_pooling_runs_throughput_is_prompts_embedded_a_second(tmp_path):
    """--runner pooling: one LLM.embed call over the prompts, each one's vector as wide as the hidden
    states, no output tokens."""
    r = run_bench(tmp_path, "throughput", "--runner", "pooling", "--num-prompts", "6", "--input-len", "16")
    assert r["num_requests"] == 6 and r["total_output_tokens"] == 0 and r["output_tokens_per_second"] == 0
    assert r["total_prompt_tokens"] == 6 * 16 and r["all_lengths_ok"] and r["compiles_after_warm_up"] == 0
    assert math.isclose(r["requests_per_second"], 6 / r["elapsed_time"])


def test_an_unprofiled_throughput_run_has_no_profile(throughput):
    assert "profile" not in throughput and "profile_error" not in throughput


def test_latency_json_has_vllms_keys_and_they_agree(latency):
    r = latency
    assert len(r["latencies"]) == r["num_iters"] == NUM_ITERS
    assert math.isclose(r["avg_latency"], float(np.mean(r["latencies"])))
    assert math.isclose(r["std_latency"], float(np.std(r["latencies"])))
    assert list(r["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    values = list(r["percentiles"].values())
    assert values == sorted(values) and min(r["latencies"]) <= values[0] <= values[-1] <= max(r["latencies"])
    assert r["all_lengths_ok"]


def test_latency_decode_step_fits_inside_the_batch_latency(latency):
    # 11 decode steps after the first token, all inside one generate call (measured apart, on a
    # machine that may be busy: within a factor of two, which still catches a unit off by 1000).
    assert 0 < latency["decode_step_ms"] * 11 / 1e3 < 2 * min(latency["latencies"])
    assert math.isclose(latency["decode_tok_s"], BATCH_SIZE / latency["decode_step_ms"] * 1e3)


def test_latency_compiles_nothing_after_warm_up(latency):
    assert latency["compiles_after_warm_up"] == 0
    assert latency["engine"]["max_num_seqs"] >= BATCH_SIZE


@pytest.mark.parametrize("flags, message", [
    (["--random-range-ratio", "1"], "argument --random-range-ratio: must be in [0, 1), got 1.0"),
    (["--num-prompts", "0"], "argument --num-prompts: must be >= 1, got 0"),
    (["--prefix-len", "-1"], "argument --prefix-len: must be >= 0, got -1"),
])
def test_a_bad_throughput_flag_is_an_argparse_error(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "throughput", *ENGINE_FLAGS, "--input-len", "8", *flags])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"jaxllm bench throughput: error: {message}\n")


def test_a_bad_latency_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "latency", *ENGINE_FLAGS, "--num-iters-warmup", "-1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith("argument --num-iters-warmup: must be >= 0, got -1\n")


def test_a_length_that_could_be_zero_fails_before_the_engine_is_built(capsys, monkeypatch):
    import jaxllm

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the lengths were checked")
    monkeypatch.setattr(jaxllm, "LLM", no_engine)
    assert main(["bench", "throughput", *ENGINE_FLAGS, "--input-len", "1", "--random-range-ratio", "0.5"]) == 2
    assert capsys.readouterr().err == ("jaxllm: error: input_len=1 with random_range_ratio=0.5 allows length 0: "
                                       "input_len * (1 - random_range_ratio) must be >= 1\n")


@pytest.mark.parametrize("bench", ["throughput", "latency"])
def test_a_request_longer_than_max_model_len_is_a_one_line_error(capsys, bench):
    assert main(["bench", bench, *ENGINE_FLAGS, "--input-len", "60", "--output-len", "8"]) == 2
    assert capsys.readouterr().err.endswith(
        "jaxllm: error: the longest request needs 68 tokens (prompt + output), more than max_model_len (64)\n")


def test_bench_step_times_each_batch_with_k_draft_tokens(tmp_path):
    result = run_bench(tmp_path, "step", "--batch-sizes", "1,4", "--input-len", "8", "--output-len", "6",
                       "--draft-tokens", "0,2")
    assert [(r["batch"], r["draft_tokens"]) for r in result["rows"]] == [(1, 0), (1, 2), (4, 0), (4, 2)]
    assert all(r["all_lengths_ok"] and r["device_step_ms"] > 0 for r in result["rows"])
    assert result["compiles_after_warm_up"] == 0


def test_bench_step_random_drafts_beside_a_speculative_config_is_a_one_line_error(capsys):
    assert main(["bench", "step", *ENGINE_FLAGS, "--draft-tokens", "0,2",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']) == 2
    assert capsys.readouterr().err.endswith(
        "jaxllm: error: --draft-tokens times random drafts; with --speculative-config the step is its method's\n")
