"""Whole-model CUDA graphs per batch shape, captured lazily, replayed from then on.

A batch's token count is padded up to a bucket (multiples of 64 up to 1,024, then of 256) and its
sequence count up to a power of two (its slots; extra slots are empty sequences), so one graph
serves every batch of that shape. Slots are bucketed too because the attention kernels launch work
per slot: 512 slots for a batch of 60 sequences cost MiniLM a third of its GPU time. The first hit
of a shape runs eagerly on the exact batch, the second captures and replays, later hits replay:
capture cost is spread over traffic instead of paid at start (warmup=True pays it at start).
A graph also bakes in the max_seqlen it gives varlen_attn, whose kernel launches a block per 64-128
rows of max_seqlen for every sequence slot and head, however short the sequence; so a batch's longest
sequence is bucketed too, to a power of two of at least 512 (seqlen_for). BERT-family models (max
length at most 512) keep one graph per (tokens, slots); a Qwen3 model with a 32k max length does not
launch 256 idle blocks per short sequence.
Batches of more than GRAPH_MAX_TOKENS tokens run eagerly: such a step is tens of milliseconds of GPU
work (Qwen3-0.6B: about 15 TFLOP at 16k tokens, some 25 ms on an H200), so launching its few hundred
kernels from Python hides behind the GPU and a graph would save nothing, while each of the 64 buckets
between 16k and 32k tokens would hold a graph (and its activations) for inputs that are rare.
All graphs share one memory pool. Inputs reach the device through two alternating page-locked
staging buffers and one copy per batch; the graph reads them from fixed device addresses.
Not here: the model, attention kernels, readback (engine.lazy).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import Attention, AttentionLayout
from engine.batch import PackedBatch

SMALL_STEP, LARGE_STEP, SMALL_LIMIT = 64, 256, 1024
GRAPH_MAX_TOKENS = 16384
SEQLEN_FLOOR = 512

# (inputs, tokens, slots, attention) -> [slots, dim] float32; see Engine.forward.
Forward = Callable[[torch.Tensor, int, int, Attention], torch.Tensor]


def bucket_for(tokens: int) -> int:
    step = SMALL_STEP if tokens <= SMALL_LIMIT else LARGE_STEP
    return -(-tokens // step) * step


def all_buckets(max_tokens: int) -> list[int]:
    buckets, tokens = [], SMALL_STEP
    while tokens <= bucket_for(max_tokens):
        buckets.append(tokens)
        tokens += SMALL_STEP if tokens < SMALL_LIMIT else LARGE_STEP
    return buckets


def slots_for(seqs: int, tokens: int, max_seqs: int) -> int:
    """Sequence slots for a batch: the next power of two, at most one per token and max_seqs."""
    return min(1 << max(seqs - 1, 0).bit_length(), tokens, max_seqs)


def seqlen_for(longest: int, tokens: int, max_seqlen: int) -> int:
    """The max_seqlen a graph bakes in for a batch whose longest sequence has `longest` tokens."""
    return min(max(SEQLEN_FLOOR, 1 << max(longest - 1, 0).bit_length()), tokens, max_seqlen)


def all_seqlens(tokens: int, max_seqlen: int) -> list[int]:
    """Every value seqlen_for can take in a bucket of `tokens` tokens."""
    return sorted({seqlen_for(1 << shift, tokens, max_seqlen) for shift in range(max(tokens, 1).bit_length() + 1)})


def all_shapes(max_tokens: int, max_seqs: int, max_seqlen: int) -> list[tuple[int, int]]:
    """Every (tokens, slots) shape a batch can have: at least tokens / max_seqlen sequences fill a bucket."""
    shapes, previous = [], 0
    for tokens in all_buckets(max_tokens):
        seqs, previous = max(1, -(-(previous + 1) // max_seqlen)), tokens
        while True:
            slots = slots_for(seqs, tokens, max_seqs)
            shapes.append((tokens, slots))
            if slots >= min(tokens, max_seqs):
                break
            seqs = slots + 1
    return shapes


@dataclass
class GraphStats:
    eager_runs: int = 0
    captures: int = 0
    replays: int = 0
    capture_seconds: float = 0.0


@dataclass
class _Bucket:
    tokens: int
    slots: int
    seqlen: int
    attention: Attention
    hits: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None


class GraphRunner:
    """Runs packed batches on one CUDA device, through graphs where it can."""

    def __init__(self, forward: Forward, make_attention: Callable[[int | None], Attention], max_tokens: int,
                 max_seqs: int, max_seqlen: int, device: torch.device, use_graphs: bool) -> None:
        self.forward = forward
        self.make_attention = make_attention
        self.max_seqs = max_seqs
        self.max_seqlen = max_seqlen
        self.device = device
        self.use_graphs = use_graphs
        self.stats = GraphStats()
        size = 4 * bucket_for(max_tokens) + max_seqs + 1
        self.staging = [torch.empty(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.staging_host = [buffer.numpy() for buffer in self.staging]
        self.staged = [torch.cuda.Event() for _ in self.staging]
        # Every batch runs on the stream current now; asking torch for it per batch built a Stream object
        # each time, a tenth of the index loop's GIL time on the H200 host (bench/results/gpu-2026-11-30-run36-index-host).
        self.stream = torch.cuda.current_stream(device)
        self.turn = 0
        self.inputs = torch.zeros(size, dtype=torch.int32, device=device)
        self.eager_attention = make_attention(None)
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, batch: PackedBatch) -> torch.Tensor:
        """Enqueue the batch; returns the device tensor whose first num_seqs rows are its vectors.

        The tensor belongs to the graph (or the shared pool) and is valid until the next run():
        the caller must enqueue its copy on the same stream before then, as the readback ring does.
        """
        tokens = bucket_for(batch.num_tokens)
        if not self.use_graphs or tokens > GRAPH_MAX_TOKENS:
            return self._eager(batch)
        bucket = self._bucket(tokens, slots_for(batch.num_seqs, tokens, self.max_seqs),
                              seqlen_for(batch.max_seqlen, tokens, self.max_seqlen))
        bucket.hits += 1
        if bucket.hits == 1:
            return self._eager(batch)
        bucket.attention.plan(self._stage(batch, bucket.tokens, bucket.slots, bucket.seqlen))
        if bucket.graph is None:
            self._capture(bucket)
        else:
            self.stats.replays += 1
        bucket.graph.replay()
        return bucket.output

    def capture_all(self, max_tokens: int) -> None:
        """Capture every shape up to GRAPH_MAX_TOKENS now (warm-up), each with a dummy batch of that shape."""
        for tokens, slots in all_shapes(min(max_tokens, GRAPH_MAX_TOKENS), self.max_seqs, self.max_seqlen):
            for seqlen in all_seqlens(tokens, self.max_seqlen):
                bucket = self._bucket(tokens, slots, seqlen)
                if bucket.graph is None:
                    dummy = PackedBatch.of([np.zeros(min(tokens // slots, self.max_seqlen), dtype=np.int32)] * slots)
                    bucket.attention.plan(self._stage(dummy, tokens, slots, seqlen))
                    self._capture(bucket)
                    bucket.hits = 2

    def _bucket(self, tokens: int, slots: int, seqlen: int) -> _Bucket:
        if (tokens, slots, seqlen) not in self.buckets:
            self.buckets[tokens, slots, seqlen] = _Bucket(tokens, slots, seqlen, self.make_attention(slots))
        return self.buckets[tokens, slots, seqlen]

    def _stage(self, batch: PackedBatch, tokens: int, slots: int, max_seqlen: int) -> AttentionLayout:
        """Copy the batch's inputs to the device; return the attention layout that reads them."""
        self.turn ^= 1
        staging, staged = self.staging[self.turn], self.staged[self.turn]
        # The copy issued from this buffer two batches ago must be done before it is rewritten.
        staged.synchronize()
        size = 4 * tokens + slots + 1
        host = self.staging_host[self.turn]
        batch.write_inputs(host, tokens, slots)
        self.inputs[:size].copy_(staging[:size], non_blocking=True)
        staged.record(self.stream)
        return AttentionLayout(self.inputs[4 * tokens: size], host[4 * tokens: size].tolist(), max_seqlen, tokens)

    def _eager(self, batch: PackedBatch) -> torch.Tensor:
        self.stats.eager_runs += 1
        self.eager_attention.plan(self._stage(batch, batch.num_tokens, batch.num_seqs, batch.max_seqlen))
        return self.forward(self.inputs, batch.num_tokens, batch.num_seqs, self.eager_attention)

    def _capture(self, bucket: _Bucket) -> None:
        started = time.perf_counter()
        # One eager pass at the bucket's shape first, so lazy library setup stays out of the graph.
        self.forward(self.inputs, bucket.tokens, bucket.slots, bucket.attention)
        torch.cuda.synchronize(self.device)
        bucket.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bucket.graph, pool=self.pool):
            bucket.output = self.forward(self.inputs, bucket.tokens, bucket.slots, bucket.attention)
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - started
