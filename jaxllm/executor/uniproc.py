"""UniprocExecutor: the engine core's one model runner, in its own process, over every local
device of the mesh (a single controller: JAX drives the devices from one thread)."""
from jaxllm.config import Config
from jaxllm.contracts.step import SchedulerOutput, TokenMasks
from jaxllm.worker.model_runner import ModelRunner
from jaxllm.worker.step_output import StepOutput


class UniprocExecutor:
    needs_heartbeat = False  # no other process waits on this one

    def __init__(self, config: Config, show_progress: bool = True, params=None):
        self.runner = ModelRunner(config, show_progress, params)
        self.runner.warm_up(show_progress)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def num_state_slots(self) -> int:
        return self.runner.kv_cache.num_state_slots

    @property
    def kv_layout(self):
        return self.runner.kv_layout

    def execute_model(self, sched: SchedulerOutput) -> StepOutput | None:
        """Dispatch a step (ModelRunner.execute_model): None when its sampling waits for token masks."""
        return self.runner.execute_model(sched)

    def sample_tokens(self, masks: TokenMasks) -> StepOutput:
        return self.runner.sample_tokens(masks)

    def collective_rpc(self, method: str, *args):
        """Call a method of every runner (here, the one); returns this host's result."""
        return getattr(self.runner, method)(*args)

    def describe(self) -> str:
        return self.runner.describe()

    def heartbeat(self) -> None:
        pass

    def shutdown(self) -> None:
        self.runner.shutdown()
