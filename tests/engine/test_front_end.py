"""LLM.generate and LLM.chat at the user's edge: several threads
share one LLM, and a bad prompt, params or chat message raises a ValueError or TypeError
naming its index, leaves no request in the engine, and the engine serves on as before."""
import threading

import pytest

from jaxllm import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)  # a deadlocked step loop fails the test, never the CI run

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Each message on a line of its own; the character tokenizer spells it out.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_llm(model: str, multiprocessing: bool) -> LLM:
    # The shapes of tests/engine/test_core_process.py's engines: their executables are cached.
    return LLM(model, max_model_len=128, max_num_seqs=32, max_num_batched_tokens=128, num_gpu_blocks_override=40,
               block_size=16, show_progress=False, enable_multiprocessing=multiprocessing)


@pytest.fixture(scope="module")
def llm(char_llama):
    with make_llm(char_llama, multiprocessing=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference_tokens(llm):
    return greedy_tokens(llm)


def greedy_tokens(llm) -> list[int]:
    return llm.generate("The sea", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def assert_serves_as_before(llm, reference_tokens) -> None:
    assert not llm.llm_engine.has_unfinished_requests()
    stats = llm.llm_engine.get_stats()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert greedy_tokens(llm) == reference_tokens


# -- several threads, one LLM -------------------------------------------------

@pytest.mark.parametrize("multiprocessing", [False, True], ids=["core in process", "core process"])
def test_concurrent_generate_calls_each_get_their_own_outputs(char_llama, llm, multiprocessing):
    # Three callers of different sizes and lengths, so their requests finish in each other's steps.
    calls = [([f"{c} prompt {i} " * (1 + i % 3) for i in range(3 + 2 * k)],
              SamplingParams(temperature=0.0, max_tokens=6 + 9 * k, ignore_eos=True))
             for k, c in enumerate("abc")]
    engine = make_llm(char_llama, multiprocessing=True) if multiprocessing else llm
    try:
        alone = [engine.generate(prompts, params, use_tqdm=False) for prompts, params in calls]
        together = [None] * len(calls)
        start = threading.Barrier(len(calls))

        def call(k):
            start.wait()
            together[k] = engine.generate(*calls[k], use_tqdm=False)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(len(calls))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads)
        for (prompts, _), a, t in zip(calls, alone, together):
            assert [o.prompt for o in t] == prompts
            assert [o.outputs[0].token_ids for o in t] == [o.outputs[0].token_ids for o in a]
            assert all(o.outputs[0].finish_reason == "length" for o in t)
        assert not engine.llm_engine.has_unfinished_requests()
    finally:
        if multiprocessing:
            engine.shutdown()


# -- bad prompts and params -----------------------------------------------------

@pytest.mark.parametrize("prompt, error, message", [
    ("\ud800", ValueError, "prompt 1: prompt is not valid text: surrogates not allowed (position 0: '\\ud800')"),
    ("ok \udcff", ValueError, "prompt 1: prompt is not valid text: surrogates not allowed (position 3"),
    (None, TypeError, "prompt 1: prompt must be a str or a dict, got NoneType"),
    (5, TypeError, "prompt 1: prompt must be a str or a dict, got int"),
    (b"The sea", TypeError, "prompt 1: prompt must be a str or a dict, got bytes"),
    ((c for c in "ab"), TypeError, "prompt 1: prompt must be a str or a dict, got generator"),
    ({"text": "The sea"}, ValueError, "prompt 1: a dict prompt needs 'prompt' or 'prompt_token_ids'"),
    ({"prompt": None}, TypeError, "prompt 1: prompt must be a str or a dict, got NoneType"),
    ({"prompt_token_ids": [5, True]}, ValueError, "prompt 1: prompt_token_ids must be a list of ints"),
], ids=["lone surrogate", "undecodable argv byte", "None", "int", "bytes", "generator", "dict without prompt",
        "dict with a None prompt", "a bool token id"])
def test_a_bad_prompt_raises_naming_its_index(llm, reference_tokens, prompt, error, message):
    with pytest.raises(error) as raised:
        llm.generate(["The sea", prompt], GREEDY, use_tqdm=False)  # prompt 0 is taken back
    assert str(raised.value).startswith(message)
    assert_serves_as_before(llm, reference_tokens)


@pytest.mark.parametrize("prompts, name", [(None, "NoneType"), (5, "int"), (b"The sea", "bytes"),
                                           ((p for p in ["The sea"]), "generator"), ({"The sea"}, "set")])
def test_prompts_that_are_not_a_list_raise_naming_their_type(llm, reference_tokens, prompts, name):
    with pytest.raises(TypeError, match=f"prompts must be a str, a dict or a list of them, got {name}$"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_serves_as_before(llm, reference_tokens)


def changed_after_construction() -> SamplingParams:
    params = SamplingParams(max_tokens=4)
    params.max_tokens = -3
    return params


@pytest.mark.parametrize("sampling_params, error, message", [
    ({"temperature": 0.0}, TypeError, "sampling_params must be a SamplingParams or a list of them, got dict"),
    ([GREEDY, {"temperature": 0.0}], TypeError, "prompt 1: sampling_params must be a SamplingParams, got dict"),
    ([GREEDY, changed_after_construction()], ValueError, "prompt 1: max_tokens must be >= 1, got -3"),
    ([GREEDY], ValueError, "got 1 sampling_params for 2 prompts"),
], ids=["a dict", "a dict in the list", "changed after construction", "too few"])
def test_bad_sampling_params_raise_naming_the_prompt(llm, reference_tokens, sampling_params, error, message):
    with pytest.raises(error) as raised:
        llm.generate(["The sea", "A cat"], sampling_params, use_tqdm=False)
    assert str(raised.value) == message
    assert_serves_as_before(llm, reference_tokens)


# -- chat messages --------------------------------------------------------------

def chat_tokens(llm, messages) -> list[list[int]]:
    outputs = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=CHAT_TEMPLATE)
    return [o.outputs[0].token_ids for o in outputs]


def test_chat_content_as_openai_text_parts_is_the_parts_joined_by_newlines(llm):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    joined = llm.chat([{"role": "user", "content": "Hello\nthere"}], GREEDY, use_tqdm=False,
                      chat_template=CHAT_TEMPLATE)[0]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False, chat_template=CHAT_TEMPLATE)[0]
    assert out.prompt == joined.prompt == "user: Hello\nthere\nassistant:"
    assert out.outputs[0].token_ids == joined.outputs[0].token_ids


