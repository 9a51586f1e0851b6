"""Structured outputs end to end on the embedded SmolLM2: every output
of a JSON schema, a regex or a choice obeys it; constrained requests change nothing for the
free ones in their batch; a batch mixing every sampling feature compiles nothing after
warm-up; and a bad constraint is an error at the boundary while the engine serves on."""
import json
import re

import jsonschema
import pytest

from jaxllm import SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "floor": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["city", "floor"], "additionalProperties": False},
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(smollm2):
    return smollm2


def constrained(seed: int, max_tokens: int = 160, **kind) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind))


def test_every_json_output_parses_and_validates_against_its_schema(llm):
    prompts = [f"Write a JSON record for person number {i}:" for i in range(20)]
    params = [constrained(i, json=SCHEMA, disable_any_whitespace=True) for i in range(20)]
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_every_regex_output_matches_in_full_and_every_choice_is_one_of_them(llm):
    pattern = r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-2]\d"
    choices = ["Paris", "London", "a small village"]
    prompts = ["The day it happened:"] * 6 + ["Where do you live?"] * 6
    params = [constrained(i, regex=pattern) for i in range(6)] + [constrained(i, choice=choices) for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs[:6]:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    for out in outs[6:]:
        assert out.outputs[0].text in choices


def test_constrained_requests_leave_the_free_ones_in_their_batch_unchanged(llm):
    prompts = [f"Tell me about the number {i}." for i in range(8)]
    free = [SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=24) for i in range(8)]
    alone = llm.generate(prompts, free, use_tqdm=False)
    mixed = llm.generate(prompts + prompts, free + [constrained(i, 24, json_object=True) for i in range(8)],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:8]] == [o.outputs[0].token_ids for o in alone]
    for out in mixed[8:]:
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text), dict)


def test_a_batch_mixing_every_sampling_feature_compiles_nothing(llm):
    features = [
        {"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.8, "top_k": 40}, {"min_p": 0.1},
        {"repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": 0.3},
        {"logit_bias": {28: 3.0}}, {"allowed_token_ids": list(range(1000))}, {"bad_words": ["the", "The"]},
        {"min_tokens": 10}, {"logprobs": 4, "prompt_logprobs": 2}, {"n": 3, "seed": 5},
        {"structured_outputs": StructuredOutputsParams(choice=["yes", "no"])},
        {"structured_outputs": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)},
    ]
    params = [SamplingParams(**{"max_tokens": 20, "seed": i, **f}) for i, f in enumerate(features)]
    before = llm.llm_engine.get_stats()["num_compilations"]
    outs = llm.generate(["Hello there, friend."] * len(params), params, use_tqdm=False)
    assert llm.llm_engine.get_stats()["num_compilations"] == before
    assert len(outs[9].outputs) == 3
    assert outs[10].outputs[0].text in ("yes", "no")
    assert not any("the" in o.outputs[0].text.lower().split() for o in outs[6:7])


@pytest.mark.parametrize("kind, match", [
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"json": {"type": "no-such-type"}}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
])
def test_a_bad_constraint_is_an_error_at_the_boundary_and_the_engine_serves_on(llm, kind, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=StructuredOutputsParams(**kind))
    (out,) = llm.generate("Say hi.", constrained(0, choice=["hi"]), use_tqdm=False)
    assert out.outputs[0].text == "hi"


def test_a_constraint_after_the_end_of_thinking_leaves_the_thinking_free(llm):
    # SmolLM2 has no </think>: its "." stands in for it. The text up to the first "." is free; the
    # tokens after it fit the regex whole.
    (period,) = llm.get_tokenizer().encode(".", add_special_tokens=False)
    pattern = "[0-9]{3}"
    params = [constrained(seed, 64, regex=pattern, reasoning_end_token_id=period) for seed in range(4)]
    for out in llm.generate(["Once upon a time, a small cat"] * 4, params, use_tqdm=False):
        token_ids = out.outputs[0].token_ids
        assert period in token_ids, out.outputs[0].text  # max_tokens allows a sentence
        end = token_ids.index(period) + 1
        thinking = llm.get_tokenizer().decode(token_ids[:end])
        assert not re.fullmatch(r"[0-9]*\.", thinking)  # words, which the regex would not have allowed
        answer = llm.get_tokenizer().decode(token_ids[end:], skip_special_tokens=True)  # without the EOS
        assert re.fullmatch(pattern, answer), out.outputs[0].text


def test_an_end_of_thinking_outside_the_vocabulary_is_an_error_at_the_boundary(llm):
    with pytest.raises(ValueError, match="reasoning_end_token_id"):
        llm.generate("hi", constrained(0, regex="a", reasoning_end_token_id=10**6), use_tqdm=False)
