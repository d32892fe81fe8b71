"""The similarity functions a sentence-transformers model names in its config (similarity_fn_name), over query
and document vectors: what `score` ranks by and serve's /rerank scores a bi-encoder's documents by.

Cosine (also for a model that names none, as sentence-transformers reads it), dot, and euclidean and manhattan as
minus the distance, as sentence-transformers' cos_sim, dot_score, euclidean_sim and manhattan_sim score. Each
pair's score is summed in float64 and rounded to float32, so that it is the same whatever the other vectors of
the call, and equal documents score equal. Multi-vector similarities (maxsim) are refused.
"""

from __future__ import annotations

import torch

from engine.checkpoint import ModelFiles
from engine.errors import UserError

SIMILARITIES = ("cosine", "dot", "euclidean", "manhattan")


def similarity_of(files: ModelFiles) -> str:
    """The model's similarity function by sentence-transformers' name; one of SIMILARITIES, else a UserError."""
    similarity = files.similarity or "cosine"
    if similarity not in SIMILARITIES:
        raise UserError(f"{files.name}: its similarity_fn_name {similarity!r} (config_sentence_transformers.json) "
                        f"is not one embedctl scores by ({', '.join(SIMILARITIES)}); use a single-vector model")
    return similarity


def pair_scores_of(similarity: str, queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """[queries, docs] float32 scores of every (query, document) pair by the named similarity."""
    if similarity == "cosine":
        queries, docs = unit(queries), unit(docs)
    if similarity in ("cosine", "dot"):
        return _products(queries, docs)
    p = 2.0 if similarity == "euclidean" else 1.0
    # Pair by pair, not through a matrix product, whose sums depend on the chunk's shape.
    return -torch.cdist(queries.double(), docs.double(), p=p, compute_mode="donot_use_mm_for_euclid_dist").float()


def unit(vectors: torch.Tensor) -> torch.Tensor:
    """Rows L2-normalised, in float32."""
    return torch.nn.functional.normalize(vectors.float(), dim=1)


def _products(queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """queries @ docs.T, summed in float64 and rounded to float32, so that a pair scores the same whatever
    the chunk's shape (but for a float64 sum within 1e-16 of a float32 rounding boundary: none in 1.28M
    pairs tried). A float32 product does not: BLAS sums a chunk's columns in orders that depend on its
    width and on the CPU, and a pair must score the same in every chunking (a streamed top-k equals the
    in-memory one) and equal documents equally (ties keep document order). It costs 1.4x a float32
    product on the CPU (256 x 4,096 x 384), small beside embedding the chunk, and about as much on an
    H200 (float64 there runs near float32's rate; on L4-class cards at 1/32 of it)."""
    return (queries.double() @ docs.double().T).float()
