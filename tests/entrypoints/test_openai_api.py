"""The server through the official `openai` client: completions and chat, streamed and
not, n, logprobs, stop strings, seeds, usage; and the routes beside them."""
import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=60.0, max_retries=0)


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Concatenated text and last finish reason of each choice index, and the chunks."""
    texts, finishes, chunks = {}, {}, list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            text = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + text
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, chunks


def test_completion_streamed_text_equals_the_whole_text_and_usage_counts_tokens(api, client):
    prompt = "The quick brown fox"
    whole = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0.0,
                                   extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert whole.object == "text_completion" and whole.model == MODEL_NAME and whole.id.startswith("cmpl-")
    num_prompt_tokens = len(client.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    assert whole.usage.prompt_tokens == num_prompt_tokens
    assert whole.usage.completion_tokens == 12 and choice.finish_reason == "length"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    stream = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0.0, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, finishes, chunks = stream_text(stream)
    assert texts == {0: choice.text} and finishes == {0: choice.finish_reason}
    assert len(chunks) > 2  # it did stream
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_text_equals_the_whole_text_and_starts_with_the_role(api):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = api.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0.0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10 or whole.choices[0].finish_reason == "stop"
    stream = api.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0.0,
                                         stream=True, stream_options={"include_usage": True})
    texts, finishes, chunks = stream_text(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert texts == {0: whole.choices[0].message.content}
    assert finishes == {0: whole.choices[0].finish_reason}
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_echo_starts_the_reply_with_the_assistants_last_message_streamed_and_not(api):
    messages = [{"role": "user", "content": "tell a story"}, {"role": "assistant", "content": "Once upon"}]
    going_on = dict(model=MODEL_NAME, max_tokens=6, temperature=0.0,
                    extra_body={"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True})
    plain = api.chat.completions.create(messages=messages, **going_on).choices[0].message.content
    echoed = api.chat.completions.create(messages=messages, **{**going_on, "extra_body": {
        **going_on["extra_body"], "echo": True}}).choices[0].message.content
    assert echoed == "Once upon" + plain
    texts, _, chunks = stream_text(api.chat.completions.create(messages=messages, stream=True, **{
        **going_on, "extra_body": {**going_on["extra_body"], "echo": True}}))
    assert texts == {0: echoed} and chunks[1].choices[0].delta.content == "Once upon"
    # The last message the user's: nothing to echo.
    user_last = dict(model=MODEL_NAME, messages=messages[:1], max_tokens=4, temperature=0.0)
    assert api.chat.completions.create(**user_last, extra_body={"echo": True}).choices[0].message.content == \
        api.chat.completions.create(**user_last).choices[0].message.content


def test_chat_prompt_is_the_chat_template_applied(api, client):
    tokens = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "<user>hi|<assistant>"
    out = api.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.usage.prompt_tokens == len(tokens)


def test_a_request_chat_template_gets_the_chat_template_kwargs(api):
    out = api.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "cd"}], max_tokens=1,
        extra_body={"chat_template": "{{ prefix }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                    "chat_template_kwargs": {"prefix": "ab"}})
    assert out.usage.prompt_tokens == len("abcd")  # one token a character


def test_n_2_gives_two_choices_streamed_and_not(api):
    whole = api.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=6, n=2, temperature=1.0, seed=3,
                                   extra_body={"ignore_eos": True})
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert whole.usage.completion_tokens == 12
    texts, finishes, _ = stream_text(api.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=6, n=2,
                                                            temperature=1.0, seed=3, stream=True,
                                                            extra_body={"ignore_eos": True}))
    assert texts == {c.index: c.text for c in whole.choices}  # seeded: the same samples
    assert finishes == {0: "length", 1: "length"}
    chat = api.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], n=2,
                                       max_tokens=3, seed=5)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_several_prompts_in_one_completion_request_get_their_own_choices(api):
    whole = api.completions.create(model=MODEL_NAME, prompt=["one", "two two", "three"], max_tokens=4,
                                   temperature=0.0, n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in whole.choices) == list(range(6))
    alone = api.completions.create(model=MODEL_NAME, prompt="two two", max_tokens=4, temperature=0.0,
                                   extra_body={"ignore_eos": True})
    assert {c.index: c.text for c in whole.choices}[2] == alone.choices[0].text
    assert whole.usage.completion_tokens == 24


def test_token_id_prompts_are_taken_as_they_are(api):
    out = api.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0.0,
                                 extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.prompt_tokens == 5
    single = api.completions.create(model=MODEL_NAME, prompt=[8, 9], max_tokens=3, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert single.choices[0].text == out.choices[1].text


def test_seed_makes_sampling_reproducible(api):
    def sample(seed):
        return api.completions.create(model=MODEL_NAME, prompt="seeded", max_tokens=8, temperature=1.0,
                                      seed=seed).choices[0].text
    assert sample(11) == sample(11)
    assert len({sample(s) for s in range(4)}) > 1


def test_completion_logprobs_have_one_entry_per_token(api):
    out = api.completions.create(model=MODEL_NAME, prompt="log", max_tokens=5, temperature=0.0, logprobs=3,
                                 extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the sampled token is the likeliest


def test_chat_logprobs_and_top_logprobs(api):
    out = api.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hey"}],
                                      max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2,
                                      extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode() == entry.token
    streamed = api.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hey"}],
                                           max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2,
                                           stream=True, extra_body={"ignore_eos": True})
    tokens = [e.token for chunk in streamed for choice in chunk.choices if choice.logprobs
              for e in choice.logprobs.content]
    assert tokens == [c.token for c in content]


def test_stop_strings_end_the_output_and_never_leak_into_the_stream(api):
    free = api.completions.create(model=MODEL_NAME, prompt="stop here", max_tokens=30, temperature=0.0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    assert len(free) >= 10
    stop = free[6:9]  # three characters, which stream in separate chunks
    cut = free[:free.index(stop)]
    whole = api.completions.create(model=MODEL_NAME, prompt="stop here", max_tokens=30, temperature=0.0,
                                   stop=[stop], extra_body={"ignore_eos": True})
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    texts, finishes, chunks = stream_text(api.completions.create(
        model=MODEL_NAME, prompt="stop here", max_tokens=30, temperature=0.0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert texts == {0: cut} and finishes == {0: "stop"}
    assert stop not in "".join(c.choices[0].text for c in chunks if c.choices)


def test_models_lists_the_served_name_with_max_model_len(api):
    models = api.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_tokenize_and_detokenize_round_trip(client):
    body = client.post("/tokenize", json={"prompt": "round trip", "add_special_tokens": False}).json()
    assert body["count"] == len(body["tokens"]) == len("round trip") and body["max_model_len"] == MAX_MODEL_LEN
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "round trip"}


def test_version_and_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_api_key_is_required_on_v1_routes_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.url + "/v1/completions", headers=headers,
                       json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_serve_with_a_missing_chat_template_file_is_a_one_line_error(capsys):
    from jaxllm.cli import main
    assert main(["serve", "--chat-template", "/nonexistent/template.jinja"]) == 2
    assert "jaxllm: error: chat template '/nonexistent/template.jinja'" in capsys.readouterr().err
