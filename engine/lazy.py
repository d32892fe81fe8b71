"""LazyTensor: a batch's vectors on their way from the GPU to the host, without blocking the caller.

Engine.step() returns at once with a LazyTensor that owns a slot in a ring of page-locked host
buffers, the non-blocking device-to-host copy into it, and a CUDA event recorded after that copy.
ready() polls the event; result() waits on that event alone (never on the whole device) and hands
back a numpy array of its own, which frees the slot. On the CPU the result exists already.
"""

from __future__ import annotations

import threading

import numpy as np
import torch


class LazyTensor:
    """A [rows, dim] float32 result that may still be in flight. Safe to resolve from another thread."""

    def __init__(self, host: torch.Tensor | np.ndarray, event: torch.cuda.Event | None = None) -> None:
        self._host = host
        self._event = event
        self._array: np.ndarray | None = host if isinstance(host, np.ndarray) else None
        self._lock = threading.Lock()

    @classmethod
    def done(cls, array: np.ndarray) -> LazyTensor:
        return cls(array)

    def ready(self) -> bool:
        return self._array is not None or self._event is None or self._event.query()

    def result(self) -> np.ndarray:
        with self._lock:
            if self._array is None:
                self._event.synchronize()
                self._array = self._host.numpy().copy()
                self._host = None
            return self._array


class PinnedRing:
    """A ring of page-locked host buffers that device results are copied into, one slot per batch.

    The ring lets batch N's copy and batch N+1's compute overlap. A slot comes round again only
    after `slots` more batches; if its previous LazyTensor has not been resolved by then, it is
    resolved first (copied into its own array), so no result is ever overwritten.
    """

    def __init__(self, slots: int, max_rows: int, dim: int) -> None:
        self.buffers = [torch.empty(max_rows, dim, dtype=torch.float32, pin_memory=True) for _ in range(slots)]
        # One event per slot, re-recorded: its LazyTensor is resolved before the slot is reused.
        self.copied = [torch.cuda.Event() for _ in range(slots)]
        self.owners: list[LazyTensor | None] = [None] * slots
        self.next = 0

    def readback(self, device_rows: torch.Tensor, stream: torch.cuda.Stream) -> LazyTensor:
        """Enqueue the copy of device_rows on `stream`, which must be current and the one that computes
        them; return its LazyTensor."""
        slot = self.next
        self.next = (slot + 1) % len(self.buffers)
        previous = self.owners[slot]
        if previous is not None:
            previous.result()
        host = self.buffers[slot][: device_rows.shape[0]]
        host.copy_(device_rows, non_blocking=True)
        event = self.copied[slot]
        event.record(stream)
        self.owners[slot] = lazy = LazyTensor(host, event)
        return lazy
