"""`jaxllm bench ...`: the benchmark suite, one module per bench.

Each module has HELP, add_cli_args(parser) for its own flags (the CLI adds EngineArgs'
fields), and main(ns, engine_args) -> exit status (1 when a check failed).
"""
from jaxllm.benchmarks import latency, step, throughput, weights

BENCHES = {"throughput": throughput, "latency": latency, "step": step, "weights": weights}
