"""Small file helpers shared by the pipeline tests: write JSONL inputs, snapshot a directory's bytes."""

from __future__ import annotations

import json
from pathlib import Path


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under directory, by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def write_jsonl(path: Path, rows: list[object]) -> Path:
    """One line per row: a str is written as it is (to plant malformed lines), anything else as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path
