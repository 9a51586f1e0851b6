"""Embeddings and scores end to end (runner="pooling") on the tiny Llama in fp32: each pooler's vector
against HF transformers' final hidden states of the golden prompts (the hidden states whose LM head
gives golden.npz's logits: the head [256, 64] has full column rank, so least squares recovers them
to ~1e-6), within 1e-5 of values up to ~3.4. The 100-token prompt runs in four prefill chunks (a
32-token budget); prompts run batched, preempted and beside generation, with no compilation after
warm-up and every KV block back in the pool."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxllm import LLM, EngineArgs, PoolingParams, SamplingParams
from tests.conftest import tiny_llama_with_tokenizer, tiny_model, write_char_tokenizer
from tests.models.test_llama import golden_prompts

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("warm_up_every_engine")]

ATOL = 1e-5
MATRYOSHKA_DIMENSIONS = [16, 32]
RAW = PoolingParams(normalize=False)


def pooling_engine(model: str, **kwargs) -> LLM:
    # 16 blocks of 16 tokens hold two 128-token requests: a busy batch preempts.
    return LLM(model, runner="pooling", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
               num_gpu_blocks_override=16, show_progress=False, enable_multiprocessing=False, **kwargs)


@pytest.fixture(scope="module")
def golden() -> list[tuple[list[int], np.ndarray]]:
    """[(token ids, HF's final hidden states [len, 64] float64)] of the golden prompts (1, 7, 33, 100 tokens)."""
    lm_head = load_file(os.path.join(tiny_model("llama"), "model.safetensors"))["lm_head.weight"].astype(np.float64)
    prompts = golden_prompts(np.load(os.path.join(tiny_model("llama"), "golden.npz")))
    return [(ids.tolist(), np.linalg.lstsq(lm_head, logits.T.astype(np.float64), rcond=None)[0].T)
            for ids, logits in prompts]


@pytest.fixture(scope="module")
def matryoshka_llama(tmp_path_factory) -> str:
    """The tiny Llama with a character tokenizer, its config.json listing matryoshka_dimensions."""
    folder = tiny_llama_with_tokenizer(tmp_path_factory.mktemp("matryoshka_llama"), write_char_tokenizer)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "matryoshka_dimensions": MATRYOSHKA_DIMENSIONS}, f)
    return folder


@pytest.fixture(scope="module")
def last(matryoshka_llama):
    """vLLM's default pooler for a decoder: the last token, normalized."""
    with pooling_engine(matryoshka_llama) as llm:
        yield llm


@pytest.fixture(scope="module")
def mean():
    with pooling_engine(tiny_model("llama"), skip_tokenizer_init=True, pooler_config={"pooling_type": "MEAN"}) as llm:
        yield llm


@pytest.fixture(scope="module")
def cls():
    with pooling_engine(tiny_model("llama"), skip_tokenizer_init=True, pooler_config={"pooling_type": "CLS"}) as llm:
        yield llm


def ids(token_ids) -> dict:
    return {"prompt_token_ids": list(token_ids)}


def vectors(llm, prompts, params=None) -> list[np.ndarray]:
    return [np.array(out.outputs.embedding) for out in llm.embed([ids(p) for p in prompts], params, use_tqdm=False)]


def normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


@pytest.mark.parametrize("engine, pool", [("last", lambda h: h[-1]), ("mean", lambda h: h.mean(0)),
                                          ("cls", lambda h: h[0])])
def test_each_pooler_gives_hf_transformers_final_hidden_states_pooled(request, golden, engine, pool):
    llm = request.getfixturevalue(engine)
    for vector, (prompt, hidden) in zip(vectors(llm, [p for p, _ in golden], RAW), golden):
        np.testing.assert_allclose(vector, pool(hidden), atol=ATOL, rtol=0)


def test_vectors_are_normalized_by_default_as_vllm_s(last, golden):
    for vector, (_, hidden) in zip(vectors(last, [p for p, _ in golden]), golden):
        np.testing.assert_allclose(vector, normalized(hidden[-1]), atol=ATOL, rtol=0)


def test_a_vector_does_not_depend_on_its_batch(mean, golden):
    # The 100-token prompt alone, then among 15 others: its chunks share steps with theirs.
    prompt, _ = golden[-1]
    (alone,) = vectors(mean, [prompt], RAW)
    rng = np.random.default_rng(0)
    others = [rng.integers(3, 256, rng.integers(20, 128)).tolist() for _ in range(15)]
    batched = vectors(mean, others[:7] + [prompt] + others[7:], RAW)
    np.testing.assert_allclose(batched[7], alone, atol=ATOL, rtol=0)


def test_dimensions_keep_a_matryoshka_model_s_first_values_then_normalize(last, golden):
    prompt, hidden = golden[2]
    for d in MATRYOSHKA_DIMENSIONS:
        (vector,) = vectors(last, [prompt], PoolingParams(dimensions=d))
        np.testing.assert_allclose(vector, normalized(hidden[-1][:d]), atol=ATOL, rtol=0)


