"""Scheduler: one thread that owns Engine.step and serves many concurrent callers.

Callers submit a request (several token-id sequences) with a callback. Every sequence enters one
first-come-first-served queue; the thread packs what is waiting into batches under the engine's
token budget (engine.batch.Packer), steps each batch, and reads batch N back while batch N+1 runs.
A request's sequences may land in several batches; its rows are put back in request order and the
callback gets them all at once, from the scheduler thread. Nothing here waits on the whole device.
Admission is bounded: a request that would take the queue past its depth raises QueueFull. A caller
that stops waiting (its client went away) cancels its request: the sequences still waiting are dropped.

Not here: tokenization, HTTP, normalisation; the callback decides how to hand results to its caller
(e.g. loop.call_soon_threadsafe for asyncio).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.batch import Packer, PackedBatch
from engine.engine import Engine
from engine.lazy import LazyTensor

log = logging.getLogger(__name__)

# Called once per request with float32 [sequences, engine.dim] in submission order, or the error.
Done = Callable[[np.ndarray | BaseException], None]


class QueueFull(Exception):
    """The queue holds too many sequences to admit this request now; retrying later can succeed."""

    def __init__(self, depth: int, wanted: int, limit: int) -> None:
        super().__init__(f"the queue holds {depth} of at most {limit} sequences; {wanted} more do not fit")
        self.depth, self.wanted, self.limit = depth, wanted, limit


class SchedulerClosed(Exception):
    """The scheduler is shutting down and admits no new requests."""


class _Request:
    """One submitted request; failed once it has been answered with an error or cancelled, and then
    skipped wherever its sequences are (waiting, or in a batch in flight)."""

    __slots__ = ("count", "done", "rows", "remaining", "failed")

    def __init__(self, count: int, done: Done) -> None:
        self.count = count
        self.done = done
        self.rows: np.ndarray | None = None
        self.remaining = count
        self.failed = False

    def deliver(self, outcome: np.ndarray | BaseException) -> None:
        try:
            self.done(outcome)
        except Exception:  # a caller's broken callback must not stop the thread that serves everyone
            log.exception("a scheduler callback failed")


@dataclass
class SchedulerStats:
    depth: int = 0  # sequences of admitted requests not yet answered
    batches: int = 0
    sequences: int = 0
    tokens: int = 0


class Scheduler:
    """Feeds one Engine from many threads. close() finishes everything admitted, then stops the thread."""

    def __init__(self, engine: Engine, max_queue: int, on_batch: Callable[[PackedBatch], None] | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.on_batch = on_batch
        self.stats = SchedulerStats()
        self._packer = Packer(engine.max_batch_tokens, engine.config.max_seqs)
        self._holding = False  # the packer holds the sequence that closed the last batch
        self._waiting: deque[tuple[np.ndarray, np.ndarray | None, _Request, int]] = deque()
        self._lock = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="embedctl-scheduler", daemon=True)
        self._thread.start()

    def submit(self, ids: Sequence[np.ndarray], done: Done, type_ids: Sequence[np.ndarray] | None = None) -> _Request:
        """Queue one request's sequences (each at most engine.max_length tokens); done() gets the rows.
        Returns the request, for cancel()."""
        if not ids:
            raise ValueError("a request needs at least one sequence")
        with self._lock:
            self._check_room(len(ids))
            request = _Request(len(ids), done)
            for index, seq in enumerate(ids):
                self._waiting.append((seq, type_ids[index] if type_ids is not None else None, request, index))
            self.stats.depth += len(ids)
            self._lock.notify()
        return request

    def cancel(self, request: _Request) -> None:
        """Drop a request its caller no longer waits for: done() is not called, its sequences still waiting
        are skipped and leave the queue's depth at once; those already in a batch run, unread. A request
        answered already is left as it is."""
        with self._lock:
            self._cancel(request)

    def _cancel(self, request: _Request) -> bool:
        """Mark an unanswered request failed and take its sequences off the depth; whether it was one."""
        if request.failed or request.remaining == 0:
            return False
        request.failed = True
        self.stats.depth -= request.count
        return True

    def check_room(self, count: int) -> None:
        """Raise as submit() would for a request of `count` sequences now, admitting nothing: for a caller
        that submits one request in parts, so that it is refused before any part is queued."""
        with self._lock:
            self._check_room(count)

    def _check_room(self, count: int) -> None:
        if self._closing:
            raise SchedulerClosed("the server is shutting down")
        if self.stats.depth + count > self.max_queue:
            raise QueueFull(self.stats.depth, count, self.max_queue)

    def close(self, drop_waiting: bool = False) -> None:
        """Admit nothing more, answer every admitted request, then stop the thread. drop_waiting (a forced
        quit): cancel every request with a sequence still waiting, even one partly in a batch; their done()
        is never called, so a caller that waits on it must stop waiting by other means."""
        with self._lock:
            self._closing = True
            if drop_waiting:
                for _, _, request, _ in self._waiting:
                    self._cancel(request)
            self._lock.notify()
        self._thread.join()

    def _run(self) -> None:
        pending: tuple[PackedBatch, LazyTensor] | None = None
        while True:
            batch = self._next_batch(wait=pending is None)
            if batch is None and pending is None:
                return
            stepped = self._step(batch) if batch is not None else None
            if pending is not None:
                self._finish(*pending)
            pending = stepped

    def _next_batch(self, wait: bool) -> PackedBatch | None:
        """What is waiting, first come first served, up to the token budget; None when nothing is.

        With wait, blocks until work arrives or the scheduler closes. A sequence that closes a batch
        stays in the packer and opens the next one.
        """
        while True:
            with self._lock:
                while wait and not self._waiting and not self._holding and not self._closing:
                    self._lock.wait()
                while self._waiting:
                    ids, types, request, index = self._waiting.popleft()
                    if request.failed:
                        continue
                    if (batch := self._packer.add(ids, (request, index), types)) is not None:
                        self._holding = True
                        return batch
                self._holding = False
                closing = self._closing
            batch = self._packer.flush()
            # What woke a waiting thread may have been cancelled since: wait again rather than stop.
            if batch is not None or not wait or closing:
                return batch

    def _step(self, batch: PackedBatch) -> tuple[PackedBatch, LazyTensor] | None:
        try:
            lazy = self.engine.step(batch)
        except Exception as error:  # noqa: BLE001 - one bad batch fails its requests, not the server
            self._fail(batch, error)
            return None
        if self.on_batch is not None:
            self.on_batch(batch)
        return batch, lazy

    def _finish(self, batch: PackedBatch, lazy: LazyTensor) -> None:
        try:
            rows = lazy.result()
        except Exception as error:  # noqa: BLE001 - as in _step
            self._fail(batch, error)
            return
        answered = []
        with self._lock:  # a request is answered or cancelled, never both (see cancel)
            for row, (request, index) in zip(rows, batch.tags):
                if request.failed:
                    continue
                if request.rows is None:
                    request.rows = np.empty((request.count, rows.shape[1]), dtype=np.float32)
                request.rows[index] = row
                request.remaining -= 1
                if request.remaining == 0:
                    answered.append(request)
            self.stats.batches += 1
            self.stats.sequences += batch.num_seqs
            self.stats.tokens += batch.num_tokens
            self.stats.depth -= sum(request.count for request in answered)
        for request in answered:
            request.deliver(request.rows)

    def _fail(self, batch: PackedBatch, error: BaseException) -> None:
        with self._lock:
            in_batch = dict.fromkeys(request for request, _ in batch.tags)
            failed = [request for request in in_batch if self._cancel(request)]
        for request in failed:
            request.deliver(error)
