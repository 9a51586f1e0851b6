"""ParentRequest: a request with n > 1 (parallel sampling), as vLLM v1 does it. The
front end fans it out into n ordinary child requests that share the prompt; the core
never sees the parent. The children's outputs come back under the parent's request id,
as one RequestOutput whose CompletionOutputs have index 0..n-1."""
import dataclasses

from jaxllm.outputs import CompletionOutput, RequestMetrics
from jaxllm.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams, arrival_time: float):
        self.request_id = request_id
        self.params = params
        self.metrics = RequestMetrics(arrival_time)  # the children's, shared: first token of any, last of all
        self.error: str | None = None  # the first error a child finished with
        self.child_ids = [f"{index}_{request_id}" for index in range(params.n)]  # vLLM's child ids
        self._unfinished = set(range(params.n))
        self._finals: list[CompletionOutput | None] = [None] * params.n  # FINAL_ONLY: gathered here

    def child_params(self, index: int) -> SamplingParams:
        """Child `index`'s params: n=1 and, when the parent has a seed, seed + index (vLLM's
        rule), so the n samples differ and each is what a lone request with that seed
        gives. Without a seed each child draws a seed of its own, as any request does."""
        seed = self.params.seed
        if seed is not None:
            seed = (seed + index) % 2**63  # stays in the seed's range
        return dataclasses.replace(self.params, n=1, seed=seed)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def add_output(self, completion: CompletionOutput, error: str | None) -> list[CompletionOutput]:
        """The CompletionOutputs the parent's RequestOutput carries after this child's
        news: while streaming (DELTA, CUMULATIVE), the child's own; with FINAL_ONLY, all
        n in index order once the last child has finished, else none."""
        if completion.finished():
            self._unfinished.discard(completion.index)
            self.error = self.error or error
        if self.params.output_kind != RequestOutputKind.FINAL_ONLY:
            return [completion]
        self._finals[completion.index] = completion
        return list(self._finals) if self.finished else []
