"""One run at a time per output: an exclusive fcntl.flock on a small file beside the output.

The kernel releases a flock when its holder dies, however it dies, so the lock of a killed run is
stale by construction and the next run simply takes it: there is no timeout to tune and no pid to
probe. The file records the holder's pid, host and start time for the message a refused run prints,
and is removed when the holder finishes. It guards local paths only (flock does not reach across
machines); remote outputs are not locked.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from engine.errors import UserError


class OutputLocked(UserError):
    """Another live run holds the output."""


@contextmanager
def hold_lock(path: str | None, shown: str) -> Iterator[None]:
    """Hold the lock file at path for the block (nothing when path is None); raise OutputLocked if taken."""
    if path is None:
        yield
        return
    parent = os.path.dirname(path)
    made = _missing_folders(parent)  # made for this run: removed again if it leaves them empty
    try:
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd = _acquire(path, shown)
    except (FileExistsError, NotADirectoryError) as error:  # a file where a folder of the path should be
        raise UserError(f"cannot write beside {shown}: {_file_in_the_way(parent) or error.filename} is a file, not "
                        "a folder; pick another output") from None
    except OSError as error:
        raise UserError(f"cannot write beside {shown} ({error.strerror}: {error.filename}); check that folder's "
                        "permissions, or pick another output") from None
    try:
        _record_holder(fd)
        yield
    finally:
        os.unlink(path)  # before the unlock, so that a waiting run never locks a file about to vanish
        os.close(fd)
        for folder in made:  # deepest first; a failed run leaves no empty folders behind
            try:
                os.rmdir(folder)
            except OSError:
                break  # not empty: the output is in it


def _record_holder(fd: int) -> None:
    """Who holds the lock, for the message of a run it refuses. Best effort: the lock is the flock, and a full
    disk must not fail a run that may have nothing to write."""
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
    except OSError:
        pass


def _file_in_the_way(folder: str) -> str | None:
    """The first part of folder's path that exists and is not a folder, if any."""
    parts = folder.split(os.sep)
    for end in range(1, len(parts) + 1):
        path = os.sep.join(parts[:end])
        if path and os.path.exists(path) and not os.path.isdir(path):
            return path
    return None


def _missing_folders(folder: str) -> list[str]:
    """folder and its parents that do not exist yet, deepest first."""
    missing = []
    while folder and not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing


def _acquire(path: str, shown: str) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputLocked(f"{shown} is being written by another embedctl run ({holder}); wait for it to "
                               "finish, or write to another output") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the previous holder removed the file between our open and our lock: take the new one


def _holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it has not said who it is yet"
