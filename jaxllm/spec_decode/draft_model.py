"""The core's side of a draft model or an EAGLE head: the drafts the runner made for each request
at the end of its last step (ModelRunnerOutput.draft_token_ids), kept until the request is
scheduled again; while a step of the request is in flight, the drafts it is making on the device
(DRAFT_ON_DEVICE: asynchronous scheduling). The runner writes the drafter's KV for positions after
the tokens a step takes (a draft model's k drafting steps at k of them, an EAGLE head's k - 1 at
k - 1: its first draft comes from the step's own tokens), so the scheduler reserves that many slots
more per request (`num_lookahead_tokens`)."""
from jaxllm.contracts.step import DRAFT_ON_DEVICE
from jaxllm.request import Request


class RunnerDrafts:
    def __init__(self, num_lookahead_tokens: int):
        self.num_lookahead_tokens = num_lookahead_tokens
        self._drafts: dict[str, list[int]] = {}  # request id -> the drafts for after its last token

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        if request.num_output_placeholders:  # its step in flight makes num_speculative_tokens drafts: the first ones
            return [DRAFT_ON_DEVICE] * max_tokens
        return self._drafts.get(request.request_id, [])[:max(max_tokens, 0)]

    def take(self, request_id: str, drafts: list[int]) -> None:
        """The drafts the runner made for after the request's last token (replacing older ones)."""
        self._drafts[request_id] = drafts

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
