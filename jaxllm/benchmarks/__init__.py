"""`jaxllm bench ...`: the benchmark suite, one module per bench.

Each module has HELP, add_cli_args(parser) for its own flags and main, which returns the exit
status (1 when a check failed). The benches of ENGINE_BENCHES build an engine: the CLI adds
EngineArgs' fields to their flags and calls main(ns, engine_args). The others take only their
own flags and main(ns): a running server's client, the kernels and the device on their own,
the HF transformers baseline and the tables of a GPU run (scripts/gpu_run.sh).
"""
from jaxllm.benchmarks import (attention, bounds, fp8, hf, invariant_matmul, kv_dtype, latency, moe_matmul,
                               quant_matmul, report, sampler, serve, spec_decode, ssd, startup, step, throughput,
                               weights)

ENGINE_BENCHES = {"throughput": throughput, "latency": latency, "step": step, "startup": startup,
                  "weights": weights, "spec": spec_decode}
OTHER_BENCHES = {"serve": serve, "attention": attention, "kv-dtype": kv_dtype, "fp8": fp8, "sampler": sampler,
                 "invariant-matmul": invariant_matmul, "quant-matmul": quant_matmul, "moe-matmul": moe_matmul,
                 "ssd": ssd, "bounds": bounds, "hf": hf, "report": report}
