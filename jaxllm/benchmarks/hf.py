"""`jaxllm bench hf`: HF transformers' decode step on a model with random weights, the baseline
`jaxllm bench bounds table` sets beside jaxllm's. Needs torch and transformers, which jaxllm
does not install (`pip install torch`).

Its fastest plain path: `generate` with a static KV cache, whose decode forward transformers
then compiles with torch.compile (its default CompileConfig: inductor, mode "reduce-overhead",
i.e. CUDA graphs), greedy, every request running to max_new_tokens (min_new_tokens =
max_new_tokens, so EOS never stops one). Per batch size: a warm-up generate (the compile), a
second (the CUDA graphs' recording), then `--repeats` timed pairs of generates of output_len
and output_len / 2 new tokens; the step is the difference of their medians over the
difference in tokens, so the prefill and whatever else each call pays once cancel out (the
static cache attends over all of max_cache_len, so a late step costs what an early one does).
Every call sizes the cache the same (max_cache_len), so they share one compiled graph.
Each generate is checked to return every request's full length.

A batch whose estimated time would pass --budget-s is skipped; the JSON (--output-json)
is rewritten after each batch, so a run cut short keeps what it measured.
"""
import os
import statistics
import time

from jaxllm.benchmarks.common import positive_int, positive_ints, write_json

HELP = "HF transformers' decode step (static cache, torch.compile) on random weights: the baseline"


def add_cli_args(parser) -> None:
    parser.add_argument("--config", required=True, help="a config.json, or a folder holding one "
                        "(e.g. models/configs/llama-3.1-8b.json)")
    parser.add_argument("--batch-sizes", type=positive_ints, default="1,64")
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", help="default: cuda where torch has it, else cpu")
    parser.add_argument("--no-compile", action="store_true", help="eager decode (no torch.compile)")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="skip a batch that would end past this")
    parser.add_argument("--output-json", required=True)


def build_model(config_path: str, dtype, device: str):
    """LlamaForCausalLM of this config.json (a file, or a folder holding one) with transformers'
    own random initialization (normal, std = initializer_range), made directly on `device`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isdir(config_path):
        config_path = os.path.join(config_path, "config.json")
    config = LlamaConfig.from_json_file(config_path)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def timed_generate(model, input_ids, new_tokens: int, gen_kwargs: dict) -> float:
    """Seconds for one generate of `new_tokens` tokens per request; checks they all came."""
    import torch
    sync = torch.cuda.synchronize if input_ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, **gen_kwargs)  # generate runs under no_grad
    sync()
    elapsed = time.perf_counter() - start
    expected = (input_ids.shape[0], input_ids.shape[1] + new_tokens)
    if tuple(out.shape) != expected:
        raise RuntimeError(f"generate gave shape {tuple(out.shape)}, expected {expected}")
    return elapsed


def bench_batch(model, batch: int, input_len: int, output_len: int, repeats: int, gen_kwargs: dict) -> dict:
    import torch
    input_ids = torch.randint(0, model.config.vocab_size, (batch, input_len), device=model.device)
    half = output_len // 2
    first_s = timed_generate(model, input_ids, output_len, gen_kwargs)  # compiles the decode forward
    second_s = timed_generate(model, input_ids, output_len, gen_kwargs)  # CUDA graphs recorded
    timed_generate(model, input_ids, half, gen_kwargs)
    full, short = [], []
    for _ in range(repeats):
        full.append(timed_generate(model, input_ids, output_len, gen_kwargs))
        short.append(timed_generate(model, input_ids, half, gen_kwargs))
    step_s = (statistics.median(full) - statistics.median(short)) / (output_len - half)
    if step_s <= 0:
        raise RuntimeError(f"timings too noisy: {output_len} tokens took {full} s, {half} took {short} s")
    return {"batch": batch, "input_len": input_len, "output_len": output_len,
            "decode_step_ms": round(1e3 * step_s, 3), "decode_tok_s": round(batch / step_s, 1),
            f"generate_{output_len}_s": [round(t, 3) for t in full], f"generate_{half}_s": [round(t, 3) for t in short],
            "first_generate_s": round(first_s, 1), "second_generate_s": round(second_s, 2)}


def estimated_s(last: dict | None, batch: int) -> float:
    """Seconds a batch will take after `last` (the last batch's row): a new batch size compiles
    again (static shapes: about the last compile); the step grows slower than the batch (HF
    measured 7.3 ms at 1, 14.2 at 64, 35.6 at 256), so the runs' time is scaled by the square
    root of the batch ratio."""
    if last is None:
        return 0.0
    runs_s = last["batch_s"] - last["first_generate_s"]
    return last["first_generate_s"] + runs_s * max(1.0, batch / last["batch"]) ** 0.5


def main(ns) -> int:
    if ns.output_len < 2:
        raise ValueError("--output-len must be >= 2 (the step is timed from generates of output_len and "
                         "output_len / 2)")
    try:
        import torch
        import transformers
        from transformers import CompileConfig
    except ImportError as e:
        raise ValueError(f"jaxllm bench hf needs torch and transformers, which jaxllm does not install "
                         f"(pip install torch): {e}") from e
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    model = build_model(ns.config, getattr(torch, ns.dtype), device)
    num_params = sum(p.numel() for p in model.parameters())
    compile_config = CompileConfig()  # what generate uses when given none
    if device == "cpu":
        compile_config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    gen_kwargs = {"do_sample": False, "cache_implementation": "static",
                  "max_cache_len": ns.input_len + ns.output_len, "pad_token_id": 0}
    if ns.no_compile:
        gen_kwargs["disable_compile"] = True
    else:
        gen_kwargs["compile_config"] = compile_config
    result = {"transformers": transformers.__version__, "torch": torch.__version__, "device": device,
              "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "dtype": ns.dtype, "num_params": num_params, "compiled": not ns.no_compile,
              "compile_config": None if ns.no_compile else compile_config.to_dict(),
              "build_s": round(time.perf_counter() - start, 1), "rows": [], "skipped": []}
    print(f"HF {transformers.__version__} / torch {torch.__version__}: {num_params / 1e9:.2f}B parameters "
          f"({ns.dtype}) on {result['device_name']} in {result['build_s']} s", flush=True)

    write_json(ns.output_json, result)
    last = None  # the last batch's row
    for batch in ns.batch_sizes:
        left = ns.budget_s - (time.perf_counter() - start)
        need = estimated_s(last, batch)
        if need > left:
            print(f"SKIPPED HF batch {batch}: {left:.0f} s left, it needs ~{need:.0f} s", flush=True)
            result["skipped"].append(batch)
            continue
        t0 = time.perf_counter()
        try:
            row = bench_batch(model, batch, ns.input_len, ns.output_len, ns.repeats, gen_kwargs)
        except Exception as e:  # out of memory or a compile failure: the other batches still run
            print(f"FAILED HF batch {batch}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            result["skipped"].append(batch)
            continue
        row["batch_s"] = round(time.perf_counter() - t0, 1)
        last = row
        result["rows"].append(row)
        write_json(ns.output_json, result)
        print(f"HF batch {batch}: {row['decode_step_ms']} ms per step, {row['decode_tok_s']} tok/s "
              f"(first generate {row['first_generate_s']} s, batch done in {row['batch_s']} s)", flush=True)
    write_json(ns.output_json, result)
    return 0 if result["rows"] else 1
