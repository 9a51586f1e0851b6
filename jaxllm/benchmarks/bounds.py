"""`jaxllm bench bounds`: the device's ceilings and a decode step's bounds, beside jaxllm's and
HF transformers' measured steps.

    jaxllm bench bounds ceilings --framework jax --output-json OUT/ceilings_jax.json
        copy bandwidth (read + write bytes of a device-to-device copy of a 2 GiB bf16 buffer:
        `x + 1` through XLA, or PyTorch's copy_ with --framework torch) and the bf16 matmul
        rate (8192^3: jnp.dot, torch.mm); medians of 20 runs after 3 of warm-up, on the host's
        clock around a blocking call for JAX and on CUDA events for PyTorch. Run each framework
        in its own process: the two would share the GPU.
    jaxllm bench bounds table --dir OUT --config CONFIG [--png FILE]
        reads OUT/{ceilings_jax,ceilings_torch,step,hf,throughput}.json (any may be missing:
        `bench step`'s, `bench hf`'s and `bench throughput`'s JSON), prints the comparison table
        and writes OUT/bench.json, the table's data; with matplotlib, the plot too.
    jaxllm bench bounds plot --summary OUT/bench.json --png FILE
        the plot alone, from a bench.json (where matplotlib is: `pip install -e .[plot]`).

The bounds of a decode step at batch B and context c (tokens before the new one), from the
model's params and the faster framework's figure of each ceiling:
    memory:  (weight bytes(B) + B * c * KV bytes per token + B * state bytes) / copy bandwidth
    compute: B * (2 * a token's matmul parameters + attention FLOPs per context token * c) / matmul rate
and B / the larger of the two is the most tokens/s a step can give. The weights counted are
those a step reads whole: every layer, the final norm and the LM head, not the embedding
table (a step gathers B of its rows); of a mixture of experts, the share of the experts that B
tokens routed uniformly at random touch (batch 1: its top-k). Latent attention (DeepSeek) reads
one latent a token; a Mamba layer reads and writes its fixed states. c is input_len +
output_len / 2, the mean over the decode.
"""
import json
import math
import os

from jaxllm.benchmarks.common import cell, positive_int, positive_ints, read_json, write_json
from jaxllm.benchmarks.device_timing import median_s, torch_median_s

HELP = "the device's copy and matmul ceilings, and a decode step's bounds beside jaxllm's and HF's steps"


def add_cli_args(parser) -> None:
    sub = parser.add_subparsers(dest="bounds_command", required=True)
    p = sub.add_parser("ceilings", help="copy bandwidth and bf16 matmul rate through one framework")
    p.add_argument("--framework", choices=("jax", "torch"), default="jax")
    p.add_argument("--copy-bytes", type=positive_int, default=2 << 30)
    p.add_argument("--matmul-n", type=positive_int, default=8192)
    p.add_argument("--output-json", required=True)
    p = sub.add_parser("table", help="the bounds beside the measured steps, from a folder of results")
    p.add_argument("--dir", required=True,
                   help="the folder of the ceilings_*.json, step.json, hf.json and throughput.json")
    p.add_argument("--config", required=True, help="the model's config.json, or its folder")
    p.add_argument("--dtype-bytes", type=positive_int, default=2)
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--batch-sizes", type=positive_ints, default=[],
                   help="rows to show even where nothing was measured (the bounds alone)")
    p.add_argument("--summary", help="where to write the summary (default DIR/bench.json)")
    p.add_argument("--png", help="also plot tokens/s against batch size into this PNG")
    p = sub.add_parser("plot", help="the PNG from a bench.json that table wrote")
    p.add_argument("--summary", required=True)
    p.add_argument("--png", required=True)


