"""The RequestOutput fields the front end builds from the core's news, fed hand-made
EngineCoreOutputs (no engine): prompt logprobs (vLLM's PromptLogprobs, over one or more
prefill chunks, through every output kind and n > 1), detokenize=False,
spaces_between_special_tokens, num_cached_tokens and the request's metrics."""
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from jaxllm import RequestOutputKind, SamplingParams
from jaxllm.contracts.engine_core import EngineCoreOutput, LogprobsArrays
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.parallel_sampling import ParentRequest
from jaxllm.outputs import Logprob
from tests.conftest import write_char_tokenizer

PROMPT = [5, 6, 7, 8]
# The core's prompt-logprob rows for positions 1..3 with prompt_logprobs=2: column 0 is the prompt
# token's own logprob, then the top 2; `ranks` is each prompt token's rank.
ROWS = LogprobsArrays(logprobs=np.array([[-3.0, -0.5, -1.5], [-0.25, -0.25, -2.0], [-1.0, -0.75, -1.0]], np.float32),
                      token_ids=np.array([[6, 10, 11], [7, 7, 12], [8, 13, 8]], np.int32),
                      ranks=np.array([4, 1, 2], np.int32))
EXPECTED = [None,
            {6: Logprob(-3.0, 4), 10: Logprob(-0.5, 1), 11: Logprob(-1.5, 2)},
            {7: Logprob(-0.25, 1), 12: Logprob(-2.0, 2)},  # the prompt token is the top one
            {8: Logprob(-1.0, 2), 13: Logprob(-0.75, 1)}]  # ... the second


def rows(start: int, stop: int) -> LogprobsArrays:
    return LogprobsArrays(ROWS.logprobs[start:stop], ROWS.token_ids[start:stop], ROWS.ranks[start:stop])


def params(kind=RequestOutputKind.CUMULATIVE, **kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 3, "prompt_logprobs": 2, "output_kind": kind, **kwargs})


def feed(processor: OutputProcessor, *outputs: EngineCoreOutput):
    """What the processor makes of one step's core outputs."""
    return processor.process_outputs(list(outputs), time.monotonic())[0]


