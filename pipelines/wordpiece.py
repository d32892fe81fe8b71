"""Token ids of normalized ASCII text for BERT-style tokenizers, word by word, each word's ids cached.

A tokenizer.json with BertPreTokenizer and a WordPiece model splits a text into words (runs between
whitespace and punctuation, and each punctuation character alone) and gives each word ids that
depend on that word only. The library builds an aligned string for every word on the way: a
512-token document of the docstrings corpus took 0.64 ms through encode_batch_fast (normalizer
already skipped), and 0.10 ms split here by one regex, each word's ids from a dict filled by the
library's own WordPiece model (Model.tokenize) on the word's first sight. So the vocabulary, the
subword rules and unknown words stay the library's; only the split into words is done here, for
ASCII, where it is a character class (tests/test_wordpiece.py checks it against the library).
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

# The ASCII characters BertPreTokenizer splits at: Rust's char::is_whitespace (removed; not the
# \x1c-\x1f that Python's str.isspace also counts) and char::is_ascii_punctuation (each kept alone).
_WHITESPACE = r"\t\n\x0b\x0c\r "
_PUNCTUATION = r"!-/:-@\[-`{-~"
_WORDS = re.compile(f"[^{_WHITESPACE}{_PUNCTUATION}]+|[{_PUNCTUATION}]")
# A long text is split into words a slice at a time, this many characters per id still wanted, so
# that a text cut at max_length is not split whole (the docstrings corpus needs 3.6 at the median).
CHARS_PER_ID = 5
# Distinct words held; past it the cache starts again (a corpus of 4.25M tokens has about 120,000).
MAX_WORDS = 1 << 20


class WordPieceWords:
    """Ids of normalized ASCII texts, without special tokens, for one WordPiece tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._model = tokenizer.model
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> WordPieceWords | None:
        """Words for the tokenizer, when it splits with BertPreTokenizer and has a WordPiece model."""
        pre_tokenizer, model = tokenizer.pre_tokenizer, json.loads(tokenizer.model.__getstate__())
        if pre_tokenizer is None or json.loads(pre_tokenizer.__getstate__())["type"] != "BertPreTokenizer":
            return None
        return cls(tokenizer) if model["type"] == "WordPiece" else None

    def ids(self, text: str, limit: int) -> list[int]:
        """The text's first ids, at least `limit` of them when it has that many (more may follow).

        The text must be ASCII and as the tokenizer's normalizer leaves it, with no added token in it.
        """
        ids: list[int] = []
        start = 0
        while start < len(text) and len(ids) < limit:
            end = _word_end(text, start, start + (limit - len(ids)) * CHARS_PER_ID)
            for word in _WORDS.findall(text, start, end):
                ids += self._cache.get(word) or self._learn(word)
            start = end
        return ids

    def _learn(self, word: str) -> tuple[int, ...]:
        if len(self._cache) >= MAX_WORDS:
            self._cache.clear()
        ids = self._cache[word] = tuple(token.id for token in self._model.tokenize(word))
        return ids


def _word_end(text: str, start: int, end: int) -> int:
    """`end`, moved back past a space after `start` so that no word is split; else the text's end."""
    if end >= len(text):
        return len(text)
    space = text.rfind(" ", start, end)
    return space + 1 if space >= 0 else len(text)