def jax_ceilings(copy_bytes: int, matmul_n: int) -> dict:
    import jax
    import jax.numpy as jnp

    def copy_s() -> float:
        x = jax.random.normal(jax.random.key(0), (copy_bytes // 2,), jnp.bfloat16)
        add_one = jax.jit(lambda a: a + 1)  # not a bare copy, which XLA may elide
        return median_s(lambda: add_one(x).block_until_ready())

    def matmul_s() -> float:
        a = jax.random.normal(jax.random.key(1), (matmul_n, matmul_n), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(2), (matmul_n, matmul_n), jnp.bfloat16)
        dot = jax.jit(jnp.dot)
        return median_s(lambda: dot(a, b).block_until_ready())

    return {"device": jax.devices()[0].device_kind, "copy_Bps": 2 * copy_bytes / copy_s(),
            "matmul_flops": 2 * matmul_n ** 3 / matmul_s()}


def torch_ceilings(copy_bytes: int, matmul_n: int) -> dict | None:
    """None where there is no PyTorch with a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    def copy_s() -> float:
        x = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        return torch_median_s(lambda: y.copy_(x), warmup=3, iters=20)

    def matmul_s() -> float:
        a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
        return torch_median_s(lambda: torch.mm(a, b), warmup=3, iters=20)

    return {"device": torch.cuda.get_device_name(), "copy_Bps": 2 * copy_bytes / copy_s(),
            "matmul_flops": 2 * matmul_n ** 3 / matmul_s()}


def ceilings(ns) -> int:
    if ns.framework == "jax":
        result = jax_ceilings(ns.copy_bytes, ns.matmul_n)
    else:
        result = torch_ceilings(ns.copy_bytes, ns.matmul_n)
        if result is None:
            print("torch ceilings SKIPPED: no torch with a GPU here")
            return 0
    result.update(framework=ns.framework, copy_bytes=ns.copy_bytes, matmul_n=ns.matmul_n)
    print(f"{ns.framework}: copy {result['copy_Bps'] / 1e12:.3g} TB/s, bf16 matmul "
          f"{result['matmul_flops'] / 1e12:.3g} TFLOP/s ({result['device']})")
    write_json(ns.output_json, result)
    return 0


def model_sizes(config: str, dtype_bytes: int) -> dict:
    """What a decode step of `config` (a config.json, an HF folder or a bundled config's name) reads
    and computes, from the engine's own params: every matmul weight but the embedding table (a step
    gathers its rows; a tied LM head reads it whole), the norms, and of a mixture of experts' stacked
    experts the share a batch touches (weight_bytes)."""
    from jaxllm.model_source import resolve_model
    from jaxllm.models.config import ModelArchConfig
    from jaxllm.models.loader import abstract_params
    if os.path.isfile(config):
        with open(config) as f:
            arch = ModelArchConfig.from_hf_config(json.load(f))
    else:
        arch = resolve_model(config, "dummy")[3]
    _, params = abstract_params(arch, "bfloat16")
    counts = {"experts": 0, "dense": 0, "matmul": 0}
    for path, var in params.items():
        size = math.prod(var.shape)
        if "embed_tokens" in path and not arch.tie_word_embeddings:
            continue
        counts["experts" if "experts" in path else "dense"] += size
        counts["matmul"] += size if len(var.shape) >= 2 and "experts" not in path else 0
    moe, mla, mamba = arch.moe, arch.mla, arch.mamba
    mamba_layers = len(mamba.layers) if mamba else 0
    attention_layers = arch.num_layers - mamba_layers
    expert_share = moe.top_k / moe.num_experts if moe else 0.0
    if mla is not None:  # one latent a token; decode's absorbed heads score it and sum its kv_lora_rank part
        kv_per_layer, flops_per_layer = mla.latent_dim, 2 * arch.num_heads * (mla.latent_dim + mla.kv_lora_rank)
    else:
        kv_per_layer, flops_per_layer = 2 * arch.num_kv_heads * arch.head_dim, 4 * arch.num_heads * arch.head_dim
    state = mamba and sum(map(math.prod, mamba.state_shapes))
    return {"dense_weight_bytes": counts["dense"] * dtype_bytes, "expert_weight_bytes": counts["experts"] * dtype_bytes,
            "expert_share_per_token": expert_share,
            "matmul_params": counts["matmul"] + expert_share * counts["experts"],  # a token's
            "kv_bytes_per_token": attention_layers * kv_per_layer * dtype_bytes,
            # A Mamba layer's states, read and written back each step (in the model's dtype).
            "state_bytes_per_sequence": 2 * mamba_layers * (state or 0) * dtype_bytes,
            "attention_flops_per_context_token": attention_layers * flops_per_layer}


def weight_bytes(sizes: dict, batch: int) -> float:
    """The weight bytes a step of `batch` tokens reads: the dense weights, and the experts' share that
    `batch` tokens choosing independently and uniformly touch, 1 - (1 - top_k / experts) ** batch."""
    touched = 1 - (1 - sizes["expert_share_per_token"]) ** batch
    return sizes["dense_weight_bytes"] + touched * sizes["expert_weight_bytes"]


def bounds(sizes: dict, ceil: dict, batch: int, context: int) -> dict:
    read = (weight_bytes(sizes, batch) + batch * context * sizes["kv_bytes_per_token"]
            + batch * sizes["state_bytes_per_sequence"])
    memory_s = read / ceil["copy_Bps"]
    flops = batch * (2 * sizes["matmul_params"] + sizes["attention_flops_per_context_token"] * context)
    compute_s = flops / ceil["matmul_flops"]
    return {"memory_bound_ms": 1e3 * memory_s, "compute_bound_ms": 1e3 * compute_s,
            "memory_bound_tok_s": batch / memory_s, "compute_bound_tok_s": batch / compute_s,
            "bound_tok_s": batch / max(memory_s, compute_s)}


def table(ns) -> int:
    measured = {name: read_json(os.path.join(ns.dir, f"ceilings_{name}.json")) for name in ("jax", "torch")}
    measured = {name: r for name, r in measured.items() if r}
    # The device's ceilings: the faster framework's figure of each.
    ceil = measured and {"copy_Bps": max(r["copy_Bps"] for r in measured.values()),
                         "matmul_flops": max(r["matmul_flops"] for r in measured.values()),
                         "device": next(iter(measured.values()))["device"], **measured}
    step = read_json(os.path.join(ns.dir, "step.json"))
    hf = read_json(os.path.join(ns.dir, "hf.json"))
    throughput = read_json(os.path.join(ns.dir, "throughput.json"))
    sizes = model_sizes(ns.config, ns.dtype_bytes)
    context = ns.input_len + ns.output_len // 2
    jax_rows = {r["batch"]: r for r in (step or {}).get("rows", [])}
    hf_rows = {r["batch"]: r for r in (hf or {}).get("rows", [])}
    rows = []
    for batch in sorted(set(jax_rows) | set(hf_rows) | set(ns.batch_sizes)):
        j, h = jax_rows.get(batch), hf_rows.get(batch)
        row = {"batch": batch, "context": context,
               "jaxllm_step_ms": j and j["decode_step_ms"], "jaxllm_device_ms": j and j["device_step_ms"],
               "jaxllm_tok_s": j and j["decode_tok_s"], "hf_step_ms": h and h["decode_step_ms"],
               "hf_tok_s": h and h["decode_tok_s"]}
        if ceil:
            row.update({k: round(v, 3) for k, v in bounds(sizes, ceil, batch, context).items()})
            if j:
                row["jaxllm_pct_of_bound"] = round(100 * j["decode_tok_s"] / row["bound_tok_s"], 1)
        rows.append(row)

    print(f"\nDecode step, {ns.input_len} in / {ns.output_len} out (bounds at context {context}); "
          f"{weight_bytes(sizes, 1) / 1e9:.4g} GB of weights at batch 1 ("
          f"{(sizes['dense_weight_bytes'] + sizes['expert_weight_bytes']) / 1e9:.4g} GB in all) and "
          f"{sizes['kv_bytes_per_token'] / 1024:.4g} KiB of KV per context token a step, "
          f"{2 * sizes['matmul_params'] / 1e9:.4g} GFLOP of matmuls per token")
    if ceil:
        print(f"ceilings (this run, the faster of each): copy {ceil['copy_Bps'] / 1e12:.3g} TB/s, bf16 matmul "
              f"{ceil['matmul_flops'] / 1e12:.3g} TFLOP/s"
              + "".join(f"; {n}: {ceil[n]['copy_Bps'] / 1e12:.3g} TB/s, {ceil[n]['matmul_flops'] / 1e12:.3g} TFLOP/s"
                        for n in ("jax", "torch") if n in ceil))
    else:
        print("ceilings: not measured (no ceilings_*.json), so no bounds")
    if step:
        print(f"jaxllm: {step['model']} ({step['dtype']}, attention {step['attention_backend']}), start-up "
              f"{step['startup_s']} s, compiles after warm-up {step['compiles_after_warm_up']}, lengths ok "
              f"{all(r['all_lengths_ok'] for r in step['rows'])}")
    if hf:
        print(f"HF: transformers {hf['transformers']}, torch {hf['torch']}, static cache, "
              + (f"torch.compile {hf['compile_config']['mode']}" if hf["compiled"] else "eager")
              + (f"; skipped batches {hf['skipped']}" if hf["skipped"] else ""))
    print("\n| batch | jaxllm step (ms) | jaxllm device (ms) | jaxllm tok/s | HF step (ms) | HF tok/s "
          "| memory-bound tok/s | compute-bound tok/s | jaxllm % of bound | jaxllm / HF |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        speedup = r["jaxllm_tok_s"] / r["hf_tok_s"] if r["jaxllm_tok_s"] and r["hf_tok_s"] else None
        print(f"| {r['batch']} | {cell(r['jaxllm_step_ms'], '.2f')} | {cell(r['jaxllm_device_ms'], '.2f')} "
              f"| {cell(r['jaxllm_tok_s'])} | {cell(r['hf_step_ms'], '.2f')} | {cell(r['hf_tok_s'])} "
              f"| {cell(r.get('memory_bound_tok_s'))} | {cell(r.get('compute_bound_tok_s'))} "
              f"| {cell(r.get('jaxllm_pct_of_bound'), '.0f')} | {cell(speedup, '.2f')} |")
    if throughput:
        t = throughput
        print(f"\njaxllm bench throughput: {t['num_requests']} prompts, {t['input_len']} in / {t['output_len']} out: "
              f"{t['requests_per_second']:.2f} req/s, {t['tokens_per_second']:,.0f} total tok/s, "
              f"{t['output_tokens_per_second']:,.0f} output tok/s (elapsed {t['elapsed_time']:.1f} s, start-up "
              f"{t['startup_s']} s, compiles {t['compiles_after_warm_up']}, lengths ok {t['all_lengths_ok']})")
    else:
        print("\njaxllm bench throughput: not run")
    hf_label = "HF transformers" + ((" (static cache, torch.compile)" if hf["compiled"] else " (static cache, eager)")
                                    if hf else "")
    title = (f"{step['model'] if step else 'decode step'}, {ns.input_len} in / {ns.output_len} out"
             + (f", {ceil['device']}" if ceil else ""))
    summary = {"title": title, "hf_label": hf_label, "input_len": ns.input_len, "output_len": ns.output_len,
               "context": context, "model_sizes": sizes, "ceilings": ceil, "rows": rows,
               "throughput": throughput and {k: v for k, v in throughput.items()
                                             if k not in ("prompt_lens", "output_lens")}}
    write_json(os.path.join(ns.dir, "bench.json") if ns.summary is None else ns.summary, summary)
    if ns.png:
        try:
            plot(rows, ns.png, title, hf_label)
        except Exception as e:  # the table above stands without it
            print(f"plot FAILED: {type(e).__name__}: {e}")
    return 0


def plot(rows: list[dict], path: str, title: str, hf_label: str) -> None:
    """Tokens/s against batch size, log-log: jaxllm and HF against the bounds."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print(f"plot: no matplotlib here; bench.json holds its data (jaxllm bench bounds plot --summary "
              f"bench.json --png {os.path.basename(path)} makes it where matplotlib is)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [("bound_tok_s", "bound (the lower of the two below)", dict(color="black", lw=2)),
              ("memory_bound_tok_s", "memory bound", dict(color="gray", ls="--", lw=1)),
              ("compute_bound_tok_s", "compute bound", dict(color="gray", ls=":", lw=1)),
              ("jaxllm_tok_s", "jaxllm", dict(color="tab:blue", marker="o")),
              ("hf_tok_s", hf_label, dict(color="tab:orange", marker="s"))]
    for key, label, style in series:
        points = [(r["batch"], r[key]) for r in rows if r.get(key)]
        if points:
            ax.plot(*zip(*points), label=label, **style)
    ax.set_xscale("log", base=2)
    batches = [r["batch"] for r in rows]
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_yscale("log")
    ax.set_xlabel("batch size (requests decoding)")
    ax.set_ylabel("output tokens/s (decode step)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(ns) -> int:
    if ns.bounds_command == "ceilings":
        return ceilings(ns)
    if ns.bounds_command == "table":
        return table(ns)
    summary = read_json(ns.summary)
    if summary is None:
        raise ValueError(f"cannot read {ns.summary}")
    plot(summary["rows"], ns.png, summary["title"], summary["hf_label"])
    return 0
