"""The logits processors end to end: each penalty, logit bias,
allowed tokens and bad words on the tiny Llama in fp32 against a greedy loop over the
model's own logits with the numpy reference of tests/sample/test_processors.py; min_tokens
and bad words hold; requests with processors survive preemption; a batch mixing them
changes no other request's tokens and compiles nothing after warm-up."""
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from tests.conftest import tiny_model
from tests.engine.test_core_process import engine_args
from tests.models.test_llama import load_fixture, make_step, run_prompt
from tests.sample.test_processors import reference

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("warm_up_every_engine")]

PROMPTS = [[5, 17, 42, 99, 3], [200, 201, 202, 7, 7, 7, 9, 1, 4, 4, 30, 31]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm():
    with LLM(**vars(engine_args(tiny_model("llama"), dtype="float32", skip_tokenizer_init=True,
                                enable_multiprocessing=False)), show_progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def model_logits():
    """The model's fp32 logits after a token sequence."""
    config, model, _ = load_fixture("llama")
    step = make_step(model)
    return lambda token_ids: run_prompt(step, config, np.asarray(token_ids, np.int32), [len(token_ids)])[-1]


def reference_greedy(model_logits, prompt, max_tokens, **req):
    out = []
    for _ in range(max_tokens):
        logits = model_logits(prompt + out)
        processed = reference(logits, {"prompt": prompt, "output": out, "stop": [], **req}, [-1] * 8)
        out.append(int(np.argmax(processed)))
    return out


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_the_first_request_with_processors_compiles_nothing(llm):
    before = llm.llm_engine.get_stats()["num_compilations"]  # the module's engine: nothing ran before
    generate(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=2, repetition_penalty=1.2))
    assert llm.llm_engine.get_stats()["num_compilations"] == before


CASES = [
    ({"repetition_penalty": 1.8}, {"rep": 1.8}),
    ({"repetition_penalty": 0.5}, {"rep": 0.5}),
    ({"presence_penalty": 1.5, "frequency_penalty": 0.6}, {"pres": 1.5, "freq": 0.6}),
    ({"frequency_penalty": -0.8}, {"freq": -0.8}),
    ({"logit_bias": {7: 4.0, 100: -50.0, 151: 2.5}}, {"bias": {7: 4.0, 100: -50.0, 151: 2.5}}),
    ({"allowed_token_ids": [3, 9, 40, 100, 226]}, {"allowed": [3, 9, 40, 100, 226]}),
    ({"repetition_penalty": 1.3, "presence_penalty": 0.5, "logit_bias": {30: -3.0}},
     {"rep": 1.3, "pres": 0.5, "bias": {30: -3.0}}),
]


@pytest.mark.parametrize("fields, req", CASES, ids=[str(f) for f, _ in CASES])
def test_greedy_tokens_equal_a_loop_over_the_models_logits_with_the_reference_processors(llm, model_logits,
                                                                                          fields, req):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)
    got = generate(llm, PROMPTS, params)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == reference_greedy(model_logits, prompt, MAX_TOKENS, **req)


def test_the_penalties_change_the_output(llm):
    plain = generate(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    penalized = generate(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                       repetition_penalty=1.8))
    assert plain != penalized  # else the test above could pass with the processors off


def test_min_tokens_holds_back_stop_token_ids_and_eos(llm):
    plain = generate(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    stop = plain[2]
    early = generate(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]))[0]
    assert early == plain[:3]
    held = generate(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
                                                      min_tokens=8))[0]
    assert len(held) >= 8 and stop not in held[:8]


def test_bad_words_of_one_and_several_tokens_never_appear(llm):
    plain = generate(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    # Bad words as token ids (the front end tokenizes strings; the tiny model has no tokenizer).
    words = [[plain[0][1]], [plain[1][3], plain[1][4]]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for engine_request in _requests(llm, PROMPTS, params, words):
        llm.llm_engine.engine_core.add_request(engine_request)
    outs = _drain(llm)
    for tokens in outs.values():
        assert words[0][0] not in tokens
        assert all(tokens[i:i + 2] != words[1] for i in range(len(tokens) - 1))
    assert outs["bad-0"][:1] == plain[0][:1] and outs["bad-1"][:3] == plain[1][:3]  # the same until a ban bites


def _requests(llm, prompts, params, bad_words_token_ids):
    from jaxllm.contracts.engine_core import EngineCoreRequest
    engine = llm.llm_engine
    requests = []
    for i, prompt in enumerate(prompts):
        engine.output_processor.add_request(f"bad-{i}", None, prompt, params, 0.0)
        requests.append(EngineCoreRequest(f"bad-{i}", prompt, params, engine.eos_token_ids, 7, 0.0,
                                          bad_words_token_ids))
    return requests


def _drain(llm) -> dict[str, list[int]]:
    outs = {}
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return outs


def test_requests_with_processors_survive_preemption_unchanged(llm):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, int(rng.integers(20, 60))).tolist() for _ in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.0 + 0.1 * (i % 5),
                             frequency_penalty=0.3 * (i % 3), logit_bias={int(rng.integers(256)): 3.0})
              for i in range(24)]
    preemptions = llm.llm_engine.get_stats()["num_preemptions"]
    together = generate(llm, prompts, params)
    assert llm.llm_engine.get_stats()["num_preemptions"] > preemptions  # 40 blocks cannot hold them all
    alone = [generate(llm, [p], q)[0] for p, q in zip(prompts[:6], params[:6])]
    assert together[:6] == alone


def test_a_batch_mixing_every_processor_changes_no_plain_request_and_compiles_nothing(llm):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, int(rng.integers(1, 70))).tolist() for _ in range(32)]
    plain = [SamplingParams(temperature=float(i % 2), top_p=0.8 if i % 4 == 1 else 1.0, seed=i, ignore_eos=True,
                            max_tokens=int(rng.integers(1, 16)), logprobs=2 if i % 6 == 0 else None)
             for i in range(32)]
    extras = [{"repetition_penalty": 1.2}, {"presence_penalty": 0.5, "frequency_penalty": 0.5},
              {"logit_bias": {5: 2.0}}, {"allowed_token_ids": list(range(50))}, {"min_tokens": 3},
              {"prompt_logprobs": 1}]
    mixed = [SamplingParams(**{**vars(p), **extras[i % len(extras)]}) if i % 2 else p for i, p in enumerate(plain)]
    before = llm.llm_engine.get_stats()["num_compilations"]
    alone = generate(llm, prompts[::2], plain[::2])
    together = generate(llm, prompts, mixed)
    assert llm.llm_engine.get_stats()["num_compilations"] == before
    assert together[::2] == alone
