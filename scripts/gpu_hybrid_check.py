"""GPU check: the hybrid KV cache (sliding-window groups freeing blocks) and prefix hits
through the GPU attention backends, against one plain forward pass (reference attention,
fp32, every block held). Prints a table."""
import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.getcwd())
from jaxllm import LLM, SamplingParams  # noqa: E402
from jaxllm.models.config import ModelArchConfig  # noqa: E402
from tests.engine.test_prefix_caching import plain_forward_logits  # noqa: E402

FIX = "tests/fixtures/tiny"


def hybrid_qwen2():
    folder = tempfile.mkdtemp()
    for name in os.listdir(f"{FIX}/qwen2"):
        if name != "golden.npz":
            shutil.copy(f"{FIX}/qwen2/{name}", folder)
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    config.update(use_sliding_window=True, sliding_window=24, layer_types=["full_attention", "sliding_attention"])
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    return folder, ModelArchConfig.from_hf_config(config)


def gemma3():
    with open(f"{FIX}/gemma3/config.json") as f:
        return f"{FIX}/gemma3", ModelArchConfig.from_hf_config(json.load(f))


rows = []
rng = np.random.default_rng(3)
shared = rng.integers(3, 256, 48).tolist()
prompts = [shared + rng.integers(3, 256, n).tolist() for n in (42, 13, 77)] + [rng.integers(3, 256, 90).tolist()]
params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
for name, (path, arch) in (("qwen2 hybrid (window 24)", hybrid_qwen2()), ("gemma3 tiny (window 8)", gemma3())):
    for backend in ("pallas", "mosaic", "triton"):
        try:
            with LLM(path, dtype="float32", attention_backend=backend, max_model_len=256, max_num_seqs=4,
                     max_num_batched_tokens=32, num_gpu_blocks_override=60, skip_tokenizer_init=True,
                     show_progress=False) as llm:
                llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # caches the shared prefix
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                stats = llm.llm_engine.get_stats()
            matches, cached = 0, [o.num_cached_tokens for o in outs]
            for p, o in zip(prompts, outs):
                gen = list(o.outputs[0].token_ids)
                want = plain_forward_logits(path, arch, p + gen)[len(p) - 1:-1].argmax(-1).tolist()
                matches += gen == want
            rows.append((name, backend, f"{matches}/{len(prompts)}", cached,
                         stats["num_free_blocks"] == stats["num_blocks"]))
        except Exception as e:  # report and go on
            rows.append((name, backend, f"ERROR {type(e).__name__}: {str(e)[:120]}", "-", "-"))
print("\n| model | backend | greedy = plain forward | cached tokens | blocks back |")
print("| --- | --- | --- | --- | --- |")
for r in rows:
    print("| " + " | ".join(str(x) for x in r) + " |")
