"""Qwen3 decoder embedders (Qwen3-Embedding, pplx-embed-v1) over packed token streams.

The same flat stream of T tokens from many sequences as engine.models.bert, with no padding; the
engine's `attend` keeps attention inside each sequence, causal or bidirectional as the model's
config says (`causal`). A layer is pre-norm: RMSNorm, grouped-query attention with per-head RMSNorm
on q and k before rotary embeddings, RMSNorm, SwiGLU. Rotary angles are computed from the
within-sequence positions inside the model (so inside a CUDA graph), in float32 as transformers
does. Parameter names are Hugging Face's (Qwen3Model, or Qwen3ForCausalLM under "model."); after
loading, q/k/v and gate/up are fused so each layer runs two GEMMs fewer, and the output
projections add the residual themselves (_add_linear).
Not here: pooling, output quantisation, prompts, tokenization, reading files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import Attention, flashinfer_available
from engine.checkpoint import match_state_dict
from engine.errors import UserError

# Checkpoints saved from Qwen3ForCausalLM nest the model under "model." and add an lm_head that an
# embedder never reads (tied or not).
PREFIXES = ("model.",)
UNUSED = ("lm_head.",)


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    causal: bool

    @classmethod
    def from_hf(cls, config: dict) -> Qwen3Config:
        if config.get("hidden_act", "silu") != "silu":
            raise UserError(f"activation {config['hidden_act']!r} is not supported for Qwen3; only silu")
        if config.get("use_sliding_window"):
            raise UserError("sliding-window attention (use_sliding_window) is not supported; embedctl runs full attention")
        # transformers 5 writes rope_parameters; checkpoints from 4.x write rope_theta and rope_scaling.
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UserError(f"rope type {rope_type!r} is not supported; embedctl runs default rotary embeddings")
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            attention_bias=bool(config.get("attention_bias", False)), causal=is_causal(config),
        )


def is_causal(config: dict) -> bool:
    """Causal unless the config says bidirectional.

    pplx-embed-v1 (model_type bidirectional_pplx_qwen3) is bidirectional by its modeling code, not
    by a config key. Other checkpoints say so with transformers' own `is_causal: false` (which
    its masking honours) or EmbeddingGemma's `use_bidirectional_attention: true`.
    """
    if config.get("model_type") == "bidirectional_pplx_qwen3" or config.get("use_bidirectional_attention"):
        return False
    return bool(config.get("is_causal", True))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32, cast back before the weight: transformers' Qwen3RMSNorm, step for step.
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _add_linear(residual: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """residual + linear(x), summed by the GEMM itself into the residual's memory (beta = 1).

    Against a GEMM and then an add + RMSNorm kernel, the norm that follows reads one tensor and
    writes one instead of reading two and writing two, while the GEMM reads the residual once: 8 MB
    less memory traffic per sublayer at 4,096 tokens, and one kernel launch less. Without a bias
    the sum is rounded once, from float32, where transformers rounds the projection and then the sum.
    """
    residual.addmm_(x, linear.weight.t())
    if linear.bias is not None:
        residual.add_(linear.bias)
    return residual


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, eps: float, heads: int,
                  kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused projection into q, k, v [T, heads, d]; RMSNorm then rotate q and k."""
    tokens, head_dim = qkv.shape[0], q_weight.shape[0]
    q, k, v = qkv.view(tokens, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rotate(_rms_norm(q, q_weight, eps), cos, sin), _rotate(_rms_norm(k, k_weight, eps), cos, sin), v


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Qwen3Ops:
    """The elementwise steps of a layer, each one kernel on a GPU; plain torch on the CPU.

    On a GPU most are compiled with torch.compile (see engine.fused for why and when). Two are not,
    because Inductor's kernels, compiled once with dynamic shapes so that every bucket shares them,
    came out slow (bench/results/gpu-2026-11-30-run11-qwen3): the q/k norm + rotary runs as the
    Triton kernel of engine.triton_kernels (Inductor: 0.122 ms at 4,096 tokens, 0.071 when compiled
    for that one shape), and SwiGLU as FlashInfer's silu_and_mul where FlashInfer is installed
    (0.018 ms at 4,096 tokens and 0.072 at 16,384 against Inductor's 0.052 and 0.201), each as exact.
    """

    def __init__(self, compile: bool, head_dim: int = 0) -> None:
        wrap = (lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)) if compile else (lambda fn: fn)
        self.rms_norm = wrap(_rms_norm)
        self.qk_norm_rope = _triton_qk_norm_rope() if compile and _power_of_two(head_dim) else wrap(_qk_norm_rope)
        self.silu_mul = _flashinfer_silu_mul() if compile and flashinfer_available() else wrap(_silu_mul)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0  # the Triton kernel tiles a power-of-two head


