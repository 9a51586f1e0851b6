"""The runner's input is only the SchedulerOutput: hand-built steps, with no scheduler and no
Request, give the tokens the whole engine gives."""
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.contracts.step import NewRequestData, ScheduledRequest, SchedulerOutput
from jaxllm.worker.model_runner import ModelRunner
from tests.conftest import tiny_model

ENGINE = dict(model=tiny_model("llama"), skip_tokenizer_init=True, max_model_len=128, max_num_seqs=32,
              max_num_batched_tokens=128, num_gpu_blocks_override=40, block_size=16)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 40))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.mark.timeout(300)
def test_hand_built_steps_give_the_engines_greedy_tokens():
    with LLM(**ENGINE, enable_multiprocessing=False, show_progress=False) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                              use_tqdm=False)]
    runner = ModelRunner(EngineArgs(**ENGINE).create_config())
    new = [NewRequestData(f"r{i}", p, GREEDY, seed=i, stop_token_ids=[2]) for i, p in enumerate(PROMPTS)]
    blocks = [[[1]], [[2, 3]]]  # one block of 16 tokens for the first prompt, two for the second
    # Step 1: both prompts, each sampling its first token.
    prefill = SchedulerOutput([ScheduledRequest(f"r{i}", 0, len(p), p, blocks[i], True) for i, p in enumerate(PROMPTS)],
                              sum(map(len, PROMPTS)), new_requests=new, step_id=1)
    got = [list(t) for t in runner.execute_model(prefill).get_output().sampled_token_ids]
    # Steps 2 and 3: one token each; the first decode's token is still on the device when it is
    # dispatched (no ids known to the core), the second's is known.
    decode = SchedulerOutput([ScheduledRequest(f"r{i}", len(p), 1, [], [[]], True) for i, p in enumerate(PROMPTS)],
                             2, step_id=2)
    for i, t in enumerate(runner.execute_model(decode).get_output().sampled_token_ids):
        got[i] += t
    known = SchedulerOutput([ScheduledRequest(f"r{i}", len(p) + 1, 1, [got[i][1]], [[]], True)
                             for i, p in enumerate(PROMPTS)], 2, step_id=3)
    for i, t in enumerate(runner.execute_model(known).get_output().sampled_token_ids):
        got[i] += t
    runner.shutdown()
    assert got == want
