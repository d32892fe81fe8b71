"""TokenizerPool: chunks of texts or text pairs tokenized in the background, on threads or in worker processes.

The tokenizer's Rust threads release the GIL, but every text's ids still become a Python list and
then an array under it, and that share grows with the threads: one process on 16 threads made 4.9M
tokens/s on the H200 host while its main thread spent 4.5 CPU-seconds of the 0.55-second run holding
the GIL, the lock the thread that feeds the GPU needs too. Four processes of four threads made 6.2M
tokens/s and left the main process 0.05 CPU-seconds (bench/results/gpu-2026-11-30-run33-tokenizer-processes).

A worker is `python -m pipelines.tokenize_pool`, started with subprocess in a session of its own:
multiprocessing's spawn would import the parent's main module first (torch, for a benchmark), and
its executor waits at shutdown for workers still starting; a fork could inherit locks held by the
parent's other threads. Chunks go down a worker's stdin and come back in order through a pipe of
their own, each pickled behind its length: ids (and pairs' token types) as the bytes of flat int32
arrays with the lengths, a few buffers rather than a thousand objects. A worker that has answered
polls for its next chunk a while (SPIN_SECONDS) before it blocks, so a burst of chunks finds it
awake. Answers are read by a thread per worker, or, in a pool made with pulled=True, by the thread
that waits for them, which polls for them as long where the workers leave it a core. A worker loads
its own tokenizer, which takes a few tenths of a second; until every worker has, chunks go to two
threads of this process, so a short run does not wait for them. Ctrl-C reaches the parent only;
closing the pool kills the workers, which hold nothing worth waiting for.

Not here: the tokenization rules (pipelines.tokenize).
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import BinaryIO

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
# Fewer rows than this are done before workers pay for their start: MiniLM's index of 10,000 documents
# took 0.64 s on threads and 0.83 s with four workers; of 60,000, 3.20 s and 2.38 s
# (bench/results/gpu-2026-11-30-run37-index-loop).
MIN_ROWS = 20_000
# How long a worker that has answered polls for its next chunk before it blocks on the pipe. On the
# H200 host (a virtual machine) a worker woken from a blocking read took 1.2-1.4 ms to answer two pairs
# of 512 tokens that it answered in 0.32 ms when they came while it was still awake (this process, after
# 10 ms of sleep, took 0.66 against 0.34: bench/results/gpu-2026-12-01-run89-pool-idle). A rerank hands
# its workers a burst of small chunks per call, with the device's share of the call between bursts.
SPIN_SECONDS = 0.02
_LENGTH_BYTES = 8  # the length in front of each chunk, little-endian
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the folder holding pipelines/ and engine/
# What goes down to a worker: texts, or the first texts of pairs with their second texts.
Chunk = tuple[list[str], list[str] | None]
# What comes back, as the bytes of arrays: int32 ids back to back, each text's int64 length, whether
# each was truncated (bool), and for pairs int32 token types back to back. Bytes rather than the arrays
# themselves: an answer of one text took 18 us to unpickle and split on a 2-core box, its bytes 2.8.
Packed = tuple[bytes, bytes, bytes, bytes | None]


def default_processes(on_gpu: bool, rows: int | None = None, cores: int = CORES,
                      cores_per_process: int = THREADS_PER_PROCESS) -> int:
    """Worker processes for a run that does not say: one per `cores_per_process` cores beside a GPU;
    none for the CPU engine, which is slower than one process's tokenizer and needs the cores
    itself, nor for a run known to hold fewer than MIN_ROWS rows (rows=None: not known)."""
    if not on_gpu or cores < MIN_CORES or (rows is not None and rows < MIN_ROWS):
        return 0
    return cores // cores_per_process


def check_processes(processes: int | None, cores: int = CORES) -> None:
    """UserError for a --tokenizer-processes no pool can have, or more than there are cores to run them;
    None (the default) is fine."""
    if processes is not None and processes < 0:
        raise UserError(f"--tokenizer-processes {processes}: give 0 (tokenize without worker processes) "
                        "or a number of worker processes")
    if processes is not None and processes > cores:
        raise UserError(f"--tokenizer-processes {processes} is more than the {cores} cores this process may run on; "
                        f"give at most {cores}")


class TokenizerPool:
    """submit(texts) is a future of tokenizer.encode(texts), submit_pairs(firsts, seconds) one of
    tokenizer.encode_pairs(firsts, seconds); callers keep the futures in their order.

    With processes=0 every chunk runs on this process's threads; so does every chunk after a worker
    has died (a server keeps serving; the chunks that worker held fail with a UserError). Use it as
    a context manager, or call close(), which cancels the chunks not yet answered and stops the workers.

    pulled=True is for one thread that feeds a device between its waits (pair_scores): a worker's
    answers are then read by whichever thread calls result() or done() on its futures, not by a thread
    of their own, which would take the GIL from the feeding thread for each answer as it came (0.15 ms
    of that thread's time an answer on the H200 host: bench/results/gpu-2026-12-01-run88-rerank-pool-timeline).
    A pulled worker's futures call no done-callbacks until they are waited on.
    """

    def __init__(self, tokenizer: TextTokenizer, processes: int, cores: int = CORES, pulled: bool = False,
                 on_death: Callable[[int, str], None] | None = None) -> None:
        """on_death(pid, how) is called when a worker dies, by the thread that finds it dead (the worker's reader,
        or for a pulled pool the one waiting on its answers), once the chunks it held have failed: how it ended,
        as "was killed by signal 9 (out of memory?)". It must not raise."""
        if processes < 0:
            raise ValueError(f"processes must be 0 or more, not {processes}")
        self.tokenizer = tokenizer
        self.processes = processes
        self._closed = False
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="embedctl-tokenize")
        self._workers: list[_Worker] = []
        try:
            for _ in range(processes):
                # A pulled future's wait polls for its answer only where the workers leave it a core (_Worker.pull).
                self._workers.append(_Worker(tokenizer, max(1, cores // processes), pulled,
                                             SPIN_SECONDS if pulled and processes < cores else 0.0, on_death))
        except BaseException:
            self.close()
            raise

    @property
    def in_workers(self) -> bool:
        """Whether chunks go to the worker processes now: once all have started, while none has died."""
        return bool(self._workers) and all(worker.ready for worker in self._workers)

    def wait_for_workers(self) -> None:
        """Block until every worker has started (at once without any); UserError if one died instead."""
        for worker in self._workers:
            worker.wait_settled()
            if worker.failure is not None:
                raise worker.failure

    @property
    def depth(self) -> int:
        """Chunks worth keeping submitted and not yet collected: two per worker or thread."""
        return 2 * self.processes if self.in_workers else THREADS

    def submit(self, texts: Sequence[str]) -> Future[Encoded]:
        return self._submit(texts, None)

    def submit_pairs(self, firsts: Sequence[str], seconds: Sequence[str]) -> Future[Encoded]:
        return self._submit(firsts, seconds)

    def submit_spread(self, texts: Sequence[str], smallest: int,
                      seconds: Sequence[str] | None = None) -> list[Future[Encoded]]:
        """The texts (or the pairs (texts[i], seconds[i])) in consecutive chunks, one per worker but none
        under `smallest` texts (at least one chunk), so that one large request is tokenized on every
        worker side by side; their futures, in the texts' order."""
        chunks = max(1, min(len(self._workers) or THREADS, len(texts) // smallest))
        bounds = [len(texts) * chunk // chunks for chunk in range(chunks + 1)]
        return [self._submit(texts[start:end], None if seconds is None else seconds[start:end])
                for start, end in zip(bounds[:-1], bounds[1:])]

    def _submit(self, texts: Sequence[str], seconds: Sequence[str] | None) -> Future[Encoded]:
        """A chunk of texts, or of pairs (texts[i], seconds[i]), to the least busy worker, or to a thread."""
        if self._closed:
            raise RuntimeError("the tokenizer pool is closed")
        if not self.in_workers:
            if seconds is None:
                return self._threads.submit(self.tokenizer.encode, texts)
            return self._threads.submit(self.tokenizer.encode_pairs, texts, seconds)
        chunk = (list(texts), None if seconds is None else list(seconds))
        return min(self._workers, key=lambda worker: len(worker.pending)).submit(chunk)

    def close(self) -> None:
        self._closed = True
        with ExitStack() as stack:  # the threads stop and every worker is closed, whatever one of them raises
            stack.callback(self._threads.shutdown, wait=True, cancel_futures=True)
            for worker in self._workers:
                stack.callback(worker.close)

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class _Worker:
    """One worker process: its chunks go to its stdin, written by the submitting thread as far as the
    pipe takes them at once, the rest by a thread of the worker's; its answers come through a pipe of
    their own (so nothing the worker prints can garble them) and settle the futures in order, read by
    a thread of their own, or when pulled by the threads that wait on the futures (pull()).

    Why the submitting thread writes: on the H200 host (a virtual machine) waking a thread costs about
    as much as tokenizing two pairs (bench/results/gpu-2026-12-01-run89-pool-idle), and the writer
    thread slept between a rerank's bursts of chunks. Why a writer thread still: a submitter blocked
    on a full pipe could never read the answers that the worker, blocked on writing them, waits to
    hand over."""

    def __init__(self, tokenizer: TextTokenizer, threads: int, pulled: bool, spin_seconds: float,
                 on_death: Callable[[int, str], None] | None) -> None:
        answers, answers_for_worker = os.pipe()
        try:
            # Started in the package's own folder, so a folder named like ours where the user stands is not imported.
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pipelines.tokenize_pool", str(tokenizer.file.resolve()), str(tokenizer.max_length),
                 str(answers_for_worker)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(answers_for_worker,), cwd=_PACKAGE_ROOT,
                start_new_session=True, env={**os.environ, "RAYON_NUM_THREADS": str(threads)})
        except BaseException:
            os.close(answers)
            raise
        finally:
            os.close(answers_for_worker)
        self.answers = answers
        self._answered = _poller(answers)  # polled by a pulled worker's done() and pull()
        self._requests = self.process.stdin.fileno()
        os.set_blocking(self._requests, False)  # so that a submitter writes only what the pipe takes at once
        self._unwritten = 0  # chunks handed to the writer thread and not yet all written
        self.pulled = pulled
        self.on_death = on_death
        self.spin_seconds = spin_seconds  # how long pull() polls for an answer before it sleeps on the pipe
        self.settled = threading.Event()  # set once the worker has its tokenizer, or has died
        self.failure: UserError | None = None
        self.pending: deque[Future[Encoded]] = deque()  # submitted, not answered, in order
        self._lock = threading.Lock()
        self._pull_lock = threading.Lock()  # one thread at a time reads a pulled worker's answers
        self._closing = False
        self._ended = False
        self._outbox: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()  # frames, None to stop
        roles = ((self._write, "in"),) if pulled else ((self._write, "in"), (self._read, "out"))
        self._io = [threading.Thread(target=target, name=f"embedctl-tokenize-{name}", daemon=True)
                    for target, name in roles]
        for thread in self._io:
            thread.start()

    @property
    def ready(self) -> bool:
        if self.pulled and not self.settled.is_set():
            self.pull(block=False)
        return self.settled.is_set() and self.failure is None

    def wait_settled(self) -> None:
        """Block until the worker has its tokenizer, or has died."""
        if self.pulled:
            self.pull()
        self.settled.wait()

    def pull(self, until: Future[Encoded] | None = None, block: bool = True) -> None:
        """Read a pulled worker's answers in this thread until `until` is settled (None: until the
        worker has started); with block=False, only those already there to read. Blocking, it polls
        for the next answer up to spin_seconds before it sleeps on the pipe, as the worker polls for
        chunks: on the H200 host waking costs this thread about what a small chunk's answer takes.
        With the polling and the chunks written by the submitting thread, 8 workers reranked 25 / 50
        unseen pairs in 7.07 / 11.89 ms against 7.39-7.59 / 12.19-12.52 (bench/results/
        gpu-2026-12-01-run100-pool-writes-ab), and in 7.22, 6.96 / 12.21, 11.82 against 6.99, 7.49 /
        12.76, 12.23 (run101-pool-writes-ab2, alternating). Where the workers take every core it does
        not poll: on a 2-core box two workers and a polling thread took 7.0 ms for two small chunks
        against 1.8."""
        with self._pull_lock:
            while not self._ended and not (self.settled.is_set() if until is None else Future.done(until)):
                if not self._answered.poll(0):
                    if not block:
                        return
                    _poll_awhile(self._answered, self.spin_seconds)
                if not self._take():
                    self._end()

    def submit(self, chunk: Chunk) -> Future[Encoded]:
        result: Future[Encoded] = _Pulled(self) if self.pulled else Future()
        frame = memoryview(_frame(pickle.dumps(chunk, pickle.HIGHEST_PROTOCOL)))
        with self._lock:  # the queue and the pipe in the same order, whichever thread submits
            if self.failure is not None:
                raise self.failure
            if self._closing:  # its stdin may be closed, and the descriptor another file's by now
                raise RuntimeError("the tokenizer pool is closed")
            self.pending.append(result)
            if not self._unwritten:  # nothing ahead of it waits for the writer thread
                frame = frame[self._write_some(frame):]
            if frame:
                self._unwritten += 1
                self._outbox.put(frame)
        return result

    def close(self) -> None:
        with self._lock:  # no submit() writes from here on
            self._closing = True
        self.process.kill()
        self._outbox.put(None)
        for thread in self._io:
            thread.join()
        if self.pulled:
            with self._pull_lock:  # a thread still pulling gets the end of the pipe and stops
                if not self._ended:
                    self._end()
        self.process.wait()
        with suppress(OSError):  # a chunk half written when the worker was killed
            self.process.stdin.close()
        os.close(self.answers)

    def _write_some(self, frame: memoryview) -> int:
        """Bytes of frame written to the worker's stdin without waiting."""
        try:
            return os.write(self._requests, frame)
        except BlockingIOError:
            return 0
        except OSError:  # the worker is gone; reading its answers tells the callers
            return len(frame)

    def _write(self) -> None:
        """The writer thread: the chunks submit() could not write at once, in order, waiting for room."""
        room = select.poll()
        room.register(self._requests, select.POLLOUT)
        while (frame := self._outbox.get()) is not None:
            while frame:
                frame = frame[self._write_some(frame):]
                if frame:
                    room.poll()
            with self._lock:
                self._unwritten -= 1

    def _read(self) -> None:
        try:
            while self._take():
                pass
        finally:
            self._end()

    def _take(self) -> bool:
        """Read the worker's next answer and settle what it answers: its hello (the tokenizer is
        loaded), or the oldest chunk pending. False once the pipe has ended or garbled: the worker is
        of no more use."""
        try:
            frame = _read_frame(self.answers)
            if frame is None:
                return False
            answer = pickle.loads(frame)
            if not self.settled.is_set():
                self.settled.set()
                return True
            outcome = answer if isinstance(answer, BaseException) else _unpack(*answer)
            with self._lock:
                result = self.pending.popleft()
        except Exception:  # noqa: BLE001 - garbled, or an answer to no chunk
            return False
        if result.set_running_or_notify_cancel():  # else its caller gave up on it
            if isinstance(outcome, BaseException):
                result.set_exception(outcome)
            else:
                result.set_result(outcome)
        return True

    def _end(self) -> None:
        """Fail (or, closing, cancel) what the worker still held; after a death, say why from now on."""
        self._ended = True
        failure = None
        if not self._closing:
            self.process.kill()  # a worker whose answers cannot be read may still be alive
            how = _ended_how(self.process.wait())
            failure = UserError(f"a tokenizer process {how}; run again, or pass --tokenizer-processes 0 to tokenize "
                                "in the main process")
        with self._lock:
            self.failure = failure
            unanswered, self.pending = list(self.pending), deque()
        self.settled.set()
        for result in unanswered:
            if failure is None:
                result.cancel()
            elif result.set_running_or_notify_cancel():
                result.set_exception(failure)
        if failure is not None and self.on_death is not None:  # last: the pool has moved on, whatever it does
            self.on_death(self.process.pid, how)


class _Pulled(Future):
    """A pulled worker's future: waiting on it (result(), exception()), or asking whether it is done,
    reads the worker's answers."""

    def __init__(self, worker: _Worker) -> None:
        super().__init__()
        self._worker = worker

    def done(self) -> bool:
        self._worker.pull(self, block=False)
        return super().done()

    def result(self, timeout: float | None = None) -> Encoded:
        self._worker.pull(self)  # waits for the answer whatever the timeout
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._worker.pull(self)  # as result(): Future's own would wait for a reader that a pulled worker has not
        return super().exception(timeout)


def _ended_how(code: int) -> str:
    """How a process with this exit status ended, for a message."""
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return how + (" (out of memory?)" if code == -signal.SIGKILL else "")


def _unpack(flat: bytes, lengths: bytes, truncated: bytes, flat_types: bytes | None) -> Encoded:
    sizes = np.frombuffer(lengths, np.int64)
    return Encoded(ids=_split(np.frombuffer(flat, np.int32), sizes), truncated=np.frombuffer(truncated, bool).tolist(),
                   type_ids=None if flat_types is None else _split(np.frombuffer(flat_types, np.int32), sizes))


def _split(flat: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """flat in consecutive arrays of `sizes`; np.split gives one empty array for no sizes, and takes
    longer than the rest of an answer's unpacking for one."""
    if len(sizes) <= 1:
        return [flat] if len(sizes) else []
    return np.split(flat, np.cumsum(sizes)[:-1])


def _encode(tokenizer: TextTokenizer, chunk: Chunk) -> Packed:
    texts, seconds = chunk
    encoded = tokenizer.encode(texts) if seconds is None else tokenizer.encode_pairs(texts, seconds)
    lengths = np.fromiter(map(len, encoded.ids), np.int64, len(encoded.ids))
    types = None if encoded.type_ids is None else _flat(encoded.type_ids)
    return _flat(encoded.ids), lengths.tobytes(), np.asarray(encoded.truncated, dtype=bool).tobytes(), types


def _flat(arrays: list[np.ndarray]) -> bytes:
    """The arrays back to back as int32 bytes, which is how _unpack reads them whatever they were."""
    return np.concatenate(arrays, dtype=np.int32).tobytes() if arrays else b""


def _serve(tokenizer_file: str, max_length: str, answers_fd: str) -> None:
    """A worker's life: say hello once the tokenizer is loaded, then answer each chunk until stdin ends.

    A chunk the tokenizer fails on is answered with the exception, which the caller's future raises
    as it would have in the caller's own process."""
    answers = os.fdopen(int(answers_fd), "wb")
    requests = sys.stdin.fileno()
    tokenizer = TextTokenizer(Path(tokenizer_file), int(max_length))
    arrived = _poller(requests)
    _write_frame(answers, pickle.dumps(None))
    while (chunk := _receive(requests, arrived)) is not None:
        try:
            answer = pickle.dumps(_encode(tokenizer, chunk), pickle.HIGHEST_PROTOCOL)
        except Exception as error:  # noqa: BLE001 - handed to the caller
            answer = _pickled_error(error)
        _write_frame(answers, answer)


def _receive(requests: int, arrived: select.poll) -> Chunk | None:
    """The next chunk from the pipe, after polling for it up to SPIN_SECONDS; None once the parent has closed it."""
    _poll_awhile(arrived, SPIN_SECONDS)
    frame = _read_frame(requests)
    return None if frame is None else pickle.loads(frame)


def _poller(pipe: int) -> select.poll:
    """Whether the pipe has something to read, or has ended: poll(0) says at once (select's file
    descriptor limit does not apply)."""
    poller = select.poll()
    poller.register(pipe, select.POLLIN)
    return poller


def _poll_awhile(poller: select.poll, seconds: float) -> None:
    """Return once the poller's pipe has something to read, or has ended, or after `seconds`: a thread
    that polls stays awake for what comes, where one blocked in a read has to be woken."""
    awake_until = time.monotonic() + seconds
    while not poller.poll(0) and time.monotonic() < awake_until:
        pass


def _frame(payload: bytes) -> bytes:
    """The payload behind its length, as _read_frame reads it."""
    return len(payload).to_bytes(_LENGTH_BYTES, "little") + payload


def _write_frame(pipe: BinaryIO, payload: bytes) -> None:
    pipe.write(_frame(payload))
    pipe.flush()


def _read_frame(pipe: int) -> bytearray | None:
    """The next payload _frame framed; None at the pipe's end."""
    length = _read(pipe, _LENGTH_BYTES)
    return None if length is None else _read(pipe, int.from_bytes(length, "little"))


def _read(pipe: int, size: int) -> bytearray | None:
    """Exactly `size` bytes from the pipe (a read hands over what is there so far); None at its end."""
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        read = os.readv(pipe, [view[got:]])
        if not read:
            return None
        got += read
    return data


def _pickled_error(error: Exception) -> bytes:
    try:
        return pickle.dumps(error, pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an exception that does not pickle still gets its message across
        return pickle.dumps(RuntimeError(repr(error)), pickle.HIGHEST_PROTOCOL)


if __name__ == "__main__":
    _serve(*sys.argv[1:])
