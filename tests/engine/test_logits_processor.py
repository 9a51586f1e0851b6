"""Users' logits processors (EngineArgs.logits_processors, vLLM v1's interface in JAX):
the engine tells one which rows joined and left, runs its apply on every step, a request's
extra_args steer it, the others' tokens do not change, and nothing compiles after warm-up."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, EngineArgs, SamplingParams
from jaxllm.sample.logits_processor import BatchUpdate, LogitsProcessor
from tests.conftest import tiny_model
from tests.engine.test_core_process import engine_args

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("warm_up_every_engine")]


class ForceToken(LogitsProcessor):
    """Requests with extra_args {"force_token": t} sample only t."""

    def __init__(self, config):
        self.forced = np.full(config.scheduler.max_num_seqs, -1, np.int32)  # per row; -1: not forced
        self.updates: list[BatchUpdate] = []

    def update_state(self, batch_update):
        self.updates.append(batch_update)
        for row in batch_update.removed:
            self.forced[row] = -1
        for added in batch_update.added:
            self.forced[added.row] = (added.params.extra_args or {}).get("force_token", -1)

    def state(self, rows):
        return np.where(rows >= 0, self.forced[np.maximum(rows, 0)], -1)

    def apply(self, forced, logits):
        ids = jnp.arange(logits.shape[-1])[None, :]
        return jnp.where((forced[:, None] < 0) | (ids == forced[:, None]), logits, -jnp.inf)


@pytest.fixture(scope="module")
def llm():
    with LLM(**vars(engine_args(tiny_model("llama"), skip_tokenizer_init=True, enable_multiprocessing=False,
                                logits_processors=[ForceToken])), show_progress=False) as llm:
        yield llm


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_processor_steers_the_requests_that_ask_and_leaves_the_others(llm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, int(rng.integers(2, 40))).tolist() for _ in range(12)]
    plain = [SamplingParams(temperature=float(i % 2), seed=i, max_tokens=10, ignore_eos=True) for i in range(12)]
    steered = [SamplingParams(**{**vars(p), "extra_args": {"force_token": 7 + i}}) if i % 3 == 0 else p
               for i, p in enumerate(plain)]
    before = llm.llm_engine.get_stats()["num_compilations"]
    alone = generate(llm, prompts, plain)
    mixed = generate(llm, prompts, steered)
    assert llm.llm_engine.get_stats()["num_compilations"] == before
    for i, (a, m) in enumerate(zip(alone, mixed)):
        assert m == ([7 + i] * 10 if i % 3 == 0 else a)


def test_the_processor_hears_of_every_request_that_joins_and_leaves(llm):
    processor = llm.llm_engine.engine_core.core.executor.runner.processor_rows.users[0]
    processor.updates.clear()
    generate(llm, [[1, 2, 3]] * 5, SamplingParams(max_tokens=3, ignore_eos=True))
    generate(llm, [[4, 5]], SamplingParams(max_tokens=1))  # its step gives back the first five's rows
    added = [a for u in processor.updates for a in u.added]
    removed = [r for u in processor.updates for r in u.removed]
    assert len(added) == 6 and {a.row for a in added[:5]} <= set(removed)  # (the test before's rows too)
    assert all(a.prompt_token_ids == [1, 2, 3] and a.output_token_ids == [] for a in added[:5])


def test_a_processor_by_name_and_a_bad_one_at_engine_args():
    config = EngineArgs(model=tiny_model("llama"),
                        logits_processors=["tests.engine.test_logits_processor:ForceToken"]).create_config()
    assert config.logits_processors == (ForceToken,)
    with pytest.raises(ValueError, match="logits_processors: cannot import 'no.such:Thing'"):
        EngineArgs(model=tiny_model("llama"), logits_processors=["no.such:Thing"]).create_config()
    with pytest.raises(ValueError, match="is not a jaxllm LogitsProcessor subclass"):
        EngineArgs(model=tiny_model("llama"), logits_processors=[int]).create_config()