def test_chat_of_a_list_of_conversations_answers_each(llm):
    one = [{"role": "user", "content": "Hi"}]
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    assert chat_tokens(llm, [one, two]) == chat_tokens(llm, one) + chat_tokens(llm, two)


USER_HI = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("messages, error, message", [
    ([[USER_HI], [{"role": "user", "content": None}]], TypeError,
     "conversation 1, message 0: content must be a str or a list of text parts, got NoneType"),
    ([USER_HI, {"role": "user", "content": 5}], TypeError,
     "conversation 0, message 1: content must be a str or a list of text parts, got int"),
    ([[USER_HI], []], ValueError, "conversation 1 is empty: it needs at least one message"),
    ([], ValueError, "messages is empty: a conversation needs at least one message"),
    ([USER_HI, "Hi"], TypeError, "conversation 0, message 1 must be a dict with 'role' and 'content', got str"),
    (["Hi"], TypeError, "conversation 0, message 0 must be a dict with 'role' and 'content', got str"),
    ([{"role": "user"}], ValueError, "conversation 0, message 0 needs 'role' and 'content', got keys ['role']"),
    ([{"role": 1, "content": "Hi"}], TypeError, "conversation 0, message 0: role must be a str, got int"),
    ([[USER_HI], "Hi"], TypeError, "conversation 1 must be a list of message dicts, got str"),
    ("Hi", TypeError, "messages must be a list of message dicts or a list of conversations, got str"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ValueError,
     "conversation 0, message 0: content part 0 has type 'image_url'; only 'text' parts are supported"),
    ([{"role": "user", "content": ["Hi"]}], TypeError,
     "conversation 0, message 0: content part 0 must be a dict, got str"),
    ([{"role": "user", "content": [{"type": "text", "text": 7}]}], TypeError,
     "conversation 0, message 0: content part 0: text must be a str, got int"),
    ([{"role": "user", "content": "\ud800"}], ValueError,
     "conversation 0, message 0: content is not valid text: surrogates not allowed (position 0: '\\ud800')"),
], ids=["content None", "content int", "empty conversation", "no conversation", "a str message",
        "a conversation of str", "no content", "role int", "a str conversation", "messages a str",
        "an image part", "a str part", "a part's text int", "lone surrogate"])
def test_bad_chat_messages_raise_naming_the_conversation_and_message(llm, reference_tokens, messages, error,
                                                                     message):
    with pytest.raises(error) as raised:
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template=CHAT_TEMPLATE)
    assert str(raised.value) == message
    assert_serves_as_before(llm, reference_tokens)
