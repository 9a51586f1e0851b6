"""The embedded SmolLM2-135M-Instruct end to end against HF transformers' greedy
output on the same dequantized weights (tests/fixtures/smollm2_golden.json,
made by scripts/make_gguf_fixtures.py)."""
import json
import os

import pytest

from jaxllm import RequestOutputKind, SamplingParams
from tests.conftest import FIXTURES, SMOLLM2_FILES

with open(os.path.join(FIXTURES, "smollm2_golden.json")) as f:
    GOLDEN = json.load(f)


@pytest.fixture(scope="module")
def llm(smollm2):
    return smollm2


def greedy(n=GOLDEN["num_new_tokens"], **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


def test_greedy_tokens_equal_transformers_for_plain_and_chat_prompts(llm):
    gens = GOLDEN["generations"]
    assert sum(g["kind"] == "plain" for g in gens) >= 4 and sum(g["kind"] == "chat" for g in gens) >= 4
    outputs = llm.generate([{"prompt_token_ids": g["prompt_token_ids"]} for g in gens], greedy(), use_tqdm=False)
    for g, out in zip(gens, outputs):
        assert out.outputs[0].token_ids == g["output_token_ids"], g["prompt"]


def test_text_prompts_and_chat_tokenize_as_transformers(llm):
    plain = [g for g in GOLDEN["generations"] if g["kind"] == "plain"]
    outputs = llm.generate([g["prompt"] for g in plain], greedy(8), use_tqdm=False)
    for g, out in zip(plain, outputs):
        assert out.prompt_token_ids == g["prompt_token_ids"]
        assert out.outputs[0].token_ids == g["output_token_ids"][:8]
    chats = [g for g in GOLDEN["generations"] if g["kind"] == "chat"]
    outputs = llm.chat([g["messages"] for g in chats], greedy(8), use_tqdm=False)
    for g, out in zip(chats, outputs):
        assert out.prompt_token_ids == g["prompt_token_ids"]


def test_incremental_text_equals_full_decode(llm):
    g = GOLDEN["generations"][0]
    eos = g["first_eos_index"] if g["eos_in_output"] else None
    out = llm.generate(g["prompt"], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    tokens = g["output_token_ids"][:eos + 1] if eos is not None else g["output_token_ids"]
    assert out.outputs[0].token_ids == tokens
    assert out.outputs[0].finish_reason == ("stop" if eos is not None else "length")
    assert out.outputs[0].text == llm.get_tokenizer().decode(tokens, skip_special_tokens=True)


def test_stop_string_truncates_and_finishes(llm):
    g = GOLDEN["generations"][0]
    full = g["output_text"]
    stop = full.strip()[3:7]
    out = llm.generate(g["prompt"], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]
    kept = llm.generate(g["prompt"], greedy(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == full[:full.index(stop) + len(stop)]
    assert not llm.llm_engine.has_unfinished_requests()


def test_stop_token_stays_out_of_the_text(llm):
    g = GOLDEN["generations"][0]
    newline = llm.get_tokenizer().encode("\n", add_special_tokens=False)[0]
    out = llm.generate(g["prompt"], greedy(stop_token_ids=[newline]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == newline and out.token_ids[-1] == newline
    assert out.text == g["output_text"][:g["output_text"].index("\n")]


def test_streamed_deltas_never_show_part_of_a_stop_string(llm):
    g = GOLDEN["generations"][0]
    full = g["output_text"]
    stop = full.strip()[3:7]
    engine = llm.llm_engine
    engine.add_request("stream", g["prompt"], greedy(stop=[stop], output_kind=RequestOutputKind.DELTA))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.outputs[0].text for o in engine.step()]
    assert "".join(pieces) == full[:full.index(stop)]


def test_every_file_that_uses_the_session_engine_is_in_its_unit_of_work(request):
    """The suite's workers run SMOLLM2_FILES as one unit (tests/conftest.py): a file missing from it
    would start the engine on a second worker. (It sees the session's tests: all of them in the suite.)"""
    using = {item.nodeid.split("::")[0].removeprefix("tests/") for item in request.session.items
             if "smollm2" in getattr(item, "fixturenames", ())}
    assert using <= set(SMOLLM2_FILES), using - set(SMOLLM2_FILES)
