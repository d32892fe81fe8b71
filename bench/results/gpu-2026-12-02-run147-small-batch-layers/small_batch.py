"""BERT layers for batches of at most SMALL_BATCH_TOKENS tokens, in two Triton kernels a layer.

A lone query is where every launch counts. Through the per-operation path a MiniLM layer at 16
tokens is seven or eight kernels (QKV GEMM, attention, output GEMM, LayerNorm, up GEMM with GELU,
down GEMM, LayerNorm, a split-K reduction now and then), each 1.6-3.4 us of work and about a
microsecond of gap before the next, on a GPU that the layer's 3.5 MB of weights would keep busy
for under two (bench/results/gpu-2026-12-01-run130-breakdown-bert-peers: 47 kernels, 120 us of
kernels in a 196 us step). Here a layer is two kernels:

- attention_block: one program per head computes that head's q, k and v for every token, its
  attention (a batch this small is one tile, so a sequence's keys are picked by comparing sequence
  ids, padding never attended) and its share of the output projection;
- mlp_block: one program per MLP_COLUMNS columns of the intermediate layer computes them with
  bias and GELU, and their share of the down projection.

Each program's share of the projection is a partial sum over the hidden size for every token: the
programs add theirs into a scratch buffer with atomics, and the last program to finish (an atomic
counter says which) adds the bias and the residual, normalises each token, overwrites the residual
stream with the result and clears the scratch for the next kernel. The partial sums are added as
fixed-point integers (FIXED_POINT_SCALE), so their order, which the hardware picks, cannot change
the sum: a replayed graph gives the bits its capture gave. Rounding follows the per-operation
path's: q, k, v, the attention output and the GELU output are rounded to the model's dtype, and so
is the residual sum before the bias joins it in the LayerNorm's float32 arithmetic.

Only the rows of real tokens are computed: the kernels read the batch's token count from the end
of its cu_seqlens on the device, so a graph captured for a 64-token bucket does no work for its
padding, and an eager run of the exact batch computes the same rows in the same way.
GPU only: the engine imports this module where triton is installed, and uses it for BERT-family
models whose shape it covers (supports()).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from engine.models.bert import BertConfig, BertLayer

SMALL_BATCH_TOKENS = 64
# Hidden columns a program reads or writes at once, and intermediate columns per mlp_block program.
CHUNK = 64
MLP_COLUMNS = 64
# Partial sums are added as integers of 2^-24: finer than float32 keeps of values of 1 or more, and
# int64 holds sums up to 5e11, far beyond any activation.
FIXED_POINT_SCALE = tl.constexpr(float(1 << 24))
# Rows the last program normalises at a time: a whole row block of 64 x 1,024 float32 would spill registers.
FINISH_ROWS = 16


def supports(config: BertConfig) -> bool:
    """Whether these kernels cover a BERT-family shape: hidden sizes and head dims the tiles divide,
    and the GELU the per-operation path computes in its GEMM epilogue (tanh form)."""
    from engine.fused import GELUS

    return (config.hidden_act in GELUS and config.hidden_size % CHUNK == 0 and config.head_dim in (16, 32, 64, 128)
            and config.intermediate_size % MLP_COLUMNS == 0 and config.hidden_size <= 4096)


@triton.jit
def _finish(acc_ptr, counter_ptr, x_ptr, bias_ptr, norm_weight_ptr, norm_bias_ptr, tokens, eps,
            HIDDEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    """The last program's part: x = LayerNorm(round(acc + x) + bias) for the real rows; acc and counter cleared."""
    cols = tl.arange(0, BLOCK_H)
    kept = cols < HIDDEN
    bias = tl.load(bias_ptr + cols, mask=kept, other=0.0).to(tl.float32)
    weight = tl.load(norm_weight_ptr + cols, mask=kept, other=0.0).to(tl.float32)
    shift = tl.load(norm_bias_ptr + cols, mask=kept, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    for first in tl.static_range(0, BLOCK_T, ROWS):
        rows = first + tl.arange(0, ROWS)
        where = rows[:, None] * HIDDEN + cols[None, :]
        mask = (rows < tokens)[:, None] & kept[None, :]
        # .cg: straight from L2, where the other programs' atomics landed; this SM's L1 may hold old lines.
        summed = tl.load(acc_ptr + where, mask=mask, other=0, cache_modifier=".cg").to(tl.float32) / FIXED_POINT_SCALE
        residual = tl.load(x_ptr + where, mask=mask, other=0.0).to(tl.float32)
        value = (summed + residual).to(dtype).to(tl.float32) + bias[None, :]
        mean = tl.sum(value, 1) / HIDDEN
        centred = tl.where(mask, value - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, 1) / HIDDEN + eps)
        tl.store(x_ptr + where, (centred * rstd[:, None] * weight[None, :] + shift[None, :]).to(dtype), mask=mask)
        tl.store(acc_ptr + where, tl.zeros([ROWS, BLOCK_H], tl.int64), mask=mask)
    tl.store(counter_ptr, 0)


