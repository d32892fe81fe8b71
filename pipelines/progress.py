"""The callback through which a long pipeline run (index, score) says how far it has got."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def __call__(self, done: int, tokens: int, total: int | None) -> None:
        """done: items finished so far (rows, documents, queries), skipped ones included; tokens: tokens
        embedded so far; total: the items of the whole run, when known."""
