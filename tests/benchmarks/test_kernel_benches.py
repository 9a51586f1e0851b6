"""The kernel and device microbenchmarks on the CPU, at tiny shapes: `bench attention` in the
Pallas interpreter (its check, then its timing and table), a kernel that fails the check is
not timed, `bench fp8` and `bench sampler` end to end, and `bench kv-dtype`'s variants."""
import json

import jax.numpy as jnp
import pytest

from jaxllm.benchmarks import kv_dtype, sampler
from jaxllm.cli import main

pytestmark = pytest.mark.timeout(300)
TINY_ATTENTION = ["bench", "attention", "--interpret", "--kernels", "pallas", "--sections", "decode",
                  "--decode-batches", "2", "--decode-contexts", "64"]


def run(capsys, tmp_path, argv: list[str], status: int = 0) -> tuple[dict, list[str]]:
    """The bench's JSON and the lines it printed."""
    path = tmp_path / "result.json"
    assert main([*argv, "--output-json", str(path)]) == status
    return json.loads(path.read_text()), capsys.readouterr().out.splitlines()


def test_attention_checks_the_kernel_then_times_it_and_prints_the_table_last(capsys, tmp_path):
    result, printed = run(capsys, tmp_path, TINY_ATTENTION)
    cases = ("decode b8", "mixed", "decode b64")
    assert set(result["check"]) == {f"pallas {case} splits={s}" for case in cases for s in (None, 4)}
    assert all(0 < err < 1.5e-2 for err in result["check"].values()) and result["failed_check"] == []
    [row] = result["decode"]
    assert (row["batch"], row["ctx"]) == (2, 64) and row["kv_MB"] == 2 * 64 * 8 * 128 * 2 * 2 / 1e6
    assert row["pallas"]["us"] > 0 and row["pallas"]["TBps"] == pytest.approx(row["kv_MB"] / row["pallas"]["us"])
    assert "error" in row["jax"]  # JAX's GPU kernel has no CPU path: reported, not fatal
    table = printed[printed.index("decode: TB/s of KV read, pallas / triton / jax paged_attention"):]
    assert table[1].split() == ["batch", "64"] and table[2].split()[0] == "2"
    assert printed[-1].startswith("mixed (4 x 512-token chunks")


def test_a_kernel_that_fails_the_check_is_not_timed_and_the_bench_exits_1(capsys, tmp_path, monkeypatch):
    from jaxllm.kernels import pallas_attention
    monkeypatch.setattr(pallas_attention, "paged_attention", lambda q, *args, **kwargs: jnp.zeros_like(q))
    result, printed = run(capsys, tmp_path, TINY_ATTENTION, status=1)
    assert result["failed_check"] == ["pallas"]
    assert "pallas" not in result["decode"][0]
    assert printed[-1] == "FAILED: pallas failed the correctness check, so it was not timed"


def test_attention_contexts_must_fill_whole_blocks(capsys):
    assert main(["bench", "attention", "--decode-contexts", "100"]) == 2
    assert capsys.readouterr().err == "jaxllm: error: --decode-contexts must be multiples of the block size (16)\n"


def test_an_unknown_kernel_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "attention", "--kernels", "pallas,cuda"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith("argument --kernels: 'cuda' is not one of pallas, triton, mosaic\n")


def test_fp8_checks_and_times_each_form_against_bf16(capsys, tmp_path):
    result, printed = run(capsys, tmp_path, ["bench", "fp8", "--forms", "bf16,w8a8_t", "--shapes", "64x128,128x64",
                                             "--batches", "2,16", "--iters", "2", "--repeats", "1"])
    rows = result["rows"]
    assert [(r["shape"], r["m"], r["form"]) for r in rows] == [
        (shape, m, form) for shape in ("64x128", "128x64") for m in (2, 16) for form in ("bf16", "w8a8_t")]
    for r in rows:
        assert r["ms"] > 0 and r["compile_s"] >= 0
        assert r["rel_err"] < (0.01 if r["form"] == "bf16" else 0.1)  # e4m3 keeps 3 bits of mantissa
    assert all(r["vs_bf16"] == 1.0 for r in rows if r["form"] == "bf16")
    header = printed.index(next(line for line in printed if line.split()[:3] == ["K", "x", "N"]))
    assert len(printed) - header - 1 == len(rows)


def test_a_bad_fp8_shape_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "fp8", "--shapes", "4096"])
    assert capsys.readouterr().err.endswith("argument --shapes: '4096' is not K x N, e.g. 4096x6144\n")


