"""What the Processor checks and makes of a request before the core sees it: token ids
within the model's vocabulary (logit_bias, allowed_token_ids), prompt_logprobs within
max_logprobs, the fields that need a tokenizer, truncate_prompt_tokens, and bad_words as
token id sequences; each bad request raises a ValueError naming its field and the engine
serves on."""
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams
from tests.conftest import tiny_model

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(5, 25))
VOCAB_SIZE = 256  # the tiny llama's
MAX_MODEL_LEN = 128


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, **kwargs})


@pytest.fixture(scope="module")
def llm():
    # The shape of tests/engine/test_boundaries.py's engine: its executables are cached.
    with LLM(tiny_model("llama"), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=40,
             show_progress=False, enable_multiprocessing=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm):
    return generate(llm, PROMPT, greedy())


def generate(llm, prompt_ids: list[int], params: SamplingParams):
    return llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]


def assert_rejected_and_serves_on(llm, reference, params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.add_request("bad", {"prompt_token_ids": PROMPT}, params)
    assert not llm.llm_engine.has_unfinished_requests()
    assert generate(llm, PROMPT, greedy()).outputs[0].token_ids == reference.outputs[0].token_ids


def core_requests(llm, monkeypatch, prompt, params: SamplingParams):
    """The EngineCoreRequests add_request sends the core (kept from it, then forgotten)."""
    sent = []
    monkeypatch.setattr(llm.llm_engine.engine_core, "add_request", sent.append)
    llm.llm_engine.add_request("sent", prompt, params)
    llm.llm_engine.abort_request("sent")
    monkeypatch.undo()
    return sent


# -- token ids within the vocabulary ------------------------------------------------

@pytest.mark.parametrize("field, value", [("logit_bias", {3: 1.0, VOCAB_SIZE: -2.0, VOCAB_SIZE + 7: 1.0}),
                                          ("allowed_token_ids", [3, VOCAB_SIZE + 7, VOCAB_SIZE])])
def test_token_ids_outside_the_vocabulary_are_rejected_naming_the_field_and_ids(llm, reference, field, value):
    outside = sorted(set(value) - {3}, key=list(value).index)
    assert_rejected_and_serves_on(llm, reference, greedy(**{field: value}),
                                  rf"^{field} holds token ids outside the vocabulary \[0, {VOCAB_SIZE}\): "
                                  rf"\[{outside[0]}, {outside[1]}\]")


def test_the_last_token_id_of_the_vocabulary_is_allowed(llm):
    out = generate(llm, PROMPT, greedy(logit_bias={VOCAB_SIZE - 1: 0.5}, allowed_token_ids=[VOCAB_SIZE - 1, 3]))
    assert len(out.outputs[0].token_ids) == 4


# -- prompt_logprobs -----------------------------------------------------------------

def test_more_prompt_logprobs_than_max_logprobs_is_rejected(llm, reference):
    assert_rejected_and_serves_on(llm, reference, greedy(prompt_logprobs=21),
                                  r"^prompt_logprobs must be <= max_logprobs \(20, an engine arg\), got 21")


def test_n_samples_ask_the_core_for_the_prompt_logprobs_once(llm, monkeypatch):
    sent = core_requests(llm, monkeypatch, {"prompt_token_ids": PROMPT}, greedy(n=3, prompt_logprobs=2))
    assert [r.sampling_params.prompt_logprobs for r in sent] == [2, None, None]


# -- fields that need a tokenizer -------------------------------------------------------

@pytest.mark.parametrize("field, value", [("stop", ["ab"]), ("bad_words", ["hello"]),
                                          ("structured_outputs", StructuredOutputsParams(regex="a+"))])
def test_fields_that_need_a_tokenizer_are_rejected_without_one(llm, reference, field, value):
    assert_rejected_and_serves_on(llm, reference, greedy(**{field: value}),
                                  rf"^{field} needs a tokenizer \(.*\), and this engine was started with "
                                  "skip_tokenizer_init")


# -- truncate_prompt_tokens ---------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_prompts_last_k_tokens(llm):
    truncated = generate(llm, PROMPT, greedy(truncate_prompt_tokens=6))
    assert truncated.prompt_token_ids == PROMPT[-6:]
    assert truncated.outputs[0].token_ids == generate(llm, PROMPT[-6:], greedy()).outputs[0].token_ids


def test_truncate_prompt_tokens_longer_than_the_prompt_keeps_it_whole(llm, reference):
    out = generate(llm, PROMPT, greedy(truncate_prompt_tokens=MAX_MODEL_LEN))
    assert out.prompt_token_ids == PROMPT and out.outputs[0].token_ids == reference.outputs[0].token_ids


def test_truncate_prompt_tokens_minus_one_keeps_the_last_max_model_len_tokens(llm, monkeypatch):
    long_prompt = [5 + i % 200 for i in range(MAX_MODEL_LEN + 30)]
    (request,) = core_requests(llm, monkeypatch, {"prompt_token_ids": long_prompt}, greedy(truncate_prompt_tokens=-1))
    assert request.prompt_token_ids == long_prompt[-MAX_MODEL_LEN:]


def test_truncate_prompt_tokens_over_max_model_len_is_rejected(llm, reference):
    assert_rejected_and_serves_on(llm, reference, greedy(truncate_prompt_tokens=MAX_MODEL_LEN + 1),
                                  rf"^truncate_prompt_tokens must be <= max_model_len \({MAX_MODEL_LEN}\) or -1, "
                                  rf"got {MAX_MODEL_LEN + 1}")


def test_a_long_prompt_without_truncation_is_still_rejected(llm, reference):
    with pytest.raises(ValueError, match=rf"^prompt has {MAX_MODEL_LEN + 1} tokens, longer than max_model_len"):
        llm.llm_engine.add_request("long", {"prompt_token_ids": [5] * (MAX_MODEL_LEN + 1)}, greedy())
    assert not llm.llm_engine.has_unfinished_requests()


# -- with a tokenizer: the embedded SmolLM2 ---------------------------------------------------

def encode(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_bad_words_become_token_ids_alone_and_after_a_space(smollm2, monkeypatch):
    # "hello" and " hello" are one token each, two different ones: both are banned. " Jupiter" is one
    # token where "Jupiter" is two: the spaced form is a different length, so it is left out (vLLM's rule).
    hello, spaced_hello = encode(smollm2, "hello"), encode(smollm2, " hello")
    assert len(hello) == len(spaced_hello) == 1 and hello != spaced_hello
    jupiter, spaced_jupiter = encode(smollm2, "Jupiter"), encode(smollm2, " Jupiter")
    assert len(jupiter) != len(spaced_jupiter)
    (request,) = core_requests(smollm2, monkeypatch, "Say hi", greedy(bad_words=["hello", "  Jupiter", " hello"]))
    assert request.bad_words_token_ids == [hello, spaced_hello, jupiter]


def test_text_prompts_are_truncated_to_their_last_k_tokens(smollm2):
    text = "The quick brown fox jumps over the lazy dog near the river bank"
    out = smollm2.generate(text, greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == smollm2.get_tokenizer().encode(text)[-5:]


def test_detokenize_false_gives_the_same_tokens_and_no_text(smollm2):
    with_text, ids_only = (smollm2.generate("The capital of France is", greedy(max_tokens=6, detokenize=d),
                                            use_tqdm=False)[0].outputs[0] for d in (True, False))
    assert ids_only.token_ids == with_text.token_ids and with_text.text
    assert ids_only.text == ""
