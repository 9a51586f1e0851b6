"""Speculative decoding: the proposers that guess a request's next tokens (its drafts).

The scheduler asks for drafts when it schedules a decoding request, schedules them
with the request's next token, and the step's forward scores every draft position at
once; the runner keeps the run of drafts the model's own samples agree with, and the
token after it (worker/model_runner.py)."""


def make_proposer(config):
    """The proposer of config.speculative (a Config), or None without speculative decoding."""
    if config.speculative is None:
        return None
    from jaxllm.spec_decode.ngram import NgramProposer
    return NgramProposer(config.speculative)