def one_request(sampling_params: SamplingParams, tokenizer=None, prompt=PROMPT) -> OutputProcessor:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, prompt, sampling_params, time.monotonic())
    return processor


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("char_tokenizer")
    write_char_tokenizer(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


# -- prompt logprobs ------------------------------------------------------------

def test_prompt_logprobs_are_none_then_one_dict_per_prompt_token_ranked_as_sample_logprobs():
    processor = one_request(params())
    (out,) = feed(processor, EngineCoreOutput("r", [20], new_prompt_logprobs=ROWS))
    assert out.prompt_logprobs == EXPECTED
    assert [out.outputs[0].token_ids] == [[20]]


def test_prompt_logprobs_of_several_prefill_chunks_come_out_once_the_prompt_is_done():
    processor = one_request(params())
    assert feed(processor, EngineCoreOutput("r", [], new_prompt_logprobs=rows(0, 2))) == []
    (out,) = feed(processor, EngineCoreOutput("r", [20], new_prompt_logprobs=rows(2, 3)))
    assert out.prompt_logprobs == EXPECTED


def test_a_prompt_done_before_its_first_token_is_told_at_once():
    processor = one_request(params())
    (out,) = feed(processor, EngineCoreOutput("r", [], new_prompt_logprobs=ROWS))
    assert out.prompt_logprobs == EXPECTED and out.outputs[0].token_ids == [] and not out.finished


def test_delta_outputs_carry_the_prompt_logprobs_once_and_a_merge_keeps_them():
    processor = one_request(params(RequestOutputKind.DELTA))
    first, second, third = (feed(processor, co)[0] for co in [
        EngineCoreOutput("r", [20], new_prompt_logprobs=ROWS), EngineCoreOutput("r", [21]),
        EngineCoreOutput("r", [22], finish_reason="length")])
    assert first.prompt_logprobs == EXPECTED
    assert second.prompt_logprobs is None and third.prompt_logprobs is None
    first.add(second, aggregate=True)
    first.add(third, aggregate=True)
    assert first.prompt_logprobs == EXPECTED and first.outputs[0].token_ids == [20, 21, 22]


def test_cumulative_outputs_carry_the_prompt_logprobs_in_every_output_after_the_prompt():
    processor = one_request(params())
    outs = [feed(processor, co)[0] for co in [EngineCoreOutput("r", [20], new_prompt_logprobs=ROWS),
                                             EngineCoreOutput("r", [21], finish_reason="length")]]
    assert [o.prompt_logprobs for o in outs] == [EXPECTED, EXPECTED]


def test_the_final_only_output_carries_the_prompt_logprobs():
    processor = one_request(params(RequestOutputKind.FINAL_ONLY))
    assert feed(processor, EngineCoreOutput("r", [20], new_prompt_logprobs=ROWS)) == []
    (out,) = feed(processor, EngineCoreOutput("r", [21], finish_reason="length"))
    assert out.prompt_logprobs == EXPECTED


def test_requests_without_prompt_logprobs_have_none():
    processor = one_request(params(prompt_logprobs=None))
    (out,) = feed(processor, EngineCoreOutput("r", [20]))
    assert out.prompt_logprobs is None


def test_prompt_logprobs_decode_each_token_alone(char_tokenizer):
    prompt = char_tokenizer.encode("abcd", add_special_tokens=False)
    processor = one_request(params(), char_tokenizer, prompt)
    ids = np.array([[prompt[1], prompt[0]], [prompt[2], prompt[2]], [prompt[3], prompt[1]]], np.int32)
    new = LogprobsArrays(np.full(ids.shape, -1.0, np.float32), ids, np.array([2, 1, 2], np.int32))
    (out,) = feed(processor, EngineCoreOutput("r", [prompt[0]], new_prompt_logprobs=new))
    assert [{t: lp.decoded_token for t, lp in d.items()} for d in out.prompt_logprobs[1:]] == [
        {prompt[1]: "b", prompt[0]: "a"}, {prompt[2]: "c"}, {prompt[3]: "d", prompt[1]: "b"}]


def n_samples(kind: RequestOutputKind) -> OutputProcessor:
    processor = OutputProcessor(None)
    parent = ParentRequest("p", params(kind, n=2), time.monotonic())
    for index, child_id in enumerate(parent.child_ids):
        processor.add_request(child_id, None, PROMPT, parent.child_params(index), parent.metrics.arrival_time,
                              parent, index)
    return processor


def test_n_samples_carry_child_0s_prompt_logprobs_once_in_delta_outputs():
    processor = n_samples(RequestOutputKind.DELTA)
    other = LogprobsArrays(ROWS.logprobs - 1.0, ROWS.token_ids, ROWS.ranks)  # child 1's: not used
    child_1, child_0 = feed(processor, EngineCoreOutput("1_p", [30], new_prompt_logprobs=other),
                            EngineCoreOutput("0_p", [20], new_prompt_logprobs=ROWS))
    assert child_1.prompt_logprobs is None  # child 0's prompt was not done yet
    assert child_0.prompt_logprobs == EXPECTED
    later = feed(processor, EngineCoreOutput("1_p", [31], finish_reason="length"),
                 EngineCoreOutput("0_p", [21], finish_reason="length"))
    assert [o.prompt_logprobs for o in later] == [None, None]


def test_n_samples_final_output_carries_child_0s_prompt_logprobs():
    processor = n_samples(RequestOutputKind.FINAL_ONLY)
    assert feed(processor, EngineCoreOutput("0_p", [20], new_prompt_logprobs=ROWS),
                EngineCoreOutput("1_p", [30], finish_reason="length")) == []
    (out,) = feed(processor, EngineCoreOutput("0_p", [21], finish_reason="length"))
    assert out.request_id == "p" and out.prompt_logprobs == EXPECTED
    assert [o.token_ids for o in out.outputs] == [[20, 21], [30]]


def test_more_prompt_logprob_rows_than_prompt_positions_ends_the_request_with_an_error():
    processor = one_request(params(), prompt=PROMPT[:3])
    (out,) = feed(processor, EngineCoreOutput("r", [20], new_prompt_logprobs=ROWS))
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert "logprobs for 4 prompt positions of a 3-token prompt" in out.error
    assert not processor.has_unfinished_requests()


# -- detokenize, spaces_between_special_tokens ------------------------------------

def test_detokenize_false_gives_token_ids_without_text_or_decoded_tokens(char_tokenizer):
    prompt = char_tokenizer.encode("ab", add_special_tokens=False)
    new_ids = char_tokenizer.encode("cd", add_special_tokens=False)
    sample = LogprobsArrays(np.full((2, 1), -0.5, np.float32), np.array([[t] for t in new_ids], np.int32),
                            np.array([1, 1], np.int32))
    texts = {}
    for detokenize in (True, False):
        processor = one_request(params(detokenize=detokenize, logprobs=0, prompt_logprobs=None), char_tokenizer,
                                prompt)
        (out,) = feed(processor, EngineCoreOutput("r", new_ids, new_logprobs=sample))
        completion = out.outputs[0]
        assert completion.token_ids == new_ids
        texts[detokenize] = completion.text, [lp.decoded_token for d in completion.logprobs for lp in d.values()]
    assert texts == {True: ("cd", ["c", "d"]), False: ("", [None, None])}


@pytest.fixture(scope="module")
def word_piece_tokenizer():
    """A WordPiece tokenizer, whose decoder puts a space before every word, special ones too."""
    tokenizer = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "b": 2, "##c": 3, "[X]": 4, "[Y]": 5},
                                           unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(["[X]", "[Y]"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("spaces, skip, text", [
    (True, False, " [X] [Y] bc [Y]"),
    (False, False, " [X][Y] bc [Y]"),  # only an added token right after another loses its space
    (False, True, " bc"),              # skipped special tokens leave nothing to space
])
def test_spaces_between_special_tokens(word_piece_tokenizer, spaces, skip, text):
    processor = one_request(params(spaces_between_special_tokens=spaces, skip_special_tokens=skip,
                                   prompt_logprobs=None), word_piece_tokenizer, [1])
    (out,) = feed(processor, EngineCoreOutput("r", [4, 5, 2, 3, 5]))
    assert out.outputs[0].text == text


# -- num_cached_tokens, metrics -----------------------------------------------------

def test_num_cached_tokens_comes_from_the_core_and_stays():
    processor = one_request(params(prompt_logprobs=None))
    outs = [feed(processor, co)[0] for co in [EngineCoreOutput("r", [20], num_cached_tokens=16),
                                             EngineCoreOutput("r", [21], finish_reason="length")]]
    assert [o.num_cached_tokens for o in outs] == [16, 16]


def test_metrics_say_when_the_request_was_scheduled_and_finished():
    processor = OutputProcessor(None)
    arrival = time.monotonic()
    processor.add_request("r", None, PROMPT, params(prompt_logprobs=None), arrival)
    (first,) = processor.process_outputs([EngineCoreOutput("r", [20], first_scheduled_time=arrival + 0.25)],
                                         arrival + 0.5)[0]
    before_finish = time.monotonic()
    (last,) = processor.process_outputs([EngineCoreOutput("r", [21], finish_reason="length")], arrival + 0.75)[0]
    m = first.metrics
    assert (m.first_scheduled_time, m.time_in_queue, m.first_token_time, m.last_token_time, m.finished_time) == (
        arrival + 0.25, pytest.approx(0.25), arrival + 0.5, arrival + 0.5, None)
    m = last.metrics
    assert (m.first_scheduled_time, m.first_token_time, m.last_token_time) == (arrival + 0.25, arrival + 0.5,
                                                                              arrival + 0.75)
    assert before_finish <= m.finished_time <= time.monotonic()
