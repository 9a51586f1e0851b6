"""Start-up, cold and warm: run twice on the device, `python3 scripts/gpu_startup.py [MODEL [MAX_MODEL_LEN]]`
(default the Llama-3.1-8B shape; random bf16 weights, 10 token buckets). Prints the engine's start-up
split (weights / KV cache / compile, and within compile: executables loaded from the store,
tracing and lowering, waiting on XLA, first runs), the wall time of `LLM(...)`, and a digest
of 8 greedy outputs, which must be the same on every start."""
import hashlib
import json
import sys
import time

from jaxllm import LLM, SamplingParams


def main() -> None:
    start = time.perf_counter()
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b", load_format="dummy", dtype="bfloat16",
              max_model_len=int(sys.argv[2]) if len(sys.argv) > 2 else 2048, max_num_seqs=256, max_num_batched_tokens=8192,
              skip_tokenizer_init=True,
              show_progress=False)
    startup_s = time.perf_counter() - start
    vocab = llm.llm_engine.config.model.arch.vocab_size
    prompts = [{"prompt_token_ids": [(100 * i + j) % vocab for j in range(1, 65)]} for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    digest = hashlib.sha256(json.dumps([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()[:16]
    print(json.dumps({"startup_s": round(startup_s, 1), "outputs": digest,
                      "description": llm.llm_engine.engine_core.description}))
    llm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
