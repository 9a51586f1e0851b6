"""Token masks made on the host each step, for what depends on the tokens just generated:
a structured output's grammar (llguidance, jaxllm.structured_output) and bad words of
more than one token (the last token is masked while the output ends with the others).
A mask row is [ceil(vocab / 32)] int32, bit t % 32 of word t // 32 set where token t
is allowed; the sampler applies it on the device (processors.apply_processors).
"""
import logging

import numpy as np

logger = logging.getLogger(__name__)


def fill_request_bitmask(request, pending: list[int], row: np.ndarray) -> None:
    """Narrow `row` (all allowed on entry) for the request's next token. `pending`: the tokens
    sampled but not yet in request.output_token_ids (the previous step's, still in flight)."""
    if request.grammar is not None:
        grammar = request.grammar
        if not grammar.is_error():
            for token_id in request.output_token_ids[grammar.num_accepted:] + pending:
                if not grammar.accept_token(token_id):
                    # The mask forbade it, so only a bug gets here; the grammar then allows only EOS.
                    logger.error("request %s: the grammar rejected token %d (%s); only EOS is allowed now",
                                 request.request_id, token_id, grammar.error())
                    break
        grammar.fill_bitmask(row)
    if request.bad_word_sequences:
        longest = max(len(w) for w in request.bad_word_sequences)
        tail = request.output_token_ids[-(longest - 1):] + pending
        for word in request.bad_word_sequences:
            prefix = word[:-1]
            if tail[-len(prefix):] == prefix:
                forbid(row, word[-1])


def forbid(row: np.ndarray, token_id: int) -> None:
    bits = row.view(np.uint32)
    bits[token_id >> 5] &= ~np.uint32(1 << (token_id & 31))
