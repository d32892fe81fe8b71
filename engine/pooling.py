"""From per-token hidden states to one vector per sequence: pooling, Matryoshka truncation, L2 norm,
and int8 output quantisation.

Works on packed batches with tensor ops only (no Python loop, no host sync), so it runs inside a
CUDA graph: CLS reads the row at each sequence's start, last-token the row before each end, and
mean sums rows by sequence with index_add. Padding tokens, if any, carry the sequence index
`slots` and land in a spare row that is dropped. Where pooling reads one row per sequence, the
engine has the model's last layer compute only those rows (prunes_last_layer, pooled_rows).
On a GPU the engine pools, truncates and normalises in one kernel instead
(engine.triton_kernels.pool_normalize), and uses finish only for int8 output; these are its reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import DenseLayer, load_weights, match_state_dict

POOLING_MODES = ("mean", "cls", "last")
# engine.checkpoint.DENSE_ACTIVATIONS, as functions
DENSE_FUNCTIONS = {"Tanh": torch.tanh, "Identity": nn.Identity(), "ReLU": F.relu, "GELU": F.gelu,
                   "Sigmoid": torch.sigmoid, "SiLU": F.silu}


def prunes_last_layer(mode: str, causal: bool) -> bool:
    """Whether a model's last layer may compute only the pooled rows (pooled_rows).

    True where pooling reads one row per sequence and that row's query sees its whole sequence:
    the last token (causal or not) or, without a causal mask, the first. Every layer still projects
    q, k and v for all tokens; the last one then skips the other rows' attention, output projection
    and feed-forward. On the H200 the cross-encoder's model time for 5 / 25 / 50
    pairs of 512 tokens went from 1.48 / 5.14 / 10.25 to 1.28 / 4.78 / 9.57 ms (run17, run20), and
    Qwen3-0.6B's last layer at one 4,096-token input ran attention for one query in 0.05 ms instead
    of 0.14 (run18).
    """
    return mode == "last" or (mode == "cls" and not causal)


def pooled_rows(cu_seqlens: torch.Tensor, mode: str, tokens: int) -> torch.Tensor:
    """The row each sequence's vector is read from under cls or last pooling, int64 [S], within [0, tokens)."""
    if mode == "cls":
        return cu_seqlens[:-1].long().clamp(max=tokens - 1)
    return (cu_seqlens[1:].long() - 1).clamp(min=0, max=tokens - 1)


def pool(hidden: torch.Tensor, seq_ids: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [T, H], seq_ids [T], cu_seqlens [S + 1] -> float32 [S, H]."""
    slots = cu_seqlens.numel() - 1
    if mode in ("cls", "last"):
        return hidden[pooled_rows(cu_seqlens, mode, hidden.shape[0])].float()
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


class DenseHead(nn.Module):
    """A model's sentence-transformers Dense modules, on pooled float32 vectors [S, H] (LaBSE's tanh
    projection, for one). They run in float32 whatever the model's dtype: one small matrix product per
    batch, inside the CUDA graph."""

    def __init__(self, layers: Sequence[DenseLayer], device: torch.device) -> None:
        super().__init__()
        self.linears = nn.ModuleList()
        self.activations = [DENSE_FUNCTIONS[layer.activation] for layer in layers]
        for layer in layers:
            weights = load_weights(layer.path)
            linear = nn.Linear(layer.in_features, layer.out_features, bias="linear.bias" in weights)
            linear.load_state_dict(match_state_dict(linear.state_dict(), weights, ("linear.",), (), "Dense"))
            self.linears.append(linear)
        self.requires_grad_(False)
        self.to(device=device, dtype=torch.float32)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        for linear, activation in zip(self.linears, self.activations):
            pooled = activation(linear(pooled))
        return pooled
