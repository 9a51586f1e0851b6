"""Each request's sampling parameters reach the sampler through the engine (the request's
sampling row, the runner's rows, the step's unpacking): the engine against its greedy self."""
import pytest

from jaxllm import LLM, SamplingParams
from tests.conftest import tiny_model

PROMPTS = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)]


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_model("llama"), skip_tokenizer_init=True, max_model_len=64, max_num_seqs=8,
             num_gpu_blocks_override=16, block_size=16, show_progress=False, enable_multiprocessing=False) as llm:
        yield llm


def generate(llm, temperature: float | list[float], **params) -> list[list[int]]:
    """Token ids of PROMPTS, request i seeded with i (at temperature[i], given a list)."""
    temperatures = temperature if isinstance(temperature, list) else [temperature] * len(PROMPTS)
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=t, max_tokens=8, ignore_eos=True, seed=i, **params)
                                  for i, t in enumerate(temperatures)], use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def test_a_temperature_near_zero_samples_the_greedy_tokens(llm):
    # Dividing by 1e-4 widens every logit gap 10**4 times: out of the Gumbel noise's reach, barring a near tie.
    assert generate(llm, 1e-4) == generate(llm, 0.0)


def test_temperature_one_samples_other_tokens_than_greedy(llm):
    greedy, sampled = generate(llm, 0.0), generate(llm, 1.0)
    assert all(s != g for s, g in zip(sampled, greedy))


def test_top_k_one_samples_the_greedy_tokens(llm):
    assert generate(llm, 1.0, top_k=1) == generate(llm, 0.0)


def test_greedy_and_sampled_requests_in_one_batch_draw_as_they_would_apart(llm):
    greedy, sampled = generate(llm, 0.0), generate(llm, 1.0)
    mixed = generate(llm, [0.0, 1.0, 0.0, 1.0])
    assert mixed == [greedy[0], sampled[1], greedy[2], sampled[3]]
