"""The engine core's profile: a jax.profiler trace of its steps, read back per step."""
import pytest

from jaxllm import EngineArgs, SamplingParams
from jaxllm.engine.core import EngineCore
from jaxllm.profiling import _union_ns, kernel_kind, latest_trace, summarize_trace
from tests.conftest import tiny_model

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("warm_up_every_engine")]


def test_union_counts_overlapping_intervals_once():
    assert _union_ns([(10, 11), (0, 5), (3, 8), (4, 6)]) == 9
    assert _union_ns([(0, 4), (4, 6)]) == 6


def test_kernels_are_sorted_into_kinds_by_name():
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_kind("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "gemm"
    assert kernel_kind("ragged_paged_attention_mosaic") == "attention"
    assert kernel_kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "collective"
    assert kernel_kind("loop_multiply_fusion_3") == "other"


def test_a_profiled_run_reports_every_step_and_host_phase(tmp_path):
    from jaxllm.contracts.engine_core import EngineCoreRequest
    config = EngineArgs(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=64,
                        max_num_seqs=4).create_config()
    core = EngineCore(config, show_progress=False)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(3):
        core.add_request(EngineCoreRequest(str(i), [1 + i, 2, 3], params, (), i, 0.0))
    core.start_profile(str(tmp_path))
    while core.has_work():
        core.step()
    core.stop_profile()
    core.shutdown()

    summary = summarize_trace(latest_trace(str(tmp_path)))
    assert summary["steps"] == 6  # one prefill step, then one per further token
    assert set(summary["host_ms"]) == {"schedule", "execute_model", "dispatch", "wait", "update"}
    assert summary["device_busy_ms"] > 0 and summary["device_idle_ms"] >= 0
    assert summary["kernels_per_step"] >= 1


def test_no_trace_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .*xplane.pb trace"):
        latest_trace(str(tmp_path))


def test_the_step_bench_profiles_the_middle_of_each_decode(tmp_path):
    from jaxllm.benchmarks.step import run_step_bench
    args = EngineArgs(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
                      enable_multiprocessing=False)
    result = run_step_bench(args, [1, 4], input_len=8, output_len=24, profile_dir=str(tmp_path), profile_steps=8)
    for row in result["rows"]:
        assert row["all_lengths_ok"]
        assert row["profile"]["steps"] == 8
    assert result["compiles_after_warm_up"] == 0


def test_llm_and_async_llm_profile_their_engine_core(tmp_path, monkeypatch):
    import asyncio

    from jaxllm import LLM, AsyncLLM
    args = dict(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4)
    prompt, params = {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5, ignore_eos=True)
    with LLM(**args, show_progress=False) as llm:
        llm.start_profile(str(tmp_path / "llm"))
        llm.generate([prompt] * 2, params, use_tqdm=False)
        llm.stop_profile()
    assert summarize_trace(latest_trace(str(tmp_path / "llm")))["steps"] >= 5

    async def run():
        with AsyncLLM.from_engine_args(EngineArgs(**args), show_progress=False) as engine:
            monkeypatch.setenv("JAXLLM_PROFILER_DIR", str(tmp_path / "async"))
            await engine.start_profile()
            async for _ in engine.generate(prompt, params, "r0"):
                pass
            await engine.stop_profile()
    asyncio.run(run())
    assert summarize_trace(latest_trace(str(tmp_path / "async")))["steps"] >= 5


def test_start_profile_without_a_directory_is_a_clear_error(monkeypatch):
    from jaxllm.engine.llm_engine import FrontEnd
    monkeypatch.delenv("JAXLLM_PROFILER_DIR", raising=False)
    with pytest.raises(ValueError, match="start_profile needs a log_dir"):
        FrontEnd._profile_dir(None)


def test_collective_kernels_are_told_from_the_others_by_name():
    from jaxllm.profiling import _COLLECTIVE
    for name in ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "all-reduce.3", "all_gather_fusion", "reduce-scatter"):
        assert _COLLECTIVE.search(name), name
    for name in ("fusion_12", "sm90_xmma_gemm_bf16bf16", "ragged_paged_attention", "input_reduce_fusion"):
        assert not _COLLECTIVE.search(name), name