@triton.jit
def _add_partial(acc_ptr, partial, rows, cols, live, HIDDEN: tl.constexpr):
    fixed = (partial * FIXED_POINT_SCALE).to(tl.int64)
    tl.atomic_add(acc_ptr + rows[:, None] * HIDDEN + cols[None, :], fixed, mask=live[:, None], sem="relaxed")


@triton.jit
def _last_program(counter_ptr, programs):
    """Whether this program is the last to reach here; its writes before are then everyone's."""
    tl.debug_barrier()  # every thread's atomics are issued before the counter's release
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel") == programs - 1


@triton.jit
def _attention_block_kernel(x_ptr, seq_ids_ptr, tokens_ptr, qkv_weight_ptr, qkv_bias_ptr, out_weight_ptr,
                            out_bias_ptr, norm_weight_ptr, norm_bias_ptr, acc_ptr, counter_ptr, eps, scale_log2,
                            HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_H: tl.constexpr, CHUNK_: tl.constexpr, ROWS: tl.constexpr):
    head = tl.program_id(0)
    tokens = tl.load(tokens_ptr)
    rows = tl.arange(0, BLOCK_T)
    live = rows < tokens
    dims = tl.arange(0, HEAD_DIM)
    dtype = x_ptr.dtype.element_ty
    q = tl.zeros([BLOCK_T, HEAD_DIM], tl.float32)
    k = tl.zeros([BLOCK_T, HEAD_DIM], tl.float32)
    v = tl.zeros([BLOCK_T, HEAD_DIM], tl.float32)
    # The fused QKV weight is [3 * HIDDEN, HIDDEN]: this head's query, key and value rows, transposed as read.
    q_rows = head * HEAD_DIM + dims
    for first in range(0, HIDDEN, CHUNK_):
        cols = first + tl.arange(0, CHUNK_)
        x = tl.load(x_ptr + rows[:, None] * HIDDEN + cols[None, :], mask=live[:, None], other=0.0)
        weights = qkv_weight_ptr + q_rows[None, :] * HIDDEN + cols[:, None]
        q = tl.dot(x, tl.load(weights), q)
        k = tl.dot(x, tl.load(weights + HIDDEN * HIDDEN), k)
        v = tl.dot(x, tl.load(weights + 2 * HIDDEN * HIDDEN), v)
    q = (q + tl.load(qkv_bias_ptr + q_rows).to(tl.float32)[None, :]).to(dtype)
    k = (k + tl.load(qkv_bias_ptr + HIDDEN + q_rows).to(tl.float32)[None, :]).to(dtype)
    v = (v + tl.load(qkv_bias_ptr + 2 * HIDDEN + q_rows).to(tl.float32)[None, :]).to(dtype)
    seq_ids = tl.load(seq_ids_ptr + rows, mask=live, other=-1)
    # A row sees the keys of its own sequence; a row past the real tokens sees itself only (and is never kept).
    visible = ((seq_ids[:, None] == seq_ids[None, :]) & live[None, :]) | (rows[:, None] == rows[None, :])
    scores = tl.where(visible, tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
    probabilities = tl.math.exp2(scores - tl.max(scores, 1)[:, None])
    context = (tl.dot(probabilities.to(dtype), v) / tl.sum(probabilities, 1)[:, None]).to(dtype)
    # This head's share of the output projection: context [T, d] times its d columns of the [HIDDEN, HIDDEN] weight.
    for first in range(0, HIDDEN, CHUNK_):
        cols = first + tl.arange(0, CHUNK_)
        out_weight = tl.load(out_weight_ptr + cols[None, :] * HIDDEN + q_rows[:, None])
        _add_partial(acc_ptr, tl.dot(context, out_weight), rows, cols, live, HIDDEN)
    if _last_program(counter_ptr, tl.num_programs(0)):
        _finish(acc_ptr, counter_ptr, x_ptr, out_bias_ptr, norm_weight_ptr, norm_bias_ptr, tokens, eps,
                HIDDEN, BLOCK_T, BLOCK_H, ROWS)


@triton.jit
def _gelu_tanh(x):
    # GELU's tanh form, as the per-operation path's cuBLASLt epilogue computes it; tanh(y) = 1 - 2 / (e^2y + 1).
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))


