"""Whole-model CUDA graphs per batch shape, captured lazily, replayed from then on.

A batch's token count is padded up to a bucket (multiples of 64 up to 1,024, then of 256) and its
sequence count up to a power of two (its slots; extra slots are empty sequences), so one graph
serves every batch of that shape. Slots are bucketed too because the attention kernels launch work
per slot: 512 slots for a batch of 60 sequences cost MiniLM a third of its GPU time. The first hit
of a shape runs eagerly on the exact batch, the second captures and replays, later hits replay:
capture cost is spread over traffic instead of paid at start (warmup=True pays it at start, for
batches of sequences up to 512 tokens; `embedctl serve` warms up by default).
A graph also bakes in the max_seqlen it gives varlen_attn or the Triton kernel, which launch a
block per 64-128 rows of max_seqlen for every sequence slot and head, however short the sequence;
so a batch's longest sequence is bucketed too, to a power of two of at least 512 (seqlen_for).
BERT-family models (max length at most 512) keep one graph per (tokens, slots); a Qwen3 model with
a 32k max length does not launch 256 idle blocks per short sequence.
Batches of more than GRAPH_MAX_TOKENS tokens run eagerly: such a step is tens of milliseconds of GPU
work (Qwen3-0.6B: about 15 TFLOP at 16k tokens, some 25 ms on an H200), so launching its few hundred
kernels from Python hides behind the GPU and a graph would save nothing, while each of the 64 buckets
between 16k and 32k tokens would hold a graph (and its activations) for inputs that are rare.
Batches run on lanes: CUDA streams of their own, each with its own input buffers, graphs, memory
pool and attention scratch, so that batches in flight run at the same time and one batch's kernels
fill the gaps and tails between another's. A batch takes the first lane with nothing left to do, so
one batch at a time (a lone query) always runs on lane 0 and its graphs, while a stream of batches
spreads over the lanes. A shape's hits count across lanes: its first hit runs eagerly, and each lane
captures its own graph of it on the first hit it gets after that, on its own stream (_Lane says
why). Model-only BERT-base on an H100, 16,384-token budget, one run (bench/results/
gpu-2026-12-07-run171-lanes-workspace-ab-h100): 2.41M tokens/s on one lane, 2.52M on three, the
same vectors. The lanes figures before it (run41, run42: BERT-base 2.87M on three lanes) came from
lanes that shared one cuBLAS workspace, whose vectors run171 found mostly wrong. A server is the
exception (embedctl serve runs one lane): there each extra lane's captures stall live requests (run46).
Inputs reach the device through two alternating page-locked staging buffers per lane and one copy
per batch; a graph reads them from fixed device addresses.
Not here: the model, attention kernels, readback (engine.lazy).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from engine.attention import Attention, AttentionLayout
from engine.batch import PackedBatch

SMALL_STEP, LARGE_STEP, SMALL_LIMIT = 64, 256, 1024
GRAPH_MAX_TOKENS = 16384
SEQLEN_FLOOR = 512

# (inputs, tokens, slots, attention) -> [slots, dim] float32; see Engine.forward.
Forward = Callable[[torch.Tensor, int, int, Attention], torch.Tensor]
# (slots of a graph shape, or None for eager runs; lane index) -> a new attention instance for them.
MakeAttention = Callable[[int | None, int], Attention]
T = TypeVar("T")


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
class _Graph:
    """One lane's graph of one shape, and the attention instance (with its plan buffers) it was captured with."""

    attention: Attention
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None


@dataclass(frozen=True)
class _StagingViews:
    """Views of a batch shape's inputs: in one of a lane's page-locked staging buffers, in its device
    buffer, and of the cu_seqlens in the device buffer."""

    staging: torch.Tensor
    device: torch.Tensor
    cu_seqlens: torch.Tensor


