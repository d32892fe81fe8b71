"""From per-token hidden states to one vector per sequence: pooling, Matryoshka truncation, L2 norm,
and int8 output quantisation.

Works on packed batches with tensor ops only (no Python loop, no host sync), so it runs inside a
CUDA graph: CLS reads the row at each sequence's start, last-token the row before each end, and
mean sums rows by sequence with index_add. Padding tokens, if any, carry the sequence index
`slots` and land in a spare row that is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOLING_MODES = ("mean", "cls", "last")


def pool(hidden: torch.Tensor, seq_ids: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [T, H], seq_ids [T], cu_seqlens [S + 1] -> float32 [S, H]."""
    slots = cu_seqlens.numel() - 1
    last_row = hidden.shape[0] - 1
    if mode == "cls":
        return hidden[cu_seqlens[:-1].long().clamp(max=last_row)].float()
    if mode == "last":
        return hidden[(cu_seqlens[1:].long() - 1).clamp(min=0, max=last_row)].float()
    sums = torch.zeros(slots + 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seq_ids.long(), hidden.float())
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).clamp(min=1).unsqueeze(1)
    return sums[:slots] / lengths


def finish(pooled: torch.Tensor, dim: int | None, normalize: bool, quantization: str | None = None) -> torch.Tensor:
    """Keep the first `dim` components, then L2-normalise if asked, then quantise if the model says so.

    "int8" is pplx-embed's output: round(tanh(x) * 127), whole numbers in [-127, 127], returned as
    float32 (exact) so the readback path stays one dtype; the engine casts them to int8.
    """
    if dim is not None:
        pooled = pooled[:, :dim]
    if normalize:
        pooled = F.normalize(pooled, dim=-1)
    if quantization == "int8":
        pooled = torch.round(torch.tanh(pooled) * 127)
    return pooled
