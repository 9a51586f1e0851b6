"""One bad request never fails another: token ids are checked at the boundary, and a request
whose host work fails in the engine core (its penalty rows, its token mask, a user's logits
processor, its update after the step) or in the front end (its text) ends alone with
finish_reason "error"; the requests beside it give the tokens they give alone."""
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.contracts.engine_core import EngineCoreRequest
from jaxllm.engine.output_processor import RequestState
from jaxllm.request import Request
from jaxllm.core import token_masks
from jaxllm.sample import processors
from jaxllm.sample.logits_processor import LogitsProcessor
from tests.engine.test_core_process import engine_args

pytestmark = pytest.mark.timeout(300)

VOCAB = 256  # the tiny Llama's
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
DOOMED = 1  # the index of the request each test breaks


class Explodes(LogitsProcessor):
    """Raises on joining for a request whose extra_args say {"explode": True}; else changes nothing."""

    def __init__(self, config):
        pass

    def update_state(self, batch_update):
        for added in batch_update.added:
            if (added.params.extra_args or {}).get("explode"):
                raise RuntimeError("this processor cannot take that request")

    def state(self, rows):
        return np.zeros(len(rows), np.int32)

    def apply(self, state, logits):
        return logits


@pytest.fixture(scope="module")
def llm(char_llama):
    with LLM(**vars(engine_args(char_llama, enable_multiprocessing=False, logits_processors=[Explodes])),
             show_progress=False) as llm:
        yield llm


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **kwargs})


@pytest.fixture(scope="module")
def alone(llm) -> list[list[int]]:
    """Each prompt's tokens in a batch of its own."""
    return [llm.generate({"prompt_token_ids": p}, params(), use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def run_together(llm, doomed_params: SamplingParams | None = None):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [doomed_params if i == DOOMED and doomed_params else params() for i in range(len(PROMPTS))],
                        use_tqdm=False)
    return [o.outputs[0] for o in outs], outs


def assert_only_the_doomed_failed(llm, alone, outputs, outs, message: str) -> None:
    for i, (c, expected) in enumerate(zip(outputs, alone)):
        if i == DOOMED:
            assert c.finish_reason == "error" and message in outs[i].error, (c, outs[i].error)
        else:
            assert (c.token_ids, c.finish_reason) == (expected, "length")
    stats = llm.llm_engine.get_stats()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("field, value", [("stop_token_ids", [60000]), ("allowed_token_ids", [3, 300]),
                                          ("logit_bias", {1000: 1.0})])
def test_an_id_outside_the_vocabulary_raises_naming_its_field(llm, field, value):
    with pytest.raises(ValueError, match=f"prompt 0: {field} holds token ids outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 2]}, params(min_tokens=2, **{field: value}), use_tqdm=False)


@pytest.mark.parametrize("field, value", [("stop_token_ids", [2**63]), ("top_k", 2**64), ("min_tokens", 2**70),
                                          ("logit_bias", {2**63: 1.0}), ("n", 10**400)])
def test_an_int_beyond_64_bits_raises_naming_its_field(field, value):
    kwargs = {"max_tokens": None} if field == "min_tokens" else {}
    with pytest.raises(ValueError, match=f"{field}.* must fit in 64 bits"):
        SamplingParams(**{field: value}, **kwargs)


def test_a_request_the_core_cannot_take_fails_alone(llm, alone):
    """A sender other than the front end (its checks skipped) with a stop id past the vocabulary:
    the core rejects it, and the requests beside it run on."""
    engine = llm.llm_engine
    bad = params(stop_token_ids=[VOCAB + 5], min_tokens=2)
    engine.output_processor.add_request("raw", None, PROMPTS[DOOMED], bad, 0.0)
    engine.engine_core.add_request(EngineCoreRequest("raw", PROMPTS[DOOMED], bad, (2,), 0, 0.0))
    for i in (0, 2):
        engine.add_request(f"ok-{i}", {"prompt_token_ids": PROMPTS[i]}, params())
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert done["raw"].outputs[0].finish_reason == "error"
    assert "stop_token_ids holds token ids outside the vocabulary" in done["raw"].error
    assert [done[f"ok-{i}"].outputs[0].token_ids for i in (0, 2)] == [alone[0], alone[2]]


def test_a_request_whose_penalty_rows_fail_ends_alone(llm, alone, monkeypatch):
    real = processors.request_state_rows

    def rows(prompt_token_ids, *args):
        if list(prompt_token_ids) == PROMPTS[DOOMED]:
            raise IndexError("index 60000 is out of bounds")
        return real(prompt_token_ids, *args)

    monkeypatch.setattr(processors, "request_state_rows", rows)
    outputs, outs = run_together(llm, params(repetition_penalty=1.2))
    assert_only_the_doomed_failed(llm, alone, outputs, outs, "logits processors: IndexError")


def test_a_request_whose_token_mask_fails_ends_alone(llm, alone, monkeypatch):
    def fail(request, row):
        raise RuntimeError("mask failed")

    monkeypatch.setattr(token_masks, "_mask_bad_words", fail)
    outputs, outs = run_together(llm, params(bad_words=["ab cd"]))
    assert_only_the_doomed_failed(llm, alone, outputs, outs, "token mask: RuntimeError: mask failed")


def test_a_logits_processor_that_fails_on_one_request_fails_that_request(llm, alone):
    outputs, outs = run_together(llm, params(extra_args={"explode": True}))
    assert_only_the_doomed_failed(llm, alone, outputs, outs, "logits processor Explodes: RuntimeError")


def test_a_request_whose_update_fails_ends_alone(llm, alone, monkeypatch):
    real = Request.check_stop

    def check_stop(self, max_model_len):
        if self.prompt_token_ids == PROMPTS[DOOMED] and self.num_output_tokens == 3:
            raise KeyError("lost")
        return real(self, max_model_len)

    monkeypatch.setattr(Request, "check_stop", check_stop)
    outputs, outs = run_together(llm)
    assert_only_the_doomed_failed(llm, alone, outputs, outs, "KeyError: 'lost'")


def test_a_request_whose_text_fails_ends_alone_in_the_front_end(llm, alone, monkeypatch):
    real = RequestState.append

    def append(self, token_ids, stop_terminated):
        if self.prompt_token_ids == PROMPTS[DOOMED] and len(self.token_ids) == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(self, token_ids, stop_terminated)

    monkeypatch.setattr(RequestState, "append", append)
    outputs, outs = run_together(llm)
    assert_only_the_doomed_failed(llm, alone, outputs, outs, "UnicodeDecodeError")


@pytest.mark.parametrize("field, value", [("temperature", 1e39), ("repetition_penalty", 1e300),
                                          ("logit_bias", {3: -1e39})])
def test_a_number_float32_cannot_hold_raises_naming_its_field(field, value):
    with pytest.raises(ValueError, match=rf"{field}.* must be a finite number within float32's range"):
        SamplingParams(**{field: value})