class _Lane:
    """A CUDA stream and what a batch running on it owns: nothing here is shared with another lane.

    Its graphs are captured on its own stream, not on torch's shared capture stream, because cuBLAS
    takes its scratch workspace per stream: graphs captured on one stream would all write the same
    workspace, and lanes replaying at once would corrupt each other's GEMMs (run171: an engine
    that captured so gave most of BERT-base's vectors wrong on three lanes).
    """

    def __init__(self, index: int, size: int, device: torch.device, make_attention: MakeAttention) -> None:
        self.index = index
        self.stream = torch.cuda.Stream(device)
        self.staging = [torch.empty(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.staging_host = [buffer.numpy() for buffer in self.staging]
        self.staged = [torch.cuda.Event() for _ in self.staging]
        self.turn = 0
        self.inputs = torch.zeros(size, dtype=torch.int32, device=device)
        self.views: dict[tuple[int, int, int], _StagingViews] = {}  # by (turn, tokens, slots)
        self.eager_attention = make_attention(None, index)
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.done = torch.cuda.Event()  # recorded after the lane's last batch's compute
        # The weights and the buffers above were made on the stream current now; the lane must see them.
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.done.record(self.stream)
        self.batches = 0


class _CollectionPause:
    """No automatic garbage collection inside: collecting an engine dropped earlier (engines hold reference
    cycles) destroys its graphs, which CUDA refuses while this thread captures, and the refusal fails the
    capture (seen on the H200: bench/results/gpu-2026-12-01-run119-pool-normalize). Counted, so that
    threads capturing at once leave collection off until the last one ends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.was_enabled = False

    def __enter__(self) -> None:
        with self.lock:
            if self.inside == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.inside += 1

    def __exit__(self, *exc_info: object) -> None:
        with self.lock:
            self.inside -= 1
            if self.inside == 0 and self.was_enabled:
                gc.enable()


_no_collection = _CollectionPause()


class GraphRunner:
    """Runs packed batches on one CUDA device, through graphs where it can."""

    def __init__(self, forward: Forward, make_attention: MakeAttention, max_tokens: int, max_seqs: int,
                 max_seqlen: int, device: torch.device, use_graphs: bool, lanes: int) -> None:
        self.forward = forward
        self.make_attention = make_attention
        self.max_seqs = max_seqs
        self.max_seqlen = max_seqlen
        self.device = device
        self.use_graphs = use_graphs
        self.stats = GraphStats()
        size = 4 * bucket_for(max_tokens) + max_seqs + 1
        self.lanes = [_Lane(index, size, device, make_attention) for index in range(lanes)]
        self.last_used = lanes - 1
        self.hits: dict[tuple[int, int, int], int] = {}

    def run(self, batch: PackedBatch, read: Callable[[torch.Tensor, torch.cuda.Stream], T]) -> T:
        """Enqueue the batch on a lane, then read(vectors, stream) with the lane's stream current; returns what read does.

        vectors (the batch's num_seqs rows on the device) belong to the lane's graph or to the
        allocator, valid until the lane's next run, so read must enqueue its copy on that stream, as
        the readback ring does.

        The lane's stream is made current, and the caller's stream and device current again after,
        by the private calls under torch.cuda.stream's context (torch.cuda.current_stream and
        set_stream make them too): the context also builds Stream and device objects, 19 us of host
        time a step on the H200 host against 0.4 for a get and a set. With that and the staging views
        kept per graph shape (_stage), back-to-back steps of one 16-token MiniLM query took 266 us
        against 315, of five 512-token BERT-base pairs 1,427 against 1,470 (bench/results/
        gpu-2026-12-01-run110-step-host); with the device drained after each step, batch-1 latency
        did not move (run111): what the step saves is host time of the thread that feeds the device.
        """
        lane = self._free_lane()
        lane.batches += 1
        stream = lane.stream
        caller_device = torch._C._cuda_getDevice()
        caller_stream = torch._C._cuda_getCurrentStream(stream.device_index)
        # Setting a stream also makes its device current.
        torch._C._cuda_setStream(stream.stream_id, stream.device_index, stream.device_type)
        try:
            result = read(self._run(lane, batch)[: batch.num_seqs], stream)
        finally:
            torch._C._cuda_setStream(*caller_stream)
            if caller_device != stream.device_index:
                torch._C._cuda_setDevice(caller_device)
        lane.done.record(stream)
        return result

    def _free_lane(self) -> _Lane:
        """The first lane whose last batch has been computed, else the one after the lane used last."""
        for lane in self.lanes:
            if lane.done.query():
                break
        else:
            lane = self.lanes[(self.last_used + 1) % len(self.lanes)]
        self.last_used = lane.index
        return lane

    def _run(self, lane: _Lane, batch: PackedBatch) -> torch.Tensor:
        tokens = bucket_for(batch.num_tokens)
        if not self.use_graphs or tokens > GRAPH_MAX_TOKENS:
            return self._eager(lane, batch)
        shape = (tokens, slots_for(batch.num_seqs, tokens, self.max_seqs),
                 seqlen_for(batch.max_seqlen, tokens, self.max_seqlen))
        self.hits[shape] = self.hits.get(shape, 0) + 1
        graph = self._graph(lane, shape)
        if self.hits[shape] == 1:
            return self._eager(lane, batch)
        graph.attention.plan(self._stage(lane, batch, *shape, keep_views=True))
        if graph.graph is None:
            self._capture(lane, shape, graph)
        else:
            self.stats.replays += 1
        graph.graph.replay()
        return graph.output

    def capture_all(self, max_tokens: int) -> None:
        """Capture now (warm-up) every shape up to GRAPH_MAX_TOKENS of batches whose sequences are at most
        SEQLEN_FLOOR tokens, each with a dummy batch of that shape.

        That is every shape for BERT-family models (max length at most 512). A long-context model's
        shapes for longer sequences (Qwen3: seven times as many, from 512 to 16,384 tokens per
        sequence) are left to capture on their second hit: each such step is milliseconds of GPU work
        that a graph shortens by a few percent, and capturing them all would take minutes.
        On the first lane only, which is where a batch goes whenever the device keeps up: every shape
        on every lane would multiply the graphs' memory (with FlashInfer, up to 1-2 MiB of plan buffers per
        shape on the device and as much page-locked on the host) by the lane count. Other lanes capture
        a shape when a batch of it first reaches them.
        """
        lane, longest = self.lanes[0], min(SEQLEN_FLOOR, self.max_seqlen)
        for tokens, slots in all_shapes(min(max_tokens, GRAPH_MAX_TOKENS), self.max_seqs, longest):
            shape = (tokens, slots, seqlen_for(longest, tokens, self.max_seqlen))
            self.hits[shape] = max(self.hits.get(shape, 0), 1)
            dummy = PackedBatch.of([np.zeros(min(tokens // slots, longest), dtype=np.int32)] * slots)
            with torch.cuda.stream(lane.stream):
                graph = self._graph(lane, shape)
                if graph.graph is None:
                    graph.attention.plan(self._stage(lane, dummy, *shape, keep_views=True))
                    self._capture(lane, shape, graph)

    def _graph(self, lane: _Lane, shape: tuple[int, int, int]) -> _Graph:
        if shape not in lane.graphs:
            lane.graphs[shape] = _Graph(self.make_attention(shape[1], lane.index))
        return lane.graphs[shape]

    def _stage(self, lane: _Lane, batch: PackedBatch, tokens: int, slots: int, max_seqlen: int,
               keep_views: bool = False) -> AttentionLayout:
        """Copy the batch's inputs to the lane's device buffer; return the attention layout that reads them.

        keep_views: keep the views of the buffers that this shape needs for the next batch of it; for a
        graph's shape, of which there are a bounded few, not an eager batch's exact one. Slicing a
        tensor costs microseconds of host time, which a batch-1 step waits for."""
        lane.turn ^= 1
        staged = lane.staged[lane.turn]
        # The copy issued from this buffer two batches ago must be done before it is rewritten.
        staged.synchronize()
        size = 4 * tokens + slots + 1
        host = lane.staging_host[lane.turn]
        batch.write_inputs(host, tokens, slots)
        key = (lane.turn, tokens, slots)
        views = lane.views.get(key)
        if views is None:
            views = _StagingViews(lane.staging[lane.turn][:size], lane.inputs[:size], lane.inputs[4 * tokens: size])
            if keep_views:
                lane.views[key] = views
        views.device.copy_(views.staging, non_blocking=True)
        staged.record(lane.stream)
        return AttentionLayout(views.cu_seqlens, host[4 * tokens: size].tolist(), max_seqlen, tokens)

    def _eager(self, lane: _Lane, batch: PackedBatch) -> torch.Tensor:
        self.stats.eager_runs += 1
        lane.eager_attention.plan(self._stage(lane, batch, batch.num_tokens, batch.num_seqs, batch.max_seqlen))
        return self.forward(lane.inputs, batch.num_tokens, batch.num_seqs, lane.eager_attention)

    def _capture(self, lane: _Lane, shape: tuple[int, int, int], graph: _Graph) -> None:
        started = time.perf_counter()
        tokens, slots, _ = shape
        # One eager pass at the shape first, so lazy library setup stays out of the graph.
        self.forward(lane.inputs, tokens, slots, graph.attention)
        torch.cuda.synchronize(self.device)
        captured = torch.cuda.CUDAGraph()
        # thread_local: another thread may wait on an earlier batch's event meanwhile (the index writer does).
        with _no_collection, torch.cuda.graph(captured, pool=lane.pool, stream=lane.stream,
                                              capture_error_mode="thread_local"):
            output = self.forward(lane.inputs, tokens, slots, graph.attention)
        graph.graph, graph.output = captured, output  # only once captured: a failed capture leaves none to replay
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - started
