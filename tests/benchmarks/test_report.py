"""`jaxllm bench report`: the tables of scripts/gpu_run.sh's prefix, serve and multi-gpu parts,
from folders of the JSON their benches write (made up here, with the keys the benches write)."""
import json

from jaxllm.cli import main


def write(folder, name: str, result: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(result))


def table_rows(printed: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in printed.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")][1:]


def throughput(tok_s: float, **extra) -> dict:
    return {"requests_per_second": tok_s / 1000, "tokens_per_second": tok_s, "output_tokens_per_second": tok_s / 10,
            "elapsed_time": 10.0, "startup_s": 30.0, "compiles_after_warm_up": 0, "num_requests": 100,
            "all_lengths_ok": True, **extra}


def test_prefix_report_sets_the_cache_off_beside_on(tmp_path, capsys):
    write(tmp_path, "prefix_no-enable-prefix-caching", throughput(30000.0, prefix_cache_hit_rate=None))
    write(tmp_path, "prefix_enable-prefix-caching", throughput(
        120000.0, prefix_cache_hit_rate=0.5, prefix_cache_hits=1024, prefix_cache_queries=2048, prefix_len=1024,
        input_len=128, output_len=128))
    assert main(["bench", "report", "prefix", "--dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    off, on = table_rows(printed)
    assert off[0] == "off" and off[5] == "n/a" and off[2] == "30,000"
    assert on[0] == "on" and on[5] == "50.0% (1,024 of 2,048 tokens)"
    assert "on / off throughput: 4.00x" in printed


def test_prefix_report_marks_a_run_that_did_not_happen(tmp_path, capsys):
    assert main(["bench", "report", "prefix", "--dir", str(tmp_path)]) == 0
    assert [row[-1] for row in table_rows(capsys.readouterr().out)] == ["not run", "not run"]


def served(output_tok_s: float, tpot_ms: float) -> dict:
    return {"num_prompts": 4, "output_throughput": output_tok_s, "mean_ttft_ms": 30.0, "p99_ttft_ms": 40.0,
            "mean_tpot_ms": tpot_ms, "p99_tpot_ms": tpot_ms + 1, "failed": 0, "errors": ["", "timeout", "timeout"],
            "generated_texts": ["x"] * 4, "itls": [[0.01]] * 4, "ttfts": [0.03] * 4, "input_lens": [1] * 4,
            "output_lens": [1] * 4}


def test_serve_report_compares_the_server_with_the_offline_engine(tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    write(tmp_path, "offline", throughput(20000.0))
    write(tmp_path, "latency", {"decode_tok_s": 200.0, "decode_step_ms": 5.0})
    write(raw, "serve_c256", served(1980.0, 25.0))
    write(raw, "serve_c1", served(199.0, 5.2))
    assert main(["bench", "report", "serve", "--dir", str(tmp_path), "--raw-dir", str(raw)]) == 0
    printed = capsys.readouterr().out
    rows = {row[0]: row for row in table_rows(printed)}
    assert rows["served c=16"][-1] == "not run" and rows["served c=256"][2] == "1,980"
    assert "served c=256 / offline output tok/s: 0.990 (target >= 0.90)" in printed
    assert "TPOT at c=1 - offline batch-1 step: 5.20 - 5.00 = +0.20 ms (target <= 0.5 ms)" in printed
    assert "c=1 error: timeout" in printed
    kept = json.loads((tmp_path / "serve_c1.json").read_text())  # without its per-request lists
    assert "itls" not in kept and "generated_texts" not in kept and kept["distinct_errors"] == ["timeout"]


def test_multi_report_sets_each_configuration_against_tp1(tmp_path, capsys):
    write(tmp_path, "tp1-step", {"rows": [{"decode_step_ms": 4.5, "profile": {"collective_share": 0.0}}]})
    write(tmp_path, "tp2-step", {"rows": [{"decode_step_ms": 3.1, "profile": {"collective_share": 0.25}}]})
    write(tmp_path, "tp1-long", throughput(100000.0))
    write(tmp_path, "tp2-long", throughput(150000.0))
    assert main(["bench", "report", "multi", "--dir", str(tmp_path), "--configs", "tp1", "tp2:step,long"]) == 0
    printed = capsys.readouterr().out
    assert table_rows(printed) == [["tp1", "4.5", "0%", "10,000", "-", "30.0"],
                                   ["tp2", "3.1", "25%", "15,000", "-", "30.0"]]
    assert printed.splitlines()[-1] == "tp2 / tp1 throughput (1000/1000): 1.50x"
