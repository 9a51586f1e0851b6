"""The baselines the engine is held against: `bench bounds` (the device's ceilings measured on
the CPU at a tiny size, and the table of bounds beside measured steps, from a folder of
results) and `bench hf` (HF transformers, which needs torch: its errors without it)."""
import importlib.resources
import json
import sys

import pytest

from jaxllm.benchmarks.bounds import model_sizes, weight_bytes
from jaxllm.cli import main

LLAMA_8B = str(importlib.resources.files("jaxllm.models.configs") / "llama-3.1-8b.json")


def test_jax_ceilings_measure_the_copy_and_matmul_rates(tmp_path, capsys):
    path = tmp_path / "ceilings_jax.json"
    assert main(["bench", "bounds", "ceilings", "--copy-bytes", str(1 << 20), "--matmul-n", "64",
                 "--output-json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["framework"] == "jax" and result["device"] == "cpu"
    assert result["copy_Bps"] > 0 and result["matmul_flops"] > 0
    assert capsys.readouterr().out.startswith("jax: copy ")


def test_torch_ceilings_skip_without_a_gpu(tmp_path, capsys):
    path = tmp_path / "ceilings_torch.json"
    assert main(["bench", "bounds", "ceilings", "--framework", "torch", "--output-json", str(path)]) == 0
    assert capsys.readouterr().out == "torch ceilings SKIPPED: no torch with a GPU here\n"
    assert not path.exists()


def test_the_8b_decode_step_reads_15_gb_of_weights_and_128_kib_of_kv_per_token():
    sizes = model_sizes(LLAMA_8B, dtype_bytes=2)
    assert round(weight_bytes(sizes, 1) / 1e9, 2) == round(weight_bytes(sizes, 256) / 1e9, 2) == 15.01
    assert sizes["kv_bytes_per_token"] == 128 * 1024


def test_a_mixture_of_experts_step_reads_the_experts_its_tokens_choose():
    # Qwen3-30B-A3B: 48 layers of 128 experts, 8 a token, each 3 * 2048 * 768 params.
    sizes = model_sizes("qwen3-30b-a3b", dtype_bytes=2)
    experts = 48 * 128 * 3 * 2048 * 768 * 2
    assert sizes["expert_weight_bytes"] == experts
    assert weight_bytes(sizes, 1) == sizes["dense_weight_bytes"] + experts * 8 / 128
    assert weight_bytes(sizes, 256) > sizes["dense_weight_bytes"] + 0.99 * experts
    # About 3.3B active params a token: its 8 experts, attention and the LM head.
    assert 3.0e9 < sizes["matmul_params"] < 3.5e9


def test_latent_attention_reads_one_latent_a_token_and_mamba_its_states():
    v2_lite = model_sizes("deepseek-v2-lite", dtype_bytes=2)
    assert v2_lite["kv_bytes_per_token"] == 27 * (512 + 64) * 2
    mamba = model_sizes("mamba2-2.7b", dtype_bytes=2)
    assert mamba["kv_bytes_per_token"] == 0 and mamba["attention_flops_per_context_token"] == 0
    assert mamba["state_bytes_per_sequence"] > 0 and mamba["expert_weight_bytes"] == 0


def write(folder, name: str, result: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(result))


def test_the_bounds_table_sets_each_measured_step_beside_its_bounds(tmp_path, capsys):
    # The faster of each: 4 TB/s (torch) and 500 TFLOP/s (JAX); jaxllm at batch 1 and 64, HF at 1 and 256.
    write(tmp_path, "ceilings_jax", {"device": "H200", "copy_Bps": 2e12, "matmul_flops": 5e14})
    write(tmp_path, "ceilings_torch", {"device": "H200", "copy_Bps": 4e12, "matmul_flops": 4e14})
    write(tmp_path, "step", {"model": "llama-3.1-8b", "dtype": "bfloat16", "attention_backend": "mosaic",
                             "startup_s": 50.0, "compiles_after_warm_up": 0, "rows": [
                                 {"batch": 1, "decode_step_ms": 5.0, "device_step_ms": 4.9, "decode_tok_s": 200.0,
                                  "all_lengths_ok": True},
                                 {"batch": 64, "decode_step_ms": 6.4, "device_step_ms": 6.3, "decode_tok_s": 10000.0,
                                  "all_lengths_ok": True}]})
    write(tmp_path, "hf", {"transformers": "5.17.0", "torch": "2.11.0", "compiled": True,
                           "compile_config": {"mode": "reduce-overhead"}, "skipped": [], "rows": [
                               {"batch": 1, "decode_step_ms": 8.0, "decode_tok_s": 125.0},
                               {"batch": 256, "decode_step_ms": 32.0, "decode_tok_s": 8000.0}]})
    assert main(["bench", "bounds", "table", "--dir", str(tmp_path), "--config", LLAMA_8B,
                 "--png", str(tmp_path / "plot.png")]) == 0
    printed = capsys.readouterr().out.splitlines()
    rows = [line.split(" | ") for line in printed if line.startswith("| ") and line[2].isdigit()]
    assert [r[0] for r in rows] == ["| 1", "| 64", "| 256"]
    # Batch 1 at context 192: (15.01 GB + 192 x 128 KiB) / 4 TB/s = 3.76 ms, so 266 tok/s at most.
    assert rows[0][1:6] == ["5.00", "4.90", "200", "8.00", "125"] and rows[0][6] == "266"
    assert rows[0][8] == "75" and rows[0][9] == "1.60 |"  # % of the bound, jaxllm / HF
    assert rows[2][1:4] == ["-", "-", "-"] and rows[2][9] == "- |"
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert summary["ceilings"]["copy_Bps"] == 4e12 and summary["ceilings"]["matmul_flops"] == 5e14
    assert [r["batch"] for r in summary["rows"]] == [1, 64, 256] and summary["rows"][0]["jaxllm_pct_of_bound"] == 75.2
    assert printed[-1].startswith("plot: no matplotlib here")  # the table stands without it


def test_the_bounds_table_without_ceilings_shows_the_steps_alone(tmp_path, capsys):
    assert main(["bench", "bounds", "table", "--dir", str(tmp_path), "--config", LLAMA_8B, "--batch-sizes", "1,8"]) == 0
    printed = capsys.readouterr().out
    assert "ceilings: not measured (no ceilings_*.json), so no bounds" in printed
    assert "| 1 | - | - | - | - | - | - | - | - | - |" in printed and "jaxllm bench throughput: not run" in printed


def test_bench_hf_without_torch_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError, installed or not
    assert main(["bench", "hf", "--config", LLAMA_8B, "--output-json", str(tmp_path / "hf.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("jaxllm: error: jaxllm bench hf needs torch and transformers, which jaxllm does not install")


def test_bench_hf_needs_two_output_tokens_to_time_a_step(tmp_path, capsys):
    assert main(["bench", "hf", "--config", LLAMA_8B, "--output-len", "1", "--output-json", str(tmp_path / "h")]) == 2
    assert capsys.readouterr().err.startswith("jaxllm: error: --output-len must be >= 2")


def test_bench_hf_batch_sizes_are_positive(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "hf", "--config", LLAMA_8B, "--batch-sizes", "1,0", "--output-json", "hf.json"])
    assert capsys.readouterr().err.endswith("argument --batch-sizes: must be >= 1, got 0\n")
