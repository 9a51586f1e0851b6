"""Scoring with an embedding model, as vLLM's LLM.score and /score do for one: a pair's score is
the cosine similarity of its two texts' vectors. The texts pair 1:1, 1:N (the one first text
against each second one) or N:N."""
import numpy as np

from jaxllm.outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput

_EPS = 1e-8  # torch's CosineSimilarity's, as vLLM's scores: a norm below it counts as it


def check_score_inputs(num_1: int, num_2: int) -> None:
    """A ValueError naming text_1 or text_2 unless they pair as vLLM's do."""
    if num_1 == 0:
        raise ValueError("text_1 is empty: it must hold at least one text")
    if num_2 == 0:
        raise ValueError("text_2 is empty: it must hold at least one text")
    if num_1 > 1 and num_1 != num_2:
        raise ValueError(f"text_1 and text_2 must pair 1:1, 1:N or N:N, got {num_1} and {num_2} texts")


def cosine_scores(vectors_1: list[PoolingRequestOutput], vectors_2: list[PoolingRequestOutput],
                  pad_token_id: int | None) -> list[ScoringRequestOutput]:
    """One score per pair: the one of vectors_1 against each of vectors_2, or pair by pair."""
    if len(vectors_1) == 1:
        vectors_1 = vectors_1 * len(vectors_2)
    padding = [] if pad_token_id is None else [pad_token_id]
    scores = []
    for first, second in zip(vectors_1, vectors_2):
        a, b = first.outputs.data.astype(np.float64), second.outputs.data.astype(np.float64)
        score = float(a @ b) / (max(np.linalg.norm(a), _EPS) * max(np.linalg.norm(b), _EPS))
        scores.append(ScoringRequestOutput(f"{first.request_id}_{second.request_id}", ScoringOutput(score),
                                           first.prompt_token_ids + padding + second.prompt_token_ids))
    return scores
