"""How a long pipeline run (index, score) speaks to the person running it: the callback through which
it says how far it has got, and the counts its messages print with their nouns."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def __call__(self, done: int, tokens: int, total: int | None) -> None:
        """done: items finished so far (rows, documents, queries), skipped ones included; tokens: tokens
        embedded so far; total: the items of the whole run, when known."""


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """count with thousands separators and its noun in agreement: plural(1, "row") is "1 row",
    plural(2_000, "row") "2,000 rows"; nouns for a plural that is not noun + "s" ("query", "queries")."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
