"""N-gram drafts (prompt lookup decoding, vLLM's "ngram" method): find the latest earlier
place where the text's last n tokens occur, for the longest n in [prompt_lookup_min,
prompt_lookup_max], and propose the tokens that followed there. Costs one vectorized
comparison over the request's tokens per step; each request's tokens are kept in a
numpy array that grows with its output, so a step copies only its new tokens."""
import numpy as np

from jaxllm.request import Request
from jaxllm.speculative_config import SpeculativeConfig


class NgramProposer:
    num_lookahead_tokens = 0  # KV slots past a step's tokens that the proposer writes

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (its tokens, how many are set)

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens to follow the request's tokens ([] when no n-gram matches)."""
        if max_tokens <= 0:
            return []
        tokens = self._history(request)
        return propose_ngram(tokens, self.min_n, self.max_n, max_tokens)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def _history(self, request: Request) -> np.ndarray:
        array, count = self._tokens.get(request.request_id, (np.empty(0, np.int32), 0))
        n = request.num_tokens
        if n > len(array):
            grown = np.empty(max(2 * n, 64), np.int32)
            grown[:count] = array[:count]
            array = grown
        array[count:n] = request.token_ids(count, n)
        self._tokens[request.request_id] = (array, n)
        return array[:n]


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix of `tokens` [L]
    whose length is in [min_n, max_n]; at most max_tokens of them."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    # Ends of earlier copies of the last token, then of the last two, ... (each copy is followed by a token).
    ends = np.flatnonzero(tokens[:length - 1] == tokens[-1])
    n = 1
    while ends.size and n < max_n:
        longer = ends[(ends >= n) & (tokens[np.maximum(ends - n, 0)] == tokens[length - 1 - n])]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < min_n:
        return []
    start = int(ends[-1]) + 1
    return tokens[start:start + max_tokens].tolist()