def test_sampler_times_every_piece_and_prints_the_table_last(capsys, tmp_path):
    result, printed = run(capsys, tmp_path, ["bench", "sampler", "--rows", "2", "--vocab", "64", "--iters", "1"])
    names = [name for name, _, _ in sampler.pieces(2, 64)]
    assert list(result["ms"]) == names and len(names) == 18
    assert (result["rows"], result["vocab"]) == (2, 64)
    assert printed[-len(names) - 1].split() == ["piece", "ms"]
    assert [line.rsplit(None, 1)[0] for line in printed[-len(names):]] == names


def test_kv_dtype_times_both_caches_under_each_launch_and_sweeps_the_8bit_one():
    variants = kv_dtype.variants(["bf16", "e4m3"])
    for dtype in ("bf16", "e4m3"):
        launches = [knobs for kernel, d, knobs in variants if kernel == "pallas" and d == dtype]
        assert {} in launches and kv_dtype.PLAIN in launches
        assert dict(kv_dtype.PLAIN, head_major=True) in launches and dict(kv_dtype.PLAIN, prefetch=True) in launches
        assert ("triton", dtype, {}) in variants
    assert all(("pallas", "e4m3", knobs) in variants for knobs in kv_dtype.SWEEP)
    assert not any(("pallas", "bf16", knobs) in variants for knobs in kv_dtype.SWEEP)


def test_kv_dtype_takes_only_its_output_flag(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "kv-dtype", "--model", "llama-3.1-8b"])
    assert "unrecognized arguments: --model llama-3.1-8b" in capsys.readouterr().err


def test_invariant_matmul_times_the_picked_and_swept_tiles_against_xla_and_checks_their_bits(capsys, tmp_path):
    result, printed = run(capsys, tmp_path, ["bench", "invariant-matmul", "--shapes", "64x32", "--rows", "2,20",
                                             "--tiles", "32x16:4:3", "--repeats", "1"])
    rows = result["rows"]
    assert [(r["m"], r["launch"], r["tiles"]) for r in rows] == [
        (m, launch, tiles) for m in (2, 20) for launch, tiles in (("picked", "16x32:4:3"), ("sweep", "32x16:4:3"))]
    assert all(r["same_bits"] and r["ms"] > 0 and r["xla_ms"] > 0 for r in rows)
    assert printed[-len(rows) - 1].split()[:3] == ["K", "x", "N"]


def test_an_invariant_matmul_launch_whose_bits_differ_exits_1(capsys, tmp_path, monkeypatch):
    from jaxllm.kernels import batch_invariant
    plain = batch_invariant.pallas_matmul
    monkeypatch.setattr(batch_invariant, "pallas_matmul", lambda x, w, t, out_dtype: plain(x, w, t, out_dtype) * (
        1 + 1e-6 * (x.shape[0] == 2)))  # rows of a 2-row call off by a rounding
    result, printed = run(capsys, tmp_path, ["bench", "invariant-matmul", "--shapes", "64x32", "--rows", "2,20",
                                             "--repeats", "1"], status=1)
    assert [r["same_bits"] for r in result["rows"]] == [False, True]
    assert printed[-1] == "bits differ: 64x32 M=2 tiles 16x32:4:3"


def test_a_bad_tile_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "invariant-matmul", "--tiles", "16x24:4:3"])
    assert "MatmulTiles.block_n must be a power of two >= 8, got 24" in capsys.readouterr().err


def test_quant_matmul_checks_then_times_both_kernels_against_xla(capsys, tmp_path):
    result, printed = run(capsys, tmp_path, ["bench", "quant-matmul", "--shapes", "128x96", "--rows", "3,40",
                                             "--group-size", "64", "--block", "32", "--repeats", "1"])
    assert result["failed"] == []
    assert [(r["m"], r["kernel"], r["tiles"]) for r in result["rows"]] == [
        (3, "w4a16", "16x32:4:3"), (3, "fp8_block", "16x32:4:3:e4m3"), (3, "fp8_block", "16x32:4:3:bfloat16"),
        (40, "w4a16", "64x32:4:3"), (40, "fp8_block", "64x32:4:3:e4m3"), (40, "fp8_block", "64x32:4:3:bfloat16")]
    assert all(r["rel_err"] < 1e-2 and r["ms"] > 0 for r in result["rows"])
    assert printed[-7].split()[:4] == ["K", "x", "N", "M"]


def test_quant_matmul_tiles_are_checked_at_the_command_line(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "quant-matmul", "--w4-tiles", "16x24:4:3"])
    assert "block_n must be a power of two" in capsys.readouterr().err


def test_moe_matmul_checks_then_times_the_grouped_gemm_against_a_dense_dot(capsys, tmp_path, monkeypatch):
    args = ["bench", "moe-matmul", "--experts", "8", "--top-k", "2", "--hidden-size", "64", "--intermediate-size",
            "32", "--tokens", "1,40", "--gather-max-rows", "8", "--repeats", "1"]
    result, printed = run(capsys, tmp_path, args)
    assert [(r["tokens"], r["rows"], r["variant"]) for r in result["rows"]] == [
        (1, 2, "ragged"), (1, 2, "pallas"), (1, 2, "fp8"), (1, 2, "fp8-pallas"), (1, 2, "dense"), (1, 2, "gather"),
        (40, 80, "ragged"), (40, 80, "pallas"), (40, 80, "fp8"), (40, 80, "fp8-pallas"), (40, 80, "dense")]
    assert all(r["us"] > 0 and (r["error"] is None) == (r["variant"] == "dense") for r in result["rows"])
    assert [r["experts_hit"] for r in result["rows"]][:6] == [2] * 6  # a token's k experts are distinct
    assert all(r["error"] < 1e-5 for r in result["rows"] if r["variant"] == "pallas")
    assert all(1e-3 < r["error"] < 0.1 for r in result["rows"] if r["variant"].startswith("fp8"))
    assert printed[-12].split()[:3] == ["T", "rows", "hit"]
    from jaxllm.benchmarks import moe_matmul
    plain = moe_matmul._gather_mlp
    monkeypatch.setattr(moe_matmul, "_gather_mlp", lambda *a: plain(*a) * 1.1)  # a path 10% off fails the check
    result, printed = run(capsys, tmp_path, args, status=1)
    assert printed[-1].startswith("wrong: T=1 gather: relative error 1.0")


def test_moe_matmul_tiles_sweeps_the_kernel_launches_per_projection(capsys, tmp_path, interpreted_mosaic):
    args = ["bench", "moe-matmul", "--experts", "8", "--top-k", "2", "--hidden-size", "64", "--intermediate-size",
            "32", "--tokens", "5", "--variants", "", "--tiles", "16x16x16x4x1,32x64x32x4x1,m64x32x32x2x1",
            "--repeats", "1"]
    result, printed = run(capsys, tmp_path, args)
    assert result["rows"] == []  # --variants "": the sweep alone
    assert [(r["projection"], r["tokens"], r["tiles"]) for r in result["tiles"]] == [
        (projection, 5, tiles) for projection in ("gate-up", "down") for tiles in ("16x16x16x4x1", "32x64x32x4x1",
                                                                                   "m64x32x32x2x1")]
    assert all(r["us"] > 0 and r["vs_dense"] > 0 for r in result["tiles"])
    assert printed[-7].split() == ["projection", "T", "tiles", "us", "TFLOP/s", "vs", "dense"]
    with pytest.raises(SystemExit):
        main(args[:-4] + ["--tiles", "64x100"])
    assert "argument --tiles: BMxBNxBKxWARPSxSTAGES or mBMxBNxBKxSTEPSxGRIDN items" in capsys.readouterr().err


def test_ssd_checks_the_pallas_scan_and_update_then_times_them(capsys, tmp_path, monkeypatch):
    """The prefill scan beside attention, then the decode update plain and in place, each Pallas
    kernel checked against plain JAX first."""
    args = ["bench", "ssd", "--lengths", "48", "--chunk-sizes", "16", "--num-heads", "4", "--head-dim", "16",
            "--state-size", "16", "--groups", "2", "--repeats", "1", "--decode-batches", "20", "--num-slots", "40",
            "--layers", "2"]
    result, printed = run(capsys, tmp_path, args)
    assert [(r["length"], r["variant"], r["chunk"]) for r in result["rows"]] == [
        (48, "attention", None), (48, "reference", 16), (48, "pallas", 16)]
    assert all(r["ms"] > 0 for r in result["rows"]) and result["rows"][2]["error"] < 1e-5
    assert [(r["batch"], r["bucket"], r["variant"]) for r in result["decode_rows"]] == [
        (20, 32, "reference"), (20, 32, "pallas")]  # 12 padding requests
    assert all(r["ms"] > 0 for r in result["decode_rows"]) and result["decode_rows"][1]["error"] < 1e-2
    assert printed[-9].split() == ["L", "variant", "chunk", "ms", "Mtok/s", "vs", "attn"]
    assert printed[-3].split() == ["batch", "bucket", "variant", "ms"]
    from jaxllm.kernels import pallas_ssd
    terms, update = pallas_ssd.chunk_terms, pallas_ssd.state_update
    monkeypatch.setattr(pallas_ssd, "chunk_terms", lambda *a, **k: tuple(t * 1.1 for t in terms(*a, **k)))
    monkeypatch.setattr(pallas_ssd, "state_update", lambda x, *a, **k: update(x * 1.5, *a, **k))
    result, printed = run(capsys, tmp_path, args, status=1)
    assert printed[-2].startswith("wrong: decode batch=20 pallas: relative error")
    assert printed[-1].startswith("wrong: L=48 chunk=16 pallas: relative error")
