"""The core's side of a drafter on the device (a draft model, an EAGLE head, n-gram lookup under
asynchronous scheduling): the drafts the runner made for each request at the end of its last step
(ModelRunnerOutput.draft_token_ids), kept until the request is scheduled again; while a step of the
request is in flight, the drafts it is making on the device (DRAFT_ON_DEVICE: asynchronous
scheduling), as many as its last drafts that landed (n-gram lookup finds fewer than k, or none,
where the text does not repeat; a draft model always k). The runner writes the drafter's KV for
positions after the tokens a step takes (a draft model's k drafting steps at k of them, an EAGLE
head's k - 1 at k - 1: its first draft comes from the step's own tokens), so the scheduler reserves
that many slots more per request (`num_lookahead_tokens`)."""
from jaxllm.contracts.step import DRAFT_ON_DEVICE, NO_DRAFT
from jaxllm.request import Request


class RunnerDrafts:
    def __init__(self, num_lookahead_tokens: int):
        self.num_lookahead_tokens = num_lookahead_tokens
        self._drafts: dict[str, list[int]] = {}  # request id -> the drafts for after its last token

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        drafts = self._drafts.get(request.request_id)
        if request.num_output_placeholders:  # its step in flight is making its drafts: as many as it made last
            return [DRAFT_ON_DEVICE] * (max_tokens if drafts is None else min(max_tokens, len(drafts)))
        return (drafts or [])[:max(max_tokens, 0)]

    def take(self, request_id: str, drafts: list[int]) -> None:
        """The drafts the runner made for after the request's last token (replacing older ones), up to the
        first NO_DRAFT (n-gram lookup's)."""
        self._drafts[request_id] = drafts[:drafts.index(NO_DRAFT)] if NO_DRAFT in drafts else drafts

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