def test_dimensions_a_model_does_not_allow_are_refused_naming_the_field(last, mean, golden):
    prompt, hidden = golden[1]
    with pytest.raises(ValueError, match=r"prompt 0: dimensions is for a Matryoshka model"):
        mean.embed(ids(prompt), PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 1: dimensions must be one of the model's matryoshka_dimensions"):
        last.embed([ids(prompt)] * 2, [PoolingParams(), PoolingParams(dimensions=20)], use_tqdm=False)
    with pytest.raises(ValueError, match=r"dimensions must be >= 1, got 0"):
        PoolingParams(dimensions=0)
    with pytest.raises(TypeError, match=r"normalize must be a bool or None, got 'yes'"):
        PoolingParams(normalize="yes")
    (vector,) = vectors(last, [prompt])  # the engine serves on
    np.testing.assert_allclose(vector, normalized(hidden[-1]), atol=ATOL, rtol=0)


def test_last_pooling_reads_cached_prefixes_and_mean_pooling_computes_every_token(last, mean, golden):
    prompt, hidden = golden[-1]
    for llm, expected in [(last, normalized(hidden[-1])), (mean, normalized(hidden.mean(0)))]:
        vectors(llm, [prompt])  # its full blocks are cached now
        hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
        (vector,) = vectors(llm, [prompt])
        np.testing.assert_allclose(vector, expected, atol=ATOL, rtol=0)
        assert (llm.llm_engine.get_stats()["prefix_cache_hits"] > hits) == (llm is last)


def test_score_is_the_cosine_similarity_of_the_two_texts_vectors(last):
    texts = ["the cat sat", "a dog ran far", "the cat sat down", "zebra"]
    vector = dict(zip(texts, (np.array(out.outputs.embedding) for out in last.embed(texts, use_tqdm=False))))

    def cosine(a: str, b: str) -> float:
        return float(vector[a] @ vector[b] / (np.linalg.norm(vector[a]) * np.linalg.norm(vector[b])))

    for text_1, text_2, pairs in [
            ("the cat sat", "the cat sat down", [(0, 0)]),                  # 1:1
            ("the cat sat", texts[1:], [(0, 0), (0, 1), (0, 2)]),           # 1:N
            (texts[:2], texts[2:], [(0, 0), (1, 1)])]:                      # N:N
        firsts, seconds = ([text] if isinstance(text, str) else text for text in (text_1, text_2))
        scores = last.score(text_1, text_2, use_tqdm=False)
        assert [s.outputs.score for s in scores] == pytest.approx([cosine(firsts[i], seconds[j]) for i, j in pairs],
                                                                  abs=1e-6)
        tokenizer = last.get_tokenizer()
        assert scores[-1].prompt_token_ids == tokenizer.encode(firsts[pairs[-1][0]]) + tokenizer.encode(seconds[-1])
    with pytest.raises(ValueError, match=r"text_1 and text_2 must pair 1:1, 1:N or N:N, got 2 and 3 texts"):
        last.score(texts[:2], texts[1:], use_tqdm=False)
    with pytest.raises(ValueError, match=r"text_2 is empty"):
        last.score("a", [], use_tqdm=False)


@pytest.mark.parametrize("args, message", [
    (dict(pooler_config={"pooling_type": "MAX"}), r"pooler_config.pooling_type must be one of \('LAST', 'MEAN', 'CLS'\)"),
    (dict(pooler_config={"normalise": True}), r"pooler_config has unknown keys \['normalise'\]"),
    (dict(pooler_config={"normalize": "yes"}), r"pooler_config.normalize must be a bool"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     r"runner='pooling' does not run with speculative_config"),
])
def test_a_bad_pooler_config_is_refused_naming_the_key(args, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(tiny_model("llama"), runner="pooling", **args).create_config()


def test_embed_on_a_generating_engine_raises_naming_the_runner():
    with LLM(tiny_model("llama"), skip_tokenizer_init=True, max_model_len=128, max_num_seqs=8,
             max_num_batched_tokens=32, show_progress=False, enable_multiprocessing=False) as llm:
        with pytest.raises(ValueError, match=r"runner='pooling'"):
            llm.embed(ids([5, 6, 7]), use_tqdm=False)
        with pytest.raises(ValueError, match=r"pooling_params: this engine generates only"):
            llm.llm_engine.add_request("0", ids([5, 6, 7]), PoolingParams())


def test_generation_and_pooling_share_batches_and_each_is_right(mean, golden):
    # MEAN: a pooling request preempted halfway through its prompt must start its sum again.
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, rng.integers(5, 90)).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    without_pooling = [out.outputs[0].token_ids for out in mean.generate([ids(p) for p in prompts], params,
                                                                         use_tqdm=False)]
    engine = mean.llm_engine
    stats = engine.get_stats()
    for i, prompt in enumerate(prompts):  # generation and pooling requests arrive interleaved
        engine.add_request(f"gen-{i}", ids(prompt), params)
        engine.add_request(f"pool-{i}", ids(golden[i % len(golden)][0]), RAW)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step() if out.finished)
    for i in range(len(prompts)):
        assert outputs[f"gen-{i}"].outputs[0].token_ids == without_pooling[i]
        np.testing.assert_allclose(outputs[f"pool-{i}"].outputs.data, golden[i % len(golden)][1].mean(0),
                                   atol=ATOL, rtol=0)
    after = engine.get_stats()
    assert after["num_preemptions"] > stats["num_preemptions"]
    assert after["num_compilations"] == stats["num_compilations"]
    assert after["num_requests"] == 0 and after["num_free_blocks"] == after["num_blocks"]
