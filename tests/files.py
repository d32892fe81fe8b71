"""Helpers shared by the pipeline and command-line tests: inputs to write, outputs to check."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under directory, by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def write_jsonl(path: Path, rows: list[object]) -> Path:
    """One line per row: a str is written as it is (to plant malformed lines), anything else as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


# One torch thread per subprocess: tests run side by side on two cores (see tests/test_cli.py).
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def hears_ctrl_c() -> None:
    """A Popen preexec_fn for a command a test sends SIGINT: a test run started in the background of a script
    (`pytest &`) passes SIGINT on as ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(*args: object, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The command line as a user runs it: a subprocess in cwd, with env's variables added to ENV."""
    return subprocess.run([sys.executable, "-m", "embedctl.cli", *map(str, args)], cwd=cwd, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=300)


def run_cli_in_terminal(*args: object, cwd: Path) -> tuple[int, str]:
    """The command line with its stderr on a terminal (a pseudo-terminal), as a person watching it has it:
    the exit code and everything the terminal received."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "embedctl.cli", *map(str, args)], cwd=cwd, env=ENV,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=secondary)
    os.close(secondary)
    received = bytearray()
    while True:  # read as it comes: a full terminal buffer would block the command
        try:
            data = os.read(primary, 65536)
        except OSError:  # EIO: the command and its children have closed the terminal
            break
        if not data:
            break
        received += data
    os.close(primary)
    return process.wait(timeout=300), received.decode(errors="replace")


@contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """folder and the folders under it read-only for the block; skips the test where the OS lets this
    process write there anyway (root)."""
    folders = [folder, *(path for path in folder.rglob("*") if path.is_dir())]
    for path in folders:
        path.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("read-only folders do not stop this process (root) from writing")
        yield
    finally:
        for path in folders:
            path.chmod(0o755)


def good_rows(prefix: str, n: int = 2) -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": f"A good line, number {i}."} for i in range(n)]


def assert_one_error_line(result: subprocess.CompletedProcess, *phrases: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for phrase in phrases:
        assert phrase in lines[0]
    return lines[0]


def child_processes() -> set[int]:
    """The process ids of this process's children (a pipeline's worker processes, say; torch.compile
    keeps workers of its own, so compare with the set from before)."""
    children = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            children.update(int(pid) for pid in (task / "children").read_text().split())
        except FileNotFoundError:  # a thread that ended while we looked
            pass
    return children
