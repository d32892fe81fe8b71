"""TokenizerPool: chunks of texts tokenized in the background, on threads or in worker processes.

The tokenizer's Rust threads release the GIL, but every text's ids still become a Python list and
then an array under it, and that share grows with the threads: one process on 16 threads made 4.9M
tokens/s on the H200 host while its main thread spent 4.5 CPU-seconds of the 0.55-second run holding
the GIL, the lock the thread that feeds the GPU needs too. Four processes of four threads made 6.2M
tokens/s and left the main process 0.05 CPU-seconds (bench/results/gpu-2026-11-30-run33-tokenizer-processes).

Workers are spawned (never forked: the parent may hold CUDA and threads) and each loads its own
TextTokenizer, which takes a few tenths of a second: until they are all up, chunks go to two
threads of this process, so a short run does not wait for them. A worker returns a chunk's ids as
one flat int32 array with the lengths: three buffers through the pipe, not a thousand objects.
Workers ignore Ctrl-C; the parent gets it, stops its pipeline and closes the pool.

Not here: the tokenization rules (pipelines.tokenize).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from engine.errors import UserError
from pipelines.tokenize import CORES, Encoded, TextTokenizer

# Chunks in this process's threads at once: one converts its encodings to arrays (GIL held) while
# the other keeps the Rust threads busy; MiniLM's end-to-end index ran 5% faster than with one
# (bench/results/gpu-2026-11-30-run31-tokenizing-chunks-ab).
THREADS = 2
# Rust threads per worker process: on the 16-core H200 host four processes of four threads beat
# two of eight (4.9M tokens/s), eight of two (5.7M) and sixteen of one (5.0M).
THREADS_PER_PROCESS = 4
# Fewer cores than this feed no GPU that outruns one process's tokenizer.
MIN_CORES = 8

_worker_tokenizer: TextTokenizer | None = None


def default_processes(on_gpu: bool, cores: int = CORES) -> int:
    """Worker processes for a run that does not say: none for the CPU engine, which is slower than
    one process's tokenizer and needs the cores itself; one per THREADS_PER_PROCESS cores beside a GPU."""
    return cores // THREADS_PER_PROCESS if on_gpu and cores >= MIN_CORES else 0


class TokenizerPool:
    """submit(texts) is a future of tokenizer.encode(texts); callers keep the futures in their order.

    With processes=0 every chunk runs on this process's threads. Use it as a context manager, or call
    close(), which drops chunks not yet started and waits for the rest.
    """

    def __init__(self, tokenizer: TextTokenizer, processes: int, cores: int = CORES) -> None:
        if processes < 0:
            raise ValueError(f"processes must be 0 or more, not {processes}")
        self.tokenizer = tokenizer
        self.processes = processes
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="embedctl-tokenize")
        self._workers: ProcessPoolExecutor | None = None
        self._started: list[Future] = []
        if processes:
            self._workers = ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"), initializer=_start,
                                                initargs=(str(tokenizer.file), tokenizer.max_length,
                                                          max(1, cores // processes)))
            self._started = [self._workers.submit(_ready) for _ in range(processes)]

    @property
    def in_workers(self) -> bool:
        """Whether chunks go to the worker processes now: once they have started."""
        return self._workers is not None and all(started.done() for started in self._started)

    def wait_for_workers(self) -> None:
        """Block until the worker processes have started (at once without any); raises UserError if one died."""
        for started in self._started:
            try:
                started.result()
            except BrokenProcessPool as error:
                raise _died(error) from None

    @property
    def depth(self) -> int:
        """Chunks worth keeping submitted and not yet collected: two per worker or thread."""
        return 2 * self.processes if self.in_workers else THREADS

    def submit(self, texts: Sequence[str]) -> Future[Encoded]:
        if not self.in_workers:
            return self._threads.submit(self.tokenizer.encode, texts)
        result: Future[Encoded] = Future()
        try:
            packed = self._workers.submit(_encode, list(texts))
        except BrokenProcessPool as error:
            raise _died(error) from None
        packed.add_done_callback(lambda done: _unpack(done, result))
        return result

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        if self._workers is not None:
            self._workers.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _start(tokenizer_file: str, max_length: int, threads: int) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the tokenizer first starts its thread pool
    _worker_tokenizer = TextTokenizer(Path(tokenizer_file), max_length)


def _ready() -> None:
    """Nothing: done once a worker has started."""


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    encoded = _worker_tokenizer.encode(texts)
    lengths = np.fromiter(map(len, encoded.ids), np.int64, len(encoded.ids))
    flat = np.concatenate(encoded.ids) if encoded.ids else np.empty(0, np.int32)
    return flat, lengths, np.asarray(encoded.truncated, dtype=bool)


def _unpack(done: Future, result: Future[Encoded]) -> None:
    if done.cancelled():
        result.cancel()
        return
    if (error := done.exception()) is not None:
        result.set_exception(_died(error) if isinstance(error, BrokenProcessPool) else error)
        return
    flat, lengths, truncated = done.result()
    ids = np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
    result.set_result(Encoded(ids=ids, truncated=truncated.tolist()))


def _died(error: BaseException) -> UserError:
    return UserError(f"a tokenizer process died ({error}); free some memory and run again, "
                     "or pass --tokenizer-processes 0 to tokenize in the main process")
