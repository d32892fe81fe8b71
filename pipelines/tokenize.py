"""Texts to token ids with the model's tokenizer.json, through the `tokenizers` library.

Texts are tokenized as they are, surrounding spaces and newlines included, as sentence-transformers
(since v6) and text-embeddings-inference do: for a byte-level tokenizer (Qwen3's) they are tokens of
their own. They are truncated at the model's max length (special
tokens included) and never padded: the engine packs sequences back to back. Each result says how
many tokens were kept and whether the text was cut. Batch encoding runs in Rust threads and
releases the GIL, so a pipeline thread can tokenize while the engine computes; its fast variant
skips the character offsets nobody here reads.

Four things spare the tokenizer work whose result would be thrown away, each only where it gives
exactly the ids the library gives for the whole text (tests/test_tokenize.py, tests/test_wordpiece.py):
- texts and pairs of BERT-style tokenizers (BertPreTokenizer, WordPiece) are split into words here
  and the ids of each word and each stretch between spaces cached (pipelines/wordpiece.py): six
  times faster than the library on one core, though under the GIL;
- long texts, and pairs' long documents, are tokenized only as far as the kept tokens need
  (encode_cut, TextTokenizer.encode_pairs), for pre-tokenizers that split at spaces (cuts_at_spaces),
  and also before punctuation marks and, for BERT's, between Chinese characters (cut_points);
- ASCII texts skip the library's normalizer, which keeps an alignment for every character and took
  38% of MiniLM's tokenizer time: on ASCII its effect is a bytes.translate and a str.lower
  (ascii_normalizer), which CPython runs at memory speed;
- fewer pairs than cores (a cross-encoder's few long pairs) are tokenized in pieces on every core
  rather than one pair per core, and put together with the tokenizer's own pair template
  (TextTokenizer.encode_pairs).
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from engine.checkpoint import ModelFiles
from engine.errors import UserError
from pipelines.wordpiece import WordPieceWords, spec_of

# The prompt names sentence-transformers' encode_query / encode_document look for, in order.
ROLE_PROMPTS = {"query": ("query",), "document": ("document", "passage", "corpus")}
# A long text is first cut at a space before this many characters per kept token, then, if that
# was too few, at twice as many, and so on (see encode_cut).
CUT_CHARS_PER_TOKEN = 5
# encode() reads a long text from a head of this many characters per kept token, and the rest only
# when the head holds too few tokens: twice the first cut, so that a text the cut would widen seldom
# costs a second pass.
HEAD_CHARS_PER_TOKEN = 2 * CUT_CHARS_PER_TOKEN
# Characters tokenized at once while counting a long input's tokens (more_tokens_than): enough to keep the
# library's threads busy, few enough that the work and memory past the limit stay small.
COUNT_CHARS = 1 << 16
# About the tokenizer's Rust threads: rayon sizes its pool by the cores this process may use, unless
# RAYON_NUM_THREADS or a cgroup quota says otherwise.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
# Pairs' documents are split into about CORES pieces, none shorter than this: each piece costs a
# Python object and a list of ids, which outweigh the parallel work below a few dozen tokens.
MIN_PIECE_CHARS = 256
# BertNormalizer's clean_text on ASCII: tab, newline and return become spaces, other control characters
# go. As a bytes.translate: a str.translate with a dict took four times as long.
_ASCII_SPACES = bytes.maketrans(b"\t\n\r", b"   ")
_ASCII_CONTROLS = bytes(code for code in (*range(0x20), 0x7F) if code not in b"\t\n\r")
# Normal forms change no ASCII character.
_ASCII_UNCHANGED = ("NFC", "NFD", "NFKC", "NFKD")
# BertNormalizer's Chinese characters: with handle_chinese_chars it puts a space on each side of one. Its list
# (tokenizers' is_chinese_char) leaves out U+2B820-U+2B91F, the start of Extension E, which stay word characters.
_IDEOGRAPHS = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002b81f"
                         "\U0002b920-\U0002ceaf\U0002f800-\U0002fa1f]")
# Punctuation marks a cut may end before (cut_points): ASCII's and the commonest Chinese and Japanese ones.
_CUT_MARKS = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~，。、；：？！"
# What a space-splitting pattern's piece may end with before a punctuation mark, for a cut there to give
# the whole text's pieces (cut_points): ASCII letters and digits, kana and the two main blocks of Chinese
# characters, all assigned and left letters by NFC. Not every letter: NFC splits some (U+0958, Devanagari's qa,
# a composition exclusion) into a letter and a mark, which joins the punctuation mark after it in one piece;
# and an unassigned code point is no letter to the pattern, so it joins the punctuation mark too.
_PIECE_ENDS = "[A-Za-z0-9\u3041-\u3096\u30a1-\u30fa\u3400-\u4dbf\u4e00-\u9fff]"
# Split patterns that end a piece at a single space between two visible characters and start the
# next with it (no alternative spans a visible character and the space after it): GPT-2's, and the
# one of Qwen2 and Qwen3.
_SPACE_SPLITTING_PATTERNS = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

Template = list[tuple[str | np.ndarray, int]]  # "A", "B" or special-token ids, each with its token type


@dataclass(frozen=True)
class Encoded:
    ids: list[np.ndarray]  # int32 token ids per text
    truncated: list[bool]
    type_ids: list[np.ndarray] | None = None  # int32 token types per pair; None for single texts

    def past_table(self, rows: int, name: Callable[[int], str]) -> str | None:
        """Why the first text holding an id past an embedding table of `rows` rows cannot be embedded (a
        token the tokenizer adds that the weights never learnt, as Qwen3-Embedding-4B's <think>), naming
        text i by name(i); None when no text holds one."""
        for text, ids in enumerate(self.ids):
            if len(ids) and (largest := int(ids.max())) >= rows:
                return (f"{name(text)} holds token id {largest}, which the tokenizer adds but the model's embedding "
                        "table lacks; leave that token out of the text")
        return None


PairResult = tuple[np.ndarray, np.ndarray, bool]  # a pair's int32 ids and token types, and whether it was truncated


@dataclass(frozen=True)
class ShortQuery:
    """A pair's query that truncation keeps whole (TextTokenizer._short_queries)."""

    ids: np.ndarray  # its ids without special tokens
    left: int  # the room it leaves for the document's tokens


def _pair_result(encoding: Encoding, types_by_sequence: bool) -> PairResult:
    """types_by_sequence: token types from each token's text (0, then 1), for a tokenizer without a post-processor,
    whose types encode_batch_fast leaves 0 where encode and encode_batch (and so sentence-transformers) give the
    second text 1."""
    types = [sequence or 0 for sequence in encoding.sequence_ids] if types_by_sequence else encoding.type_ids
    return (np.asarray(encoding.ids, dtype=np.int32), np.asarray(types, dtype=np.int32), bool(encoding.overflowing))


def _encoded_pairs(results: dict[int, PairResult], pairs: int) -> Encoded:
    """Encoded from each of `pairs` pairs' result, by pair index."""
    ordered = [results[i] for i in range(pairs)]
    return Encoded(ids=[ids for ids, _, _ in ordered], truncated=[truncated for _, _, truncated in ordered],
                   type_ids=[types for _, types, _ in ordered])


@functools.cache
def _beside() -> ThreadPoolExecutor:
    """Threads that each tokenize one batch while their caller tokenizes another: the library releases
    the GIL while it works, and both batches share its pool of Rust threads. Up to CORES callers at
    once (a server's request threads) each get one, started as they are first needed."""
    return ThreadPoolExecutor(CORES, thread_name_prefix="embedctl-tokenize-beside")


if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads: it makes its own
    os.register_at_fork(after_in_child=_beside.cache_clear)


class TextTokenizer:
    """A model's tokenizer: texts (or pairs) to ids with its special tokens, truncated at max_length.

    by_words: split BERT-style texts into words here (pipelines/wordpiece.py), which holds the GIL
    while it works. False for threads that tokenize large chunks beside a thread that needs the GIL
    to keep the device fed: in such threads MiniLM's index on the H200 made 1.66M tokens/s by words
    against 3.26M through the library, which releases the GIL
    (bench/results/gpu-2026-12-01-run75-index-serve-words).
    """

    def __init__(self, tokenizer_file: Path, max_length: int, by_words: bool = True) -> None:
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            raise UserError(f"{tokenizer_file} is not a usable tokenizer.json ({error}); "
                            "replace it with the model's own tokenizer.json") from None
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length)
        self.file, self.max_length = Path(tokenizer_file), max_length
        pre_tokenizer = spec_of(self.tokenizer.pre_tokenizer)
        normalizer = spec_of(self.tokenizer.normalizer)
        self._normalize = ascii_normalizer(normalizer)
        self._no_normalizer = normalizer is None  # then every text's normal form is known, not only ASCII
        # Texts the normalizer would leave as they are go to a copy without it; pairs put together
        # here (needing a pair template) tokenize their pieces with a copy that does not truncate either
        # (_bare_pieces, made on the first pairs: a copy costs a tenth of a second, which index never needs).
        post_processor = spec_of(self.tokenizer.post_processor)
        self._types_by_sequence = post_processor is None
        self._templates = {kind: template(post_processor, kind) for kind in ("single", "pair")}
        self._text_end = _text_end(self.tokenizer)
        self._room = {kind: max_length - self.tokenizer.num_special_tokens_to_add(kind == "pair")
                      for kind in ("single", "pair")}
        self._words = WordPieceWords.of(self.tokenizer, self._normalize) if by_words else None
        self._bare = None
        if self._normalize is not None:
            self._bare = self.tokenizer if self._no_normalizer else _without_normalizer(self.tokenizer)
        # An added token is matched in the text before normalization (normalized=False) or after it, so
        # a text holding one in either form goes to the tokenizer whole; so does one holding a token's
        # normalized form, which the copy without a normalizer would match as written.
        contents = [token.content for token in self.tokenizer.get_added_tokens_decoder().values()]
        normalize = self.tokenizer.normalizer.normalize_str if self.tokenizer.normalizer else str
        self._added_raw = _any_of(contents)
        self._added_normalized = _any_of(contents + [normalize(content) for content in contents])
        # A cut at a space must not split what the whole text tokenizes as one: an added token holding a space
        # (matched across it; not one whose normal form alone has spaces, BERT's around Chinese characters, which
        # the text lacks there), or a normalizer's replacement that matches across one.
        self._cuts = (cuts_at_spaces(pre_tokenizer) and not joins_across_spaces(normalizer)
                      and not any(_has_space(content) for content in contents))
        self._cut_points = cut_points(normalizer, pre_tokenizer, contents) if self._cuts else None
        self._head_chars = max_length * HEAD_CHARS_PER_TOKEN

    @property
    def cuts_at_spaces(self) -> bool:
        """Whether text on either side of a single space tokenizes as in the whole text (cuts_at_spaces)."""
        return self._cuts

    @functools.cached_property
    def _bare_pieces(self) -> Tokenizer:
        pieces = _without_normalizer(self.tokenizer)
        pieces.no_truncation()
        return pieces

    @functools.cached_property
    def _from_left(self) -> Tokenizer:
        left = copy.deepcopy(self.tokenizer)
        left.enable_truncation(self.max_length, direction="left")
        return left

    def encode_from_left(self, firsts: Sequence[str], seconds: Sequence[str] | None = None) -> Encoded:
        """encode(firsts), or encode_pairs(firsts, seconds), but an over-long input loses its start instead
        of its end: the library's own truncation with direction left, which text-embeddings-inference's
        truncation_direction "Left" asks for (a pair is cut longest first, each text from its start).
        Through the library whole, for a rare request: none of encode()'s shortcuts."""
        if seconds is None:
            encodings = self._from_left.encode_batch(list(firsts))
            return Encoded(ids=[np.asarray(e.ids, dtype=np.int32) for e in encodings],
                           truncated=[bool(e.overflowing) for e in encodings])
        pairs = list(zip(firsts, seconds, strict=True))
        results = dict(enumerate(_pair_result(e, self._types_by_sequence) for e in self._from_left.encode_batch(pairs)))
        return _encoded_pairs(results, len(pairs))

    def cut_ids(self, ids: Sequence[int], limit: int) -> np.ndarray:
        """Token ids cut to `limit` as a text's are: ids that end as the model's template ends a text
        (with [SEP], as /tokenize gives them) keep that end, the cut falling before it."""
        ids = np.asarray(ids, dtype=np.int32)
        if len(ids) <= limit:
            return ids
        end = self._text_end
        if 0 < len(end) < limit and np.array_equal(ids[len(ids) - len(end):], end):
            return np.concatenate([ids[: limit - len(end)], end])
        return ids[:limit]

    def encode(self, texts: Sequence[str]) -> Encoded:
        """Token ids of each text, truncated at max_length, exactly as the tokenizer gives them.

        A long text is first tokenized from its head, cut (see _cut) at HEAD_CHARS_PER_TOKEN characters
        per kept token: when that overflows, its first tokens are the whole text's, and the rest of
        the text is never read, where checking it for added tokens and normalizing it cost as much as
        tokenizing (17,900-character documents took 0.44 ms each against 0.18 for their first 3,000).
        A head that does not overflow is tokenized again whole.
        """
        texts = list(texts)
        heads = [_cut(text, self._head_chars, self._cut_points) if self._cuts else text for text in texts]
        encoded = self._encode(heads)
        short = [row for row, (text, head) in enumerate(zip(texts, heads))
                 if head is not text and not encoded.truncated[row]]
        if not short:
            return encoded
        whole = self._encode([texts[row] for row in short])
        ids, truncated = list(encoded.ids), list(encoded.truncated)
        for row, text_ids, text_truncated in zip(short, whole.ids, whole.truncated):
            ids[row], truncated[row] = text_ids, text_truncated
        return Encoded(ids=ids, truncated=truncated)

    def _encode(self, texts: list[str]) -> Encoded:
        """encode() of texts, each read whole."""
        bare = [self._bare_text(text) for text in texts]
        results = [self._text_by_words(text, normal) for text, normal in zip(texts, bare)]
        rest = [row for row, result in enumerate(results) if result is None]
        for rows, tokenizer, inputs in self._routes([bare[row] for row in rest], [texts[row] for row in rest]):
            for row, encoding in zip(rows, encode_cut(tokenizer, inputs, self.max_length, self._cuts,
                                                      self._cut_points)):
                results[rest[row]] = np.asarray(encoding.ids, dtype=np.int32), bool(encoding.overflowing)
        return Encoded(ids=[ids for ids, _ in results], truncated=[truncated for _, truncated in results])

    def _text_by_words(self, text: str, bare: str | None) -> tuple[np.ndarray, bool] | None:
        """A text's ids and whether it was cut, word by word; None where that does not apply."""
        room = self._room["single"]
        if self._templates["single"] is None or room <= 0 or (ids := self._word_ids(text, bare, room + 1)) is None:
            return None
        return np.concatenate(self._segments("single", ids[:room])), len(ids) > room

    def _pair_by_words(self, pair: tuple[str, str], bare: tuple[str | None, str | None]) -> PairResult | None:
        """A pair's result word by word, when its query is short (see encode_pairs); else None."""
        room = self._room["pair"]
        if self._templates["pair"] is None or room <= 0:
            return None
        query = self._word_ids(pair[0], bare[0], room // 2 + 1)
        if query is None or len(query) > room // 2:
            return None
        left = room - len(query)
        document = self._word_ids(pair[1], bare[1], left + 1)
        if document is None:
            return None
        ids, types = self._fill_pair_template(query, document[:left])
        return ids, types, len(document) > left

    def _word_ids(self, text: str, bare: str | None, limit: int) -> list[int] | None:
        """The first ids of a text (bare: its normal form, when known) from WordPieceWords; None where
        it does not serve (no words for this tokenizer, an added token's text in the text)."""
        if self._words is None:
            return None
        if bare is not None and bare.isascii():
            return self._words.ids(bare, limit)
        if text.isascii() or (self._added_raw is not None and self._added_raw.search(text)):
            return None  # an ASCII text without a normal form here holds an added token's text
        return self._words.raw_ids(text, limit)

    def _routes(self, bare: list, inputs: list) -> list[tuple[list[int], Tokenizer, list]]:
        """Rows of inputs (texts or pairs) whose normal form `bare` holds, with the bare tokenizer and
        that form; the others (None in `bare`), with the tokenizer and the input as it is."""
        known = [row for row, text in enumerate(bare) if text is not None]
        others = [row for row, text in enumerate(bare) if text is None]
        routes = [(known, self._bare, [bare[row] for row in known]),
                  (others, self.tokenizer, [inputs[row] for row in others])]
        return [route for route in routes if route[0]]

    def _bare_text(self, text: str) -> str | None:
        """The text as the normalizer leaves it, when that is known here and no added token is in it."""
        if self._normalize is None or not (self._no_normalizer or text.isascii()):
            return None
        if self._added_raw is not None and self._added_raw.search(text):
            return None
        normalized = self._normalize(text)
        return None if self._added_normalized is not None and self._added_normalized.search(normalized) else normalized

    def encode_pairs(self, firsts: Sequence[str], seconds: Sequence[str]) -> Encoded:
        """Each pair laid out by the tokenizer's pair template ([CLS] first [SEP] second [SEP] with
        token types 0 then 1 for BERT), truncated longest first, exactly as the tokenizer gives it.

        Longest first: when the first text (a query) has at most half of the room, it is kept whole
        and the second text (a document) keeps the rest (_short_queries). Such pairs of a BERT-style
        tokenizer are put together word by word (_pair_by_words); the others go to the library
        (_pairs_by_library).
        """
        pairs = list(zip(firsts, seconds, strict=True))
        normal_forms = {text: self._bare_text(text) for pair in pairs for text in pair}  # a query recurs per pair
        normal = [(normal_forms[a], normal_forms[b]) for a, b in pairs]
        bare = [pair if None not in pair else None for pair in normal]
        results = {i: result for i, pair in enumerate(pairs)
                   if (result := self._pair_by_words(pair, normal[i])) is not None}
        rest = [i for i in range(len(pairs)) if i not in results]
        if rest:
            by_library = self._pairs_by_library([pairs[i] for i in rest], [bare[i] for i in rest])
            results |= {rest[row]: result for row, result in by_library.items()}
        return _encoded_pairs(results, len(pairs))

    def _pairs_by_library(self, pairs: list[tuple[str, str]],
                          bare: list[tuple[str, str] | None]) -> dict[int, PairResult]:
        """The pairs (and their normal forms, None where unknown) through the tokenizer; by pair.

        A pair whose query is short needs only as
        much of its document as that rest, so only a cut of it is tokenized, as encode_cut cuts a
        text. The tokenizer gives each pair one thread, so fewer pairs than cores are put together
        here from pieces of the cuts (_pairs_in_pieces); as many as cores or more (or pairs whose
        template is not known here) go to the tokenizer as (query, cut) pairs (_pairs_with_cuts).
        The tokenizer encodes the rest whole, ASCII pairs normalized here, and those no cut could
        serve (non-ASCII texts, long queries) on a thread beside the cuts: after them, a few such
        pairs among a core's worth of cut ones took a round of the cores of their own, while the
        device waited (50 pairs reranked in 14.6 ms that way on the H200, 11.9-12.1 this way:
        bench/results/gpu-2026-11-30-run72-rerank-beside).
        """
        short = self._short_queries(bare) if self._bare is not None and self._cuts else {}
        if not short:
            return self._pairs_whole(bare, pairs, range(len(pairs)))
        uncut = [i for i in range(len(pairs)) if i not in short]
        beside = _beside().submit(self._pairs_whole, bare, pairs, uncut) if uncut else None
        if len(pairs) < CORES and self._templates["pair"] is not None:
            results = self._pairs_in_pieces(bare, short)
        else:
            results = self._pairs_with_cuts(bare, short)
        results |= self._pairs_whole(bare, pairs, [i for i in short if i not in results])  # cuts that told nothing
        if beside is not None:
            results |= beside.result()
        return results

    def _pairs_whole(self, bare: list[tuple[str, str] | None], pairs: list[tuple[str, str]],
                     rows: Sequence[int]) -> dict[int, PairResult]:
        """The pairs of `rows` as the tokenizer encodes them whole (from their normal form when known); by pair."""
        results = {}
        for routed, tokenizer, inputs in self._routes([bare[i] for i in rows], [pairs[i] for i in rows]):
            for row, encoding in zip(routed, tokenizer.encode_batch_fast(inputs)):
                results[rows[row]] = _pair_result(encoding, self._types_by_sequence)
        return results

    def _short_queries(self, bare: list[tuple[str, str] | None]) -> dict[int, ShortQuery]:
        """A ShortQuery for each pair (in normal form; None: unknown) whose query has at most half of
        the room."""
        usable = [i for i, pair in enumerate(bare) if pair is not None]
        queries = list(dict.fromkeys(bare[i][0] for i in usable))
        query_ids = dict(zip(queries, (np.asarray(e.ids, dtype=np.int32) for e in
                                       self._bare_pieces.encode_batch_fast(queries, add_special_tokens=False))))
        room = self._room["pair"]
        short = {query: ShortQuery(ids, room - len(ids)) for query, ids in query_ids.items()
                 if room > 0 and len(ids) <= room // 2}
        return {i: short[bare[i][0]] for i in usable if bare[i][0] in short}

    def _pairs_in_pieces(self, bare: list[tuple[str, str] | None],
                         short: dict[int, ShortQuery]) -> dict[int, PairResult]:
        """The pairs of `short` put together here, where their documents' cuts tell; by pair.

        Whole, five pairs of 512 tokens took 2.8 ms to tokenize on the H200 host, and 1.3 ms in
        pieces (bench/results/gpu-2026-11-30-run25-tokenizer). Each document is cut at
        CUT_CHARS_PER_TOKEN characters per token of the room its query leaves, and the cuts are split
        at suitable spaces (see _cut) into about one piece per core, tokenized at once. A cut's
        pieces hold its tokens, which are the whole document's first (see _cut); a cut with no more
        than the room (and not whole) is left to the tokenizer. The pair is the template's special
        tokens around the query and the kept tokens.
        """
        cuts = {i: _cut(bare[i][1], query.left * CUT_CHARS_PER_TOKEN, self._cut_points) for i, query in short.items()}
        document_ids = self._in_pieces(list(dict.fromkeys(cuts.values())))
        results = {}
        for i, query in short.items():
            document, whole = document_ids[cuts[i]], len(cuts[i]) == len(bare[i][1])
            # A cut with exactly `left` tokens may be all the document has (a model that drops what it
            # cannot encode): only the tokenizer can say whether the pair was truncated.
            if whole or len(document) > query.left:
                ids, types = self._fill_pair_template(query.ids, document[:query.left])
                results[i] = ids, types, len(document) > query.left
        return results

    def _pairs_with_cuts(self, bare: list[tuple[str, str] | None],
                         short: dict[int, ShortQuery]) -> dict[int, PairResult]:
        """The pairs of `short` as the tokenizer encodes each query with a cut of its document, widened
        until the pair overflows or the cut is whole (_encode_cuts, as encode_cut does); by pair. An
        overflowing pair lost tokens from the cut only, as the whole pair does from the whole document.

        The tokenizer's work grows with the whole document: 50 pairs of the rerank benchmark's
        documents (970 tokens on average, 497 kept) took 18.0 ms whole and 12.0 ms cut on two cores.
        """
        rows = list(short)
        encodings = _encode_cuts(self._bare, [bare[i][1] for i in rows],
                                 [short[i].left * CUT_CHARS_PER_TOKEN for i in rows], [bare[i][0] for i in rows],
                                 self._cut_points)
        return {i: _pair_result(encoding, self._types_by_sequence) for i, encoding in zip(rows, encodings)}

    def _in_pieces(self, texts: list[str]) -> dict[str, np.ndarray]:
        """Each text's ids without special tokens, its pieces tokenized in parallel."""
        piece_chars = max(MIN_PIECE_CHARS, sum(map(len, texts)) // CORES)
        pieces = [(text, piece) for text in texts for piece in _pieces(text, piece_chars)]
        parts: dict[str, list[list[int]]] = {text: [] for text in texts}
        encodings = self._bare_pieces.encode_batch_fast([piece for _, piece in pieces], add_special_tokens=False)
        for (text, _), encoding in zip(pieces, encodings):
            parts[text].append(encoding.ids)
        return {text: np.asarray(list(itertools.chain.from_iterable(part)), dtype=np.int32)
                for text, part in parts.items()}

    def _segments(self, kind: str, *sequences: Sequence[int]) -> list[np.ndarray]:
        """The `kind` template's ("single" or "pair") parts, the sequences' ids in place of A (and B)."""
        named = dict(zip("AB", sequences))
        return [np.asarray(named[part], dtype=np.int32) if isinstance(part, str) else part
                for part, _ in self._templates[kind]]

    def _fill_pair_template(self, first: Sequence[int], second: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The ids and token types of the pair template around two sequences' ids."""
        segments = self._segments("pair", first, second)
        types = np.array([type_id for _, type_id in self._templates["pair"]], dtype=np.int32)
        return np.concatenate(segments), np.repeat(types, [len(segment) for segment in segments])


def _text_end(tokenizer: Tokenizer) -> np.ndarray:
    """The special-token ids the tokenizer puts after a text ([SEP] for BERT, </s> for RoBERTa), for cut_ids:
    read off a short text's encoding, whatever the post-processor."""
    encoding = tokenizer.encode("a", add_special_tokens=True)
    last_first = zip(reversed(encoding.ids), reversed(encoding.special_tokens_mask))
    ends = [token for token, special in itertools.takewhile(lambda pair: pair[1] == 1, last_first)]
    return np.array(ends[::-1], dtype=np.int32)


def encode_cut(tokenizer: Tokenizer, texts: list[str], max_length: int, cut: bool = True,
               points: re.Pattern | None = None) -> list[Encoding]:
    """Each text's encoding, truncated at max_length, tokenizing only as much of a long text as that
    needs (when `cut`: the tokenizer's pre-tokenizer splits at spaces, see cuts_at_spaces; with
    `points`, also where they say, see cut_points).

    The tokenizer's work grows with the whole text while only the first max_length tokens are
    kept: in the docstrings corpus 55% of the tokens lie past 256. So a long text is first cut
    at a space before max_length * CUT_CHARS_PER_TOKEN characters. Every piece before such a
    space tokenizes as it does in the whole text, so a cut that still overflows has the whole
    text's first max_length tokens. A cut that does not (more than five characters per token:
    the docstrings corpus needs 3.6 at the median and 5.5 at most) is cut again at twice the
    length, until it overflows or is whole; the wasted work stays below twice the text's own.
    """
    if not cut:
        return tokenizer.encode_batch_fast(texts)
    return _encode_cuts(tokenizer, texts, [max_length * CUT_CHARS_PER_TOKEN] * len(texts), points=points)


def _encode_cuts(tokenizer: Tokenizer, texts: list[str], limits: list[int],
                 firsts: list[str] | None = None, points: re.Pattern | None = None) -> list[Encoding]:
    """Each text's encoding, from its cut at its limit (see _cut), cut again at twice the limit until
    the encoding overflows or the cut is whole; as the second of a pair with firsts' text, when given."""
    encodings: list[Encoding | None] = [None] * len(texts)
    pending, scale = list(range(len(texts))), 1
    while pending:
        cuts = [_cut(texts[i], limits[i] * scale, points) for i in pending]
        inputs = cuts if firsts is None else [(firsts[i], cut) for i, cut in zip(pending, cuts)]
        retry = []
        for i, cut, encoding in zip(pending, cuts, tokenizer.encode_batch_fast(inputs)):
            if encoding.overflowing or len(cut) == len(texts[i]):
                encodings[i] = encoding
            else:
                retry.append(i)
        pending, scale = retry, scale * 2
    return encodings


def more_tokens_than(tokenizer: Tokenizer, texts: Sequence[str], limit: int, cut: bool,
                     add_special_tokens: bool = True) -> bool:
    """Whether `tokenizer` (neither truncating nor padding) gives the texts more than `limit` tokens in all,
    found without tokenizing much more than the part of them that passes it: texts are tokenized about
    COUNT_CHARS characters at a time, and when `cut` (the pre-tokenizer cuts at spaces, see cuts_at_spaces)
    a long text in pieces cut at spaces (_pieces), each of which tokenizes as it does in the whole text.
    Without `cut` a text is tokenized whole, however long."""
    def tokens(group: list[str]) -> int:
        return sum(len(encoding.ids) for encoding in tokenizer.encode_batch_fast(group, add_special_tokens=False))

    specials = tokenizer.num_special_tokens_to_add(False) if add_special_tokens else 0
    pieces = itertools.chain.from_iterable(_pieces(text, COUNT_CHARS) if cut else [text] for text in texts)
    total, group, chars = specials * len(texts), [], 0
    for piece in pieces:
        group.append(piece)
        chars += len(piece)
        if chars >= COUNT_CHARS:
            total += tokens(group)
            if total > limit:
                return True
            group, chars = [], 0
    return total + tokens(group) > limit


def cuts_at_spaces(spec: dict | None) -> bool:
    """Whether a pre-tokenizer ends a piece at a single space between two visible characters and
    starts the next with it, so that text on either side of such a space tokenizes as in the whole
    (see _cut): BERT's, whitespace splitting, byte-level BPE's own regex, Metaspace's split, a Split
    on GPT-2's or Qwen's pattern, or a Sequence whose first step is one of those (later steps only
    split its pieces further). Not without a pre-tokenizer: BPE then merges across spaces."""
    if spec is None:
        return False
    kind = spec["type"]
    if kind in ("BertPreTokenizer", "Whitespace", "WhitespaceSplit"):
        return True
    if kind == "ByteLevel":
        return spec.get("use_regex", True)
    if kind == "Metaspace":
        return spec.get("split", True)
    if kind == "Split":
        return (spec["pattern"].get("Regex") in _SPACE_SPLITTING_PATTERNS and spec["behavior"] == "Isolated"
                and not spec["invert"])
    if kind == "Sequence":
        return bool(spec["pretokenizers"]) and cuts_at_spaces(spec["pretokenizers"][0])
    return False


def joins_across_spaces(spec: dict | None) -> bool:
    """Whether a normalizer may change text across a single space between two visible characters, so that text
    cut there normalizes otherwise than in the whole: a Replace whose pattern matches a span holding such a space
    (Replace(" ", "") joins words; XLM-R's Replace(" {2,}", " ") only acts on runs, which cuts never split), or one
    whose regex Python cannot read, taken as doing so. The other normalizers map characters one by one (Unicode
    forms, accents, case, BERT's cleaning, SentencePiece's Precompiled character map)."""
    if spec is None:
        return False
    if spec["type"] == "Sequence":
        return any(joins_across_spaces(step) for step in spec["normalizers"])
    if spec["type"] != "Replace":
        return False
    pattern = spec["pattern"]
    try:
        compiled = re.compile(pattern["Regex"] if "Regex" in pattern else re.escape(pattern["String"]))
    except (re.error, KeyError):
        return True
    return any(match.start() <= 1 < match.end()
               for probe in ("a b", "1 2", ". ,") for match in compiled.finditer(probe))


def _has_space(text: str) -> bool:
    return any(character.isspace() for character in text)


def cut_points(normalizer: dict | None, pre_tokenizer: dict | None, added_tokens: list[str]) -> re.Pattern | None:
    """Where else than at a space (for a pre-tokenizer that cuts_at_spaces) text before a point
    tokenizes as in the whole, as a pattern _cut finds in the text's reversed head; None: nowhere.

    Chinese text has no spaces, nor have base64 and minified JSON, so without these a long document
    was tokenized whole where 512 tokens were kept: 36,000 Chinese characters in 95 ms with MiniLM's
    tokenizer, a megabyte of base64 in 1.8 s through it and 0.9 s with a Qwen-style one (10 and 1 ms cut):
    - BERT's pre-tokenizer makes each punctuation mark a word of its own (its normalizer maps each
      character on its own), so before any of _CUT_MARKS will do; and where its normalizer has
      handle_chinese_chars each Chinese character is a word too, so between two of them;
    - Whitespace's pattern, byte-level BPE's and Qwen's (cuts_at_spaces) end a piece of letters or
      digits before a punctuation mark, so before one of _CUT_MARKS that follows one of _PIECE_ENDS,
      unless a normalizer other than NFC could make it something else (NFD puts a mark after a letter
      that joins the punctuation; '_' is a word character to Whitespace's \\w).
    Not before a character of an added token's text: such a token is matched before the pre-tokenizer
    splits, and a cut inside one would break it up.
    """
    if pre_tokenizer is None:
        return None
    taken = set("".join(added_tokens))
    if pre_tokenizer["type"] == "BertPreTokenizer":
        if normalizer is not None and normalizer["type"] not in ("BertNormalizer", "Lowercase"):
            return None
        points = [_character_class(mark for mark in _CUT_MARKS if mark not in taken)]
        if (normalizer is not None and normalizer.get("handle_chinese_chars")
                and not any(_IDEOGRAPHS.search(content) for content in added_tokens)):
            points.append(_IDEOGRAPHS.pattern * 2)
        return re.compile("|".join(points))
    if (normalizer is None or normalizer["type"] == "NFC") and _pieces_end_before_punctuation(pre_tokenizer):
        marks = _character_class(mark for mark in _CUT_MARKS if mark not in taken and mark != "_")
        return re.compile(marks + _PIECE_ENDS)
    return None


def _pieces_end_before_punctuation(spec: dict) -> bool:
    """Whether the pre-tokenizer ends a piece of letters or digits before a punctuation mark: those of
    cuts_at_spaces but whitespace splitting and Metaspace, which split at spaces only."""
    kind = spec["type"]
    if kind == "Sequence":
        return bool(spec["pretokenizers"]) and _pieces_end_before_punctuation(spec["pretokenizers"][0])
    return kind in ("Whitespace", "ByteLevel", "Split") and cuts_at_spaces(spec)


def _character_class(characters: Iterable[str]) -> str:
    return "[" + "".join(re.escape(character) for character in characters) + "]"


def ascii_normalizer(spec: dict | None) -> Callable[[str], str] | None:
    """What a tokenizer's normalizer does to ASCII text, as str methods; None where that is not known.

    BertNormalizer's clean_text drops control characters and turns tab, newline and return into
    spaces; Chinese characters and accents are not ASCII; its lowercase, like Lowercase, is
    str.lower. Unicode normal forms change no ASCII character. A Sequence applies its steps in
    order. No normalizer at all leaves every text, ASCII or not, as it is.
    """
    steps = _ascii_steps(spec)
    return None if steps is None else functools.partial(_apply, steps)


def _ascii_steps(spec: dict | None) -> list[Callable[[str], str]] | None:
    if spec is None or spec["type"] in _ASCII_UNCHANGED:
        return []
    if spec["type"] == "Lowercase":
        return [str.lower]
    if spec["type"] == "BertNormalizer":
        steps = []
        if spec["clean_text"]:
            steps.append(_clean_ascii)
        if spec["lowercase"]:
            steps.append(str.lower)
        return steps
    if spec["type"] == "Sequence":
        steps = [_ascii_steps(step) for step in spec["normalizers"]]
        return None if any(step is None for step in steps) else [f for step in steps for f in step]
    return None


def _clean_ascii(text: str) -> str:
    return text.encode("ascii").translate(_ASCII_SPACES, _ASCII_CONTROLS).decode("ascii")


def _apply(steps: list[Callable[[str], str]], text: str) -> str:
    for step in steps:
        text = step(text)
    return text


def template(spec: dict | None, kind: str) -> Template | None:
    """How the tokenizer's post-processor lays out a "single" text or a "pair": "A" (and "B") and
    special-token ids, each with its token type. None for any other post-processor, for none, and
    for a template that does not hold A (then B) once each (such texts go to the tokenizer)."""
    if spec is None:
        return None
    if spec["type"] == "BertProcessing":
        cls, sep = np.array([spec["cls"][1]], dtype=np.int32), np.array([spec["sep"][1]], dtype=np.int32)
        return [(cls, 0), ("A", 0), (sep, 0)] + ([("B", 1), (sep, 1)] if kind == "pair" else [])
    if spec["type"] != "TemplateProcessing":
        return None
    layout: Template = []
    for item in spec[kind]:
        if "Sequence" in item:
            layout.append((item["Sequence"]["id"], item["Sequence"]["type_id"]))
        else:
            ids = spec["special_tokens"][item["SpecialToken"]["id"]]["ids"]
            layout.append((np.array(ids, dtype=np.int32), item["SpecialToken"]["type_id"]))
    expected = ["A", "B"] if kind == "pair" else ["A"]
    return layout if [part for part, _ in layout if isinstance(part, str)] == expected else None


def _without_normalizer(tokenizer: Tokenizer) -> Tokenizer:
    bare = copy.deepcopy(tokenizer)
    bare.normalizer = None
    return bare


def _any_of(strings: list[str]) -> re.Pattern | None:
    """A pattern that finds any of the (non-empty) strings; None when there are none."""
    strings = sorted({string for string in strings if string})
    return re.compile("|".join(map(re.escape, strings))) if strings else None


def _pieces(text: str, chars: int) -> Iterator[str]:
    """The text in pieces of at most `chars` characters, split at suitable spaces (see _cut)."""
    while text:
        piece = _cut(text, chars)
        yield piece
        text = text[len(piece):]


def _cut(text: str, limit: int, points: re.Pattern | None = None) -> str:
    """The text up to its last suitable space before `limit` characters (or its last of `points`, see
    cut_points, if later); the whole text if there is none.

    Only a single space between two visible characters will do: the pre-tokenizers cuts_at_spaces
    accepts end a piece there and start the next with it. Not in or beside a run of whitespace:
    byte-level BPE merges a run as one piece, and Metaspace keeps newlines inside the word before them.
    """
    if len(text) <= limit:
        return text
    space = text.rfind(" ", 0, limit)
    while space > 0 and (text[space - 1].isspace() or text[space + 1].isspace()):
        space = text.rfind(" ", 0, space)
    end = max(space, _last_point(text, limit, points) if points else 0)
    return text[:end] if end > 0 else text


def _last_point(text: str, limit: int, points: re.Pattern) -> int:
    """The last of cut_points' points at or before `limit` (below the text's length); 0 if none.

    Found as the first match in the reversed head of the text (its first character is the one the
    cut ends before): one search in C, where a text with a point early and none later would otherwise
    be walked back character by character."""
    head = text[:limit + 1]
    point = points.search(head[::-1])
    return len(head) - 1 - point.start() if point else 0


def resolve_prompt(files: ModelFiles, role: str | None, text: str | None, name: str | None) -> str:
    """The text put in front of every input of `role` ("query", "document", or None for no role).

    An explicit text wins; then a prompt name from the model's sentence-transformers config; then, as
    sentence-transformers' encode_query/encode_document do (since v6), the model's prompt for that role,
    else nothing; without a role, as its plain encode() does, the model's default prompt, else nothing.
    """
    prompt = _chosen_prompt(files, role, text, name)
    if prompt and files.pooling != "last" and not files.pooling_includes_prompt:
        flag = "--query-prompt" if role == "query" else "--doc-prompt"
        pooling = "mean" if files.pooling == "mean" else "CLS token"
        raise UserError(f"{files.name} leaves its prompt {prompt!r} out of its {pooling} pooling (include_prompt false "
                        f"in its Pooling config), which embedctl does not do; embed without it ({flag} '' on the "
                        "command line, prompt='' in Python)")
    return prompt


def _chosen_prompt(files: ModelFiles, role: str | None, text: str | None, name: str | None) -> str:
    if text is not None and name is not None:
        raise UserError(f"give {f'the {role} prompt' if role else 'the prompt'} as a text or as a name, not both")
    if text is not None:
        return text
    if name is not None:
        if name not in files.prompts:
            if name in ("query", "document"):
                return ""  # as sentence-transformers 6 gives every model these two names, empty unless set
            known = ", ".join(sorted(files.prompts)) or "none"
            raise UserError(f"{files.name} has no prompt named {name!r} (it has: {known}); "
                            "pick one of those or pass the prompt as text")
        return files.prompts[name]
    for candidate in ROLE_PROMPTS.get(role, ()):
        if candidate in files.prompts:
            return files.prompts[candidate]
    if role is not None:  # encode_query and encode_document never fall back to the default prompt (since v6)
        return ""
    return files.prompts.get(files.default_prompt_name, "") if files.default_prompt_name else ""
