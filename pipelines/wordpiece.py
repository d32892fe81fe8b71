"""Token ids of texts for BERT-style tokenizers, word by word, each word's ids cached, and each
stretch of text between spaces.

A tokenizer.json with BertPreTokenizer and a WordPiece model splits a text into words (runs between
whitespace and punctuation, and each punctuation character alone) and gives each word ids that
depend on that word only. The library builds an aligned string for every word on the way: a
512-token document of the docstrings corpus took 0.64 ms through encode_batch_fast (normalizer
already skipped), and 0.10 ms split here by one regex, each word's ids from a dict filled by the
library's own WordPiece model (Model.tokenize) on the word's first sight. So the vocabulary, the
subword rules and unknown words stay the library's; only the split at ASCII whitespace and
punctuation is done here, where it is a character class (tests/test_wordpiece.py checks it
against the library). A text is first cut at whitespace by str.split(), and each stretch's ids
are cached too, so that its words are looked up once: 25 pairs of 512 tokens from documents not
seen before took about as long as by words alone on one core (4.5-5.4 ms against 4.8-5.0), 50 pairs
9% less (9.1-9.2 against 10.1), and documents seen before 31-46% less
(bench/results/cpu-2026-12-01-text-stretches).

A text that is not ASCII is split the same way before it is normalized, when its normalizer works
character by character (BertNormalizer, Lowercase) and so never joins or splits across an ASCII
space or punctuation mark: each ASCII piece is normalized here, and each piece holding other
characters goes to the library whole, which normalizes and splits it as it would in the text.
Otherwise the few non-ASCII texts of a corpus (2% of the docstrings corpus) held up a batch of
ASCII ones, tokenized whole by the library.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable

from tokenizers import Tokenizer

# The ASCII characters BertPreTokenizer splits at: Rust's char::is_whitespace (removed; not the
# \x1c-\x1f that Python's str.isspace also counts) and char::is_ascii_punctuation (each kept alone).
_WHITESPACE = r"\t\n\x0b\x0c\r "
_PUNCTUATION = r"!-/:-@\[-`{-~"
_WORDS = re.compile(f"[^{_WHITESPACE}{_PUNCTUATION}]+|[{_PUNCTUATION}]")
# Where a slice of a text may end without splitting a word: after a space or a punctuation mark.
_WORD_BOUNDARY = re.compile(f"[{_WHITESPACE}{_PUNCTUATION}]")
# What str.split() splits at besides ASCII whitespace. The normalizer may remove such a character,
# joining the text around it (BertNormalizer's clean_text removes \x85), or the pre-tokenizer keep it
# inside a word (\x1c-\x1f), so a text holding one is split into words only.
_OTHER_SPACES = re.compile(r"[\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")
# ASCII control characters BertNormalizer's clean_text removes, joining the text around them (or,
# without it, split at: \x0b, \x0c), so a text holding one is split only after normalizing.
_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# Normalizers that map each character on its own, never across an ASCII space or punctuation mark.
_CHARACTERWISE = ("BertNormalizer", "Lowercase")
# A long text is split into words a slice at a time, this many characters per id still wanted, so
# that a text cut at max_length is not split whole. Fewer than the docstrings corpus has (3.6 at the
# median), so that a slice seldom overshoots and the next asks only for what is missing: 25 pairs of
# 512 tokens took 3.6-3.7 ms on one core against 4.2-4.3 at 5, where a slice that found no space
# before its end ran to the text's end (bench/results/cpu-2026-12-01-word-slices).
CHARS_PER_ID = 3
# Words and stretches held, about 180 bytes each; past it the cache starts again (the docstrings
# corpus, 4.25M tokens, fills 130,000: 25 MiB). Each tokenizer worker process holds its own.
MAX_CACHED = 1 << 18
# Longer pieces are not cached, so that the bound above is one on memory too: a stretch without
# ASCII whitespace (CJK text, base64, minified JSON) can be a whole document. And a text holding a
# longer piece that is not ASCII goes to the library, which tokenizes it without holding the GIL
# (a Chinese paragraph is one piece, all of it tokenized before a limit could stop it).
LONG_PIECE = 100


class WordPieceWords:
    """Ids of texts, without special tokens, for one BERT-style tokenizer."""

    def __init__(self, tokenizer: Tokenizer, normalize: Callable[[str], str], characterwise: bool) -> None:
        self._model = tokenizer.model
        self._normalize = normalize
        self._library = None  # for pieces of non-ASCII texts, with the normalizer and no truncation
        if characterwise:
            self._library = copy.deepcopy(tokenizer)
            self._library.no_truncation()
            self._library.no_padding()
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def of(cls, tokenizer: Tokenizer, normalize: Callable[[str], str] | None) -> WordPieceWords | None:
        """Words for a tokenizer that splits with BertPreTokenizer and has a WordPiece model, given what
        its normalizer does to ASCII text (pipelines.tokenize.ascii_normalizer); else None."""
        pre_tokenizer = spec_of(tokenizer.pre_tokenizer)
        if normalize is None or pre_tokenizer is None or pre_tokenizer["type"] != "BertPreTokenizer":
            return None
        if spec_of(tokenizer.model)["type"] != "WordPiece":
            return None
        normalizer = spec_of(tokenizer.normalizer)
        # An added token matched after normalization could span pieces that are normalized apart.
        characterwise = ((normalizer is None or normalizer["type"] in _CHARACTERWISE)
                         and not any(token.normalized for token in tokenizer.get_added_tokens_decoder().values()))
        return cls(tokenizer, normalize, characterwise)

    def ids(self, text: str, limit: int) -> list[int]:
        """The first ids of an ASCII text in normal form (and no added token in it): at least `limit`
        of them when it has that many (more may follow)."""
        return self._ids(text, limit, self._learn)

    def raw_ids(self, text: str, limit: int) -> list[int] | None:
        """The first ids of a text as given, with no added token's text in it, as ids() gives them; None
        when it cannot be split before normalizing (see the module's docstring, and _CONTROLS)."""
        if self._library is None or _CONTROLS.search(text):
            return None
        try:
            return self._ids(text, limit, self._learn_raw)
        except _LongPiece:
            return None

    def _ids(self, text: str, limit: int, learn: Callable[[str], tuple[int, ...]]) -> list[int]:
        ids: list[int] = []
        start = 0
        at_spaces = not _OTHER_SPACES.search(text)
        learn_piece = functools.partial(self._learn_stretch, learn=learn) if at_spaces else learn
        while start < len(text) and len(ids) < limit:
            end = _word_end(text, start + (limit - len(ids)) * CHARS_PER_ID)
            pieces = text[start:end].split() if at_spaces else _WORDS.findall(text, start, end)
            for piece in pieces:
                ids += self._cache.get(piece) or learn_piece(piece)
            start = end
        return ids

    def _learn_stretch(self, stretch: str, learn: Callable[[str], tuple[int, ...]]) -> tuple[int, ...]:
        ids: list[int] = []
        for word in _WORDS.findall(stretch):
            ids += self._cache.get(word) or learn(word)
        return self._remember(stretch, tuple(ids))

    def _learn(self, word: str) -> tuple[int, ...]:
        return self._remember(word, tuple(token.id for token in self._model.tokenize(word)))

    def _learn_raw(self, piece: str) -> tuple[int, ...]:
        if piece.isascii():
            return self._remember(piece, tuple(token.id for token in self._model.tokenize(self._normalize(piece))))
        if len(piece) > LONG_PIECE:
            raise _LongPiece
        return self._remember(piece, tuple(self._library.encode(piece, add_special_tokens=False).ids))

    def _remember(self, piece: str, ids: tuple[int, ...]) -> tuple[int, ...]:
        """Cached under the piece as found: a piece in normal form and one that normalizes to it (ids of
        a normalized text, raw_ids of a raw one) have the same ids."""
        if len(piece) <= LONG_PIECE:
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
            self._cache[piece] = ids
        return ids


class _LongPiece(Exception):
    """A piece of a text that is not ASCII is too long to tokenize here (LONG_PIECE)."""


def _word_end(text: str, end: int) -> int:
    """`end`, moved on past the next ASCII whitespace or punctuation mark so that no word is split;
    else the text's end. Not only whitespace: a text without any (base64, minified JSON) was split
    whole, 2.6 s for a megabyte of base64 of which 256 tokens were kept."""
    boundary = _WORD_BOUNDARY.search(text, end)
    return boundary.end() if boundary else len(text)


def spec_of(component: object | None) -> dict | None:
    """A tokenizer component's settings, as tokenizer.json holds them."""
    return None if component is None else json.loads(component.__getstate__())