def _triton_qk_norm_rope() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    from engine.triton_kernels import qk_norm_rope

    return qk_norm_rope


def _flashinfer_silu_mul() -> Callable[[torch.Tensor], torch.Tensor]:
    from flashinfer.activation import silu_and_mul

    return silu_and_mul


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for within-sequence positions, computed in float32 like transformers."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Qwen3RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        hidden, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(d, config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, config.rms_norm_eps)


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv: nn.Linear | None = None
        self.gate_up: nn.Linear | None = None

    def fuse(self) -> None:
        """Replace q/k/v by one projection and gate/up by another: two GEMMs instead of five."""
        attn, mlp = self.self_attn, self.mlp
        self.qkv = _concat_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        self.gate_up = _concat_linears(mlp.gate_proj, mlp.up_proj)
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attention,
                  ops: Qwen3Ops, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention's context for every token, or with `rows` for those rows only (attend.pooled):
        [T or S, heads, head_dim], before the output projection."""
        attn = self.self_attn
        q, k, v = ops.qk_norm_rope(self.qkv(x), attn.q_norm.weight, attn.k_norm.weight, cos, sin,
                                   attn.q_norm.eps, self.heads, self.kv_heads)
        return attend(q, k, v) if rows is None else attend.pooled(q[rows], k, v)


class Qwen3Model(nn.Module):
    """token ids [T], positions [T] -> final-normed hidden states [T, hidden_size] (last_hidden_state),
    or with `rows` [S] those rows' only [S, hidden_size], the last layer computing no others."""

    num_labels = 0  # an embedder; Qwen3 cross-encoders are not supported

    def __init__(self, config: Qwen3Config, ops: Qwen3Ops | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops = ops or Qwen3Ops(compile=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def causal(self) -> bool:
        return self.config.causal

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face state dict by name; a missing or unknown tensor is an error, never random."""
        self.load_state_dict(match_state_dict(self.state_dict(), weights, PREFIXES, UNUSED, "Qwen3"))
        for layer in self.layers:
            layer.fuse()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attend: Attention, rows: torch.Tensor | None = None) -> torch.Tensor:
        ops, eps = self.ops, self.config.rms_norm_eps
        hidden = self.embed_tokens(input_ids)
        cos, sin = rotary(position_ids, self.config.head_dim, self.config.rope_theta, hidden.dtype)
        x = ops.rms_norm(hidden, self.layers[0].input_layernorm.weight, eps)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for index, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            last_rows = rows if index == len(self.layers) - 1 else None
            context = layer.attention(x, cos, sin, attend, ops, last_rows)
            if last_rows is not None:
                hidden = hidden[last_rows]
            hidden = _add_linear(hidden, context.flatten(1), layer.self_attn.o_proj)
            x = ops.rms_norm(hidden, layer.post_attention_layernorm.weight, eps)
            hidden = _add_linear(hidden, ops.silu_mul(layer.gate_up(x)), layer.mlp.down_proj)
            x = ops.rms_norm(hidden, next_norm.weight, eps)
        return x


def _concat_linears(*parts: nn.Linear) -> nn.Linear:
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused
