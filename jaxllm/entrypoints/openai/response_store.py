"""The responses kept for previous_response_id and GET /v1/responses/{id}: in memory, at most
`max_size` of them (`jaxllm serve --max-stored-responses`), the least recently used dropped
first. Nothing survives a restart, and replicas do not share them."""
import collections
import dataclasses


@dataclasses.dataclass
class StoredResponse:
    response: dict  # as GET gives it
    messages: list[dict]  # the conversation through this response's output, as chat messages (no instructions)


class ResponseStore:
    def __init__(self, max_size: int):
        self.max_size = max_size
        self._responses: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_size:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored
