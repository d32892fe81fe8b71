"""TokenizerPool: worker processes give exactly what the tokenizer gives in this process, and leave nothing behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future

import pytest

from engine import UserError
from pipelines.tokenize import Encoded, TextTokenizer
from pipelines.tokenize_pool import TokenizerPool, check_processes, default_processes
from tests.files import child_processes
from tests.models import minilm_path

TEXTS = ["Short text.", "  padded text  ", "Ünïcödé and 漢字 text.", "A long sentence that goes on. " * 200,
         "[SEP] holds a special token", "tabs\tand\nnewlines"]


# Answers read by a thread per worker, or by the threads that wait for them.
PULLED = pytest.mark.parametrize("pulled", [False, True], ids=["reader-threads", "pulled"])


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(minilm_path() / "tokenizer.json", 128)


def joined(parts: list[Encoded]) -> Encoded:
    """The answers of consecutive chunks as one."""
    return Encoded(ids=[ids for part in parts for ids in part.ids],
                   truncated=[truncated for part in parts for truncated in part.truncated],
                   type_ids=None if parts[0].type_ids is None else [types for part in parts for types in part.type_ids])


def assert_same(got: object, want: object) -> None:
    assert [ids.tolist() for ids in got.ids] == [ids.tolist() for ids in want.ids]
    assert got.truncated == want.truncated
    assert (got.type_ids is None) == (want.type_ids is None)
    if want.type_ids is not None:
        assert [types.tolist() for types in got.type_ids] == [types.tolist() for types in want.type_ids]


@PULLED
def test_workers_give_what_the_tokenizer_gives(tokenizer: TextTokenizer, pulled: bool) -> None:
    # Chunks of about 80 kB do not fit in a pipe: the submitting thread writes what fits, the worker's
    # writer thread the rest, and the chunks after it, in order, once it has.
    large = [[f"document {i} about tables and the rows they hold " * 2 for i in range(start, start + 800)]
             for start in range(0, 32_000, 800)]
    chunks = [TEXTS, TEXTS[::-1], TEXTS[2:3], [f"document {i} about tables" for i in range(300)],
              *(chunk for pair in zip(large, [TEXTS[i % 6:] for i in range(len(large))]) for chunk in pair)]
    before = child_processes()
    with TokenizerPool(tokenizer, processes=2, pulled=pulled, cores=8) as pool:  # cores: a pulled pool's waits poll
        pool.wait_for_workers()
        assert pool.in_workers and pool.depth == 4
        futures = [pool.submit(chunk) for chunk in chunks]
        for chunk, future in zip(chunks, futures):
            assert_same(future.result(timeout=60), tokenizer.encode(chunk))
    assert futures[0].result().truncated[3]  # the long text was cut in a worker, and said so
    assert child_processes() == before


@PULLED
def test_workers_give_the_pairs_the_tokenizer_gives(tokenizer: TextTokenizer, pulled: bool) -> None:
    """Pairs (a query with each text, a long query with a long text) come back with their token types."""
    chunks = [(["a question"] * len(TEXTS), TEXTS), ([TEXTS[3]] * 2, [TEXTS[3], "short"]), ([], [])]
    with TokenizerPool(tokenizer, processes=2, pulled=pulled) as pool:
        pool.wait_for_workers()
        futures = [pool.submit_pairs(firsts, seconds) for firsts, seconds in chunks]
        for (firsts, seconds), future in zip(chunks, futures):
            assert_same(future.result(timeout=60), tokenizer.encode_pairs(firsts, seconds))
    assert futures[0].result().truncated[3] and futures[1].result().truncated == [True, True]
    with TokenizerPool(tokenizer, processes=0) as pool:  # on this process's threads
        assert_same(pool.submit_pairs(*chunks[0]).result(), tokenizer.encode_pairs(*chunks[0]))


def test_a_request_spread_over_the_workers_joins_back_in_order(tokenizer: TextTokenizer) -> None:
    texts = [f"{text} {i}" for i in range(7) for text in TEXTS]  # 42 texts, the long ones cut
    with TokenizerPool(tokenizer, processes=2) as pool:
        pool.wait_for_workers()
        spread = pool.submit_spread(texts, smallest=8)
        assert len(spread) == 2  # a chunk per worker
        assert_same(joined([future.result(timeout=60) for future in spread]), tokenizer.encode(texts))
        assert len(pool.submit_spread(texts[:15], smallest=8)) == 1  # no chunk under `smallest` texts
        assert len(pool.submit_spread(texts[:3], smallest=8)) == 1
        queries = [f"question {i}" for i in range(len(texts))]
        pairs = pool.submit_spread(queries, 8, texts)
        assert len(pairs) == 2
        assert_same(joined([future.result(timeout=60) for future in pairs]), tokenizer.encode_pairs(queries, texts))


def test_a_pulled_pool_reads_answers_only_in_the_threads_that_wait_for_them(tokenizer: TextTokenizer) -> None:
    with TokenizerPool(tokenizer, processes=2, pulled=True) as pool:
        pool.wait_for_workers()
        assert not [thread for thread in threading.enumerate() if thread.name == "embedctl-tokenize-out"]
        futures = [pool.submit_pairs(["a question"] * 2, TEXTS[i:i + 2]) for i in range(0, 6, 2)]
        time.sleep(1)  # long enough for the workers to answer all three
        assert not any(Future.done(future) for future in futures)  # nobody has read the answers yet
        # Chunks 0 and 2 went to the first worker, chunk 1 to the second. Asking reads what its own worker answered:
        assert futures[1].done() and not Future.done(futures[0])
        assert_same(futures[2].result(), tokenizer.encode_pairs(["a question"] * 2, TEXTS[4:6]))
        assert Future.done(futures[0])  # read on the way, in order
        for i, future in zip(range(0, 6, 2), futures):
            assert_same(future.result(), tokenizer.encode_pairs(["a question"] * 2, TEXTS[i:i + 2]))


def test_chunks_submitted_before_the_workers_start_run_on_threads(tokenizer: TextTokenizer) -> None:
    with TokenizerPool(tokenizer, processes=1) as pool:
        assert not pool.in_workers and pool.depth == 2  # a spawned worker takes a few tenths of a second to start
        assert_same(pool.submit(TEXTS).result(timeout=60), tokenizer.encode(TEXTS))
    with TokenizerPool(tokenizer, processes=0) as pool:
        assert not pool.in_workers and pool.depth == 2
        assert_same(pool.submit(TEXTS).result(), tokenizer.encode(TEXTS))


@PULLED
def test_a_worker_that_dies_fails_what_it_held_and_threads_take_over(tokenizer: TextTokenizer, pulled: bool) -> None:
    before, deaths = child_processes(), []
    with TokenizerPool(tokenizer, processes=1, pulled=pulled, on_death=lambda *death: deaths.append(death)) as pool:
        pool.wait_for_workers()
        assert_same(pool.submit(TEXTS).result(timeout=60), tokenizer.encode(TEXTS))
        held = pool.submit(TEXTS * 500)
        [worker] = child_processes() - before
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(UserError, match=r"a tokenizer process was killed by signal 9 \(out of memory\?\); "
                                            r"run again, or pass --tokenizer-processes 0"):
            held.result(timeout=60)
        assert deaths == [(worker, "was killed by signal 9 (out of memory?)")]  # a server logs it (on_death)
        assert not pool.in_workers
        assert_same(pool.submit(TEXTS).result(timeout=60), tokenizer.encode(TEXTS))  # on this process's threads
    assert child_processes() == before


@PULLED
def test_an_error_in_a_worker_is_the_error_this_process_would_raise(tokenizer: TextTokenizer, pulled: bool) -> None:
    bad = ["fine", "a lone surrogate \ud800 here"]
    with pytest.raises(TypeError) as in_process:
        tokenizer.encode(bad)
    with TokenizerPool(tokenizer, processes=1, pulled=pulled) as pool:
        pool.wait_for_workers()
        with pytest.raises(TypeError) as in_worker:
            pool.submit(bad).result(timeout=60)
        assert str(in_worker.value) == str(in_process.value)
        assert str(pool.submit(bad).exception(timeout=60)) == str(in_process.value)
        assert pool.in_workers  # the worker goes on
        assert_same(pool.submit(TEXTS).result(timeout=60), tokenizer.encode(TEXTS))


@PULLED
def test_a_cancelled_chunk_leaves_the_worker_serving(tokenizer: TextTokenizer, pulled: bool) -> None:
    """asyncio.wrap_future cancels the pool's future when a request is cancelled; the answer that
    comes later must not stop the worker's reader."""
    with TokenizerPool(tokenizer, processes=1, pulled=pulled) as pool:
        pool.wait_for_workers()
        given_up = pool.submit(TEXTS * 50)
        assert given_up.cancel()
        assert_same(pool.submit(TEXTS).result(timeout=60), tokenizer.encode(TEXTS))
        assert given_up.cancelled() and pool.in_workers


@PULLED
def test_close_stops_workers_still_starting_and_cancels_what_they_hold(tokenizer: TextTokenizer, pulled: bool) -> None:
    before = child_processes()
    pool = TokenizerPool(tokenizer, processes=2, pulled=pulled)
    assert len(child_processes() - before) == 2
    pool.close()
    assert child_processes() == before
    with TokenizerPool(tokenizer, processes=1, pulled=pulled) as pool:
        pool.wait_for_workers()
        held = [pool.submit(TEXTS * 200) for _ in range(3)]
    assert child_processes() == before
    assert all(future.done() for future in held)
    assert any(future.cancelled() for future in held)


def test_a_negative_count_or_more_than_the_cores_is_refused_with_the_flag_named() -> None:
    with pytest.raises(UserError, match=r"--tokenizer-processes -1: give 0"):
        check_processes(-1)
    with pytest.raises(UserError, match=r"--tokenizer-processes 100000 is more than the 16 cores .* give at most 16"):
        check_processes(100_000, cores=16)  # each would be a process: a typo must not fork until memory runs out
    check_processes(None)
    check_processes(0)
    check_processes(16, cores=16)


def test_processes_only_beside_a_gpu_on_enough_cores_for_enough_rows() -> None:
    assert default_processes(on_gpu=True, cores=16) == 4
    assert default_processes(on_gpu=True, rows=60_000, cores=32) == 8
    assert default_processes(on_gpu=True, rows=10_000, cores=16) == 0
    assert default_processes(on_gpu=True, cores=4) == 0
    assert default_processes(on_gpu=False, cores=64) == 0