@triton.jit
def _mlp_block_kernel(x_ptr, tokens_ptr, up_weight_ptr, up_bias_ptr, down_weight_ptr, down_bias_ptr,
                      norm_weight_ptr, norm_bias_ptr, acc_ptr, counter_ptr, eps,
                      HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_H: tl.constexpr, CHUNK_: tl.constexpr, COLUMNS: tl.constexpr, ROWS: tl.constexpr):
    part = tl.program_id(0)
    tokens = tl.load(tokens_ptr)
    rows = tl.arange(0, BLOCK_T)
    live = rows < tokens
    dtype = x_ptr.dtype.element_ty
    inner = part * COLUMNS + tl.arange(0, COLUMNS)
    up = tl.zeros([BLOCK_T, COLUMNS], tl.float32)
    for first in range(0, HIDDEN, CHUNK_):
        cols = first + tl.arange(0, CHUNK_)
        x = tl.load(x_ptr + rows[:, None] * HIDDEN + cols[None, :], mask=live[:, None], other=0.0)
        up = tl.dot(x, tl.load(up_weight_ptr + inner[None, :] * HIDDEN + cols[:, None]), up)
    up = _gelu_tanh(up + tl.load(up_bias_ptr + inner).to(tl.float32)[None, :]).to(dtype)
    for first in range(0, HIDDEN, CHUNK_):
        cols = first + tl.arange(0, CHUNK_)
        down_weight = tl.load(down_weight_ptr + cols[None, :] * INTERMEDIATE + inner[:, None])
        _add_partial(acc_ptr, tl.dot(up, down_weight), rows, cols, live, HIDDEN)
    if _last_program(counter_ptr, tl.num_programs(0)):
        _finish(acc_ptr, counter_ptr, x_ptr, down_bias_ptr, norm_weight_ptr, norm_bias_ptr, tokens, eps,
                HIDDEN, BLOCK_T, BLOCK_H, ROWS)


class SmallBatch:
    """The two-kernel layers for one batch of at most SMALL_BATCH_TOKENS tokens: its sequence ids and
    token count on the device, and the scratch the kernels share (zeroed here once; each kernel's
    last program clears it for the next)."""

    max_tokens = SMALL_BATCH_TOKENS

    def __init__(self, seq_ids: torch.Tensor, real_tokens: torch.Tensor, hidden: int) -> None:
        self.seq_ids = seq_ids
        self.real_tokens = real_tokens  # int32 [1]: cu_seqlens' last entry
        self.scratch = torch.zeros(SMALL_BATCH_TOKENS * hidden + 1, dtype=torch.int64, device=seq_ids.device)
        self.acc, self.counter = self.scratch[1:], self.scratch[:1]

    def layer(self, layer: BertLayer, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for every real row of x [T, hidden] (T at most SMALL_BATCH_TOKENS), written into x."""
        tokens, hidden = x.shape
        assert tokens <= SMALL_BATCH_TOKENS and x.is_contiguous()
        head_dim = hidden // layer.heads
        attention_out, mlp_out = layer.attention.output, layer.output
        shared = dict(BLOCK_T=SMALL_BATCH_TOKENS, BLOCK_H=triton.next_power_of_2(hidden), CHUNK_=CHUNK,
                      ROWS=FINISH_ROWS, num_warps=4)
        _attention_block_kernel[(layer.heads,)](
            x, self.seq_ids, self.real_tokens, layer.qkv.weight, layer.qkv.bias, attention_out.dense.weight,
            attention_out.dense.bias, attention_out.LayerNorm.weight, attention_out.LayerNorm.bias, self.acc,
            self.counter, attention_out.LayerNorm.eps, 1.4426950408889634 / head_dim ** 0.5,
            HIDDEN=hidden, HEAD_DIM=head_dim, **shared)
        intermediate = layer.intermediate.dense.out_features
        _mlp_block_kernel[(intermediate // MLP_COLUMNS,)](
            x, self.real_tokens, layer.intermediate.dense.weight, layer.intermediate.dense.bias, mlp_out.dense.weight,
            mlp_out.dense.bias, mlp_out.LayerNorm.weight, mlp_out.LayerNorm.bias, self.acc, self.counter,
            mlp_out.LayerNorm.eps, HIDDEN=hidden, INTERMEDIATE=intermediate, COLUMNS=MLP_COLUMNS, **shared)
        return x
