"""Texts to token ids with the model's tokenizer.json, through the `tokenizers` library.

Texts are stripped (as sentence-transformers does), truncated at the model's max length (special
tokens included) and never padded: the engine packs sequences back to back. Each result says how
many tokens were kept and whether the text was cut. Batch encoding runs in Rust threads and
releases the GIL, so a pipeline thread can tokenize while the engine computes; its fast variant
skips the character offsets nobody here reads. Long texts are tokenized only as far as the kept
tokens need, in pieces that run in parallel (TextTokenizer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from engine.checkpoint import ModelFiles
from engine.errors import UserError

# The prompt names sentence-transformers' encode_query / encode_document look for, in order.
ROLE_PROMPTS = {"query": ("query",), "document": ("document", "passage", "corpus")}
# A long text is first cut at a space before this many characters per kept token, then, if that
# was too few, at twice as many, and so on (see TextTokenizer.encode).
CUT_CHARS_PER_TOKEN = 5
# Texts are tokenized in pieces of at most this many characters, all pieces of a call in parallel.
PIECE_CHARS = 512
PAIR_PROCESSORS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


@dataclass(frozen=True)
class Encoded:
    ids: list[np.ndarray]  # int32 token ids per text
    truncated: list[bool]
    type_ids: list[np.ndarray] | None = None  # int32 token types per pair; None for single texts


class TextTokenizer:
    """A model's tokenizer: texts (or pairs) to ids with its special tokens, truncated at max_length.

    Long texts are tokenized only as far as the kept tokens need (see _widening). encode() runs
    many texts at once, one per Rust thread. encode_pairs() serves a cross-encoder's few long
    pairs, where one thread per pair would leave the GPU waiting on the longest: it tokenizes each
    text alone, split at spaces into pieces that all run in parallel, and the tokenizer's own
    post-processing truncates the pair and adds its special tokens.
    """

    def __init__(self, tokenizer_file: Path, max_length: int) -> None:
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            raise UserError(f"{tokenizer_file} is not a usable tokenizer.json ({error}); "
                            "replace it with the model's own tokenizer.json") from None
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length)
        self.max_length = max_length
        self._untruncated = Tokenizer.from_str(self.tokenizer.to_str())
        self._untruncated.no_truncation()
        self._piece_chars = PIECE_CHARS if _splits_at_spaces(self.tokenizer) else None
        # Encoding a pair gives the second text token type 1 before post-processing; these set the
        # types themselves, so a pair can be put together from texts tokenized alone.
        self._pairs_from_texts = type(self.tokenizer.post_processor).__name__ in PAIR_PROCESSORS

    def encode(self, texts: Sequence[str]) -> Encoded:
        """Token ids of each text, truncated at max_length, exactly as the tokenizer gives them."""
        encodings = [encoding for encoding, _ in self._widening(
            [text.strip() for text in texts], self.tokenizer.encode_batch_fast, lambda encoding: bool(encoding.overflowing))]
        return Encoded(ids=[np.asarray(e.ids, dtype=np.int32) for e in encodings],
                       truncated=[bool(e.overflowing) for e in encodings])

    def encode_pairs(self, firsts: Sequence[str], seconds: Sequence[str]) -> Encoded:
        """[CLS] first [SEP] second [SEP] with token types 0 then 1, as a cross-encoder reads a pair.

        Over-long pairs lose tokens from the longer side first, as transformers' tokenizers do. Which
        side is longer needs both whole lengths, so a pair whose cut side is not the longer one
        already (both sides long: rare, as queries are short) is tokenized whole; so is every pair
        of a tokenizer without a pair template.
        """
        if len(firsts) != len(seconds):
            raise ValueError(f"{len(firsts)} first texts for {len(seconds)} second texts")
        pairs = [(a.strip(), b.strip()) for a, b in zip(firsts, seconds)]
        unique = list(dict.fromkeys(text for pair in pairs for text in pair))  # a query repeats per pair
        # A cut text is enough once it has more than max_length tokens: truncation keeps fewer.
        encoded = dict(zip(unique, self._widening(unique, self._in_pieces, lambda encoding: len(encoding) > self.max_length)))
        encodings: list[Encoding | None] = []
        for a, b in pairs:
            (first, first_whole), (second, second_whole) = encoded[a], encoded[b]
            known_longer = (first_whole or len(first) > len(second)) and (second_whole or len(second) > len(first))
            encodings.append(self.tokenizer.post_process(first, second) if self._pairs_from_texts and known_longer else None)
        whole = [i for i, encoding in enumerate(encodings) if encoding is None]
        for i, encoding in zip(whole, self.tokenizer.encode_batch_fast([pairs[i] for i in whole])):
            encodings[i] = encoding
        return Encoded(ids=[np.asarray(e.ids, dtype=np.int32) for e in encodings],
                       truncated=[bool(e.overflowing) for e in encodings],
                       type_ids=[np.asarray(e.type_ids, dtype=np.int32) for e in encodings])

    def _widening(self, texts: Sequence[str], encode: Callable[[list[str]], list[Encoding]],
                  enough: Callable[[Encoding], bool]) -> list[tuple[Encoding, bool]]:
        """encode() of each text or of a cut of it that is `enough`, and whether it was the whole text.

        The tokenizer's work grows with the whole text while only the first max_length tokens are
        kept: in the docstrings corpus 55% of the tokens lie past 256. So a long text is first cut
        at a space before max_length * CUT_CHARS_PER_TOKEN characters. Every piece before such a
        space tokenizes as it does in the whole text, so a cut that overflows max_length has the
        whole text's first tokens. A cut that does not (more than five characters per token: the
        docstrings corpus needs 3.6 at the median and 5.5 at most) is cut again at twice the
        length, until it is enough or whole; the wasted work stays below the text's own.
        """
        result: list[tuple[Encoding, bool] | None] = [None] * len(texts)
        pending, limit = list(range(len(texts))), self.max_length * CUT_CHARS_PER_TOKEN
        while pending:
            cuts = [texts[i][: _cut_point(texts[i], 0, limit)] for i in pending]
            retry = []
            for i, cut, encoding in zip(pending, cuts, encode(cuts)):
                whole = len(cut) == len(texts[i])
                if whole or enough(encoding):
                    result[i] = encoding, whole
                else:
                    retry.append(i)
            pending, limit = retry, limit * 2
        return result

    def _in_pieces(self, texts: list[str]) -> list[Encoding]:
        """Each text's tokens without special tokens or truncation, its pieces tokenized in parallel."""
        pieces, owners = [], []
        for owner, text in enumerate(texts):
            for piece in _pieces(text, self._piece_chars):
                pieces.append(piece)
                owners.append(owner)
        parts: list[list[Encoding]] = [[] for _ in texts]
        for owner, encoding in zip(owners, self._untruncated.encode_batch_fast(pieces, add_special_tokens=False)):
            parts[owner].append(encoding)
        return [part[0] if len(part) == 1 else Encoding.merge(part, growing_offsets=True) for part in parts]


def _cut_point(text: str, start: int, limit: int) -> int:
    """Where text[start:] is cut to at most `limit` characters: its last suitable space, else its end.

    Only a single space between two visible characters will do: every pre-tokenizer (BERT's,
    byte-level BPE's, Metaspace) ends a piece there and starts the next with it. Not in or beside a
    run of whitespace: byte-level BPE merges a run as one piece, and Metaspace keeps newlines inside
    the word before them.
    """
    if len(text) - start <= limit:
        return len(text)
    space = text.rfind(" ", start, start + limit)
    while space > start and (text[space - 1].isspace() or text[space + 1].isspace()):
        space = text.rfind(" ", start, space)
    return space if space > start else len(text)


def _pieces(text: str, piece_chars: int | None) -> list[str]:
    """The text split at suitable spaces into pieces of at most piece_chars (None: not split)."""
    if piece_chars is None:
        return [text]
    pieces, start = [], 0
    while True:
        end = _cut_point(text, start, piece_chars)
        pieces.append(text[start:end])
        if end == len(text):
            return pieces
        start = end


def _splits_at_spaces(tokenizer: Tokenizer) -> bool:
    """Whether text after a space tokenizes alone as it does in place: not when a normalizer puts
    something in front of every input (Prepend, as in Llama-style tokenizers)."""
    return tokenizer.normalizer is None or b'"Prepend"' not in tokenizer.normalizer.__getstate__()


def resolve_prompt(files: ModelFiles, role: str, text: str | None, name: str | None) -> str:
    """The text put in front of every input of `role` ("query" or "document").

    An explicit text wins; then a prompt name from the model's sentence-transformers config; then, as
    sentence-transformers' encode_query/encode_document do, the model's prompt for that role, or its
    default prompt; else nothing.
    """
    if text is not None and name is not None:
        raise UserError(f"give the {role} prompt as a text or as a name, not both")
    if text is not None:
        return text
    if name is not None:
        if name not in files.prompts:
            known = ", ".join(sorted(files.prompts)) or "none"
            raise UserError(f"{files.name} has no prompt named {name!r} (it has: {known}); "
                            f"pick one of those or pass the {role} prompt as text")
        return files.prompts[name]
    for candidate in ROLE_PROMPTS[role]:
        if candidate in files.prompts:
            return files.prompts[candidate]
    return files.prompts.get(files.default_prompt_name, "") if files.default_prompt_name else ""
