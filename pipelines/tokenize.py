"""Texts to token ids with the model's tokenizer.json, through the `tokenizers` library.

Texts are stripped (as sentence-transformers does), truncated at the model's max length (special
tokens included) and never padded: the engine packs sequences back to back. Each result says how
many tokens were kept and whether the text was cut. Batch encoding runs in Rust threads and
releases the GIL, so a pipeline thread can tokenize while the engine computes; its fast variant
skips the character offsets nobody here reads. Long texts are tokenized only as far as the kept
tokens need (TextTokenizer.encode).
"""

from __future__ import annotations

from collections.abc import Sequence
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


@dataclass(frozen=True)
class Encoded:
    ids: list[np.ndarray]  # int32 token ids per text
    truncated: list[bool]
    type_ids: list[np.ndarray] | None = None  # int32 token types per pair; None for single texts


class TextTokenizer:
    """A model's tokenizer: texts (or pairs) to ids with its special tokens, truncated at max_length."""

    def __init__(self, tokenizer_file: Path, max_length: int) -> None:
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            raise UserError(f"{tokenizer_file} is not a usable tokenizer.json ({error}); "
                            "replace it with the model's own tokenizer.json") from None
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length)
        self.max_length = max_length

    def encode(self, texts: Sequence[str]) -> Encoded:
        """Token ids of each text, truncated at max_length, exactly as the tokenizer gives them.

        The tokenizer's work grows with the whole text while only the first max_length tokens are
        kept: in the docstrings corpus 55% of the tokens lie past 256. So a long text is first cut
        at a space before max_length * CUT_CHARS_PER_TOKEN characters. Every piece before such a
        space tokenizes as it does in the whole text, so a cut that still overflows has the whole
        text's first max_length tokens. A cut that does not (more than five characters per token:
        the docstrings corpus needs 3.6 at the median and 5.5 at most) is cut again at twice the
        length, until it overflows or is whole; the wasted work stays below twice the text's own.
        """
        texts = [text.strip() for text in texts]
        encodings: list[Encoding | None] = [None] * len(texts)
        pending, limit = list(range(len(texts))), self.max_length * CUT_CHARS_PER_TOKEN
        while pending:
            cuts = [_cut(texts[i], limit) for i in pending]
            retry = []
            for i, cut, encoding in zip(pending, cuts, self.tokenizer.encode_batch_fast(cuts)):
                if encoding.overflowing or len(cut) == len(texts[i]):
                    encodings[i] = encoding
                else:
                    retry.append(i)
            pending, limit = retry, limit * 2
        return Encoded(ids=[np.asarray(e.ids, dtype=np.int32) for e in encodings],
                       truncated=[bool(e.overflowing) for e in encodings])

    def encode_pairs(self, firsts: Sequence[str], seconds: Sequence[str]) -> Encoded:
        """[CLS] first [SEP] second [SEP] with token types 0 then 1, as a cross-encoder reads a pair.

        Over-long pairs lose tokens from the longer side first, as transformers' tokenizers do: when
        the first text (a query) has at most half of the room, it is kept whole and the second text
        (a document) gets the rest. So a long document is cut as encode() cuts a text, at a space
        before CUT_CHARS_PER_TOKEN characters per token of that rest; when the pair still overflows,
        the document kept exactly the tokens it keeps whole. Other pairs (a long query, or a cut that
        fell short) are encoded whole. This spares the tokenizing of whatever a long document has
        past its kept tokens; the cross-encoder suite's documents (about 700 tokens) lose 12% of their
        characters, too little to show on the H200 (run17).
        """
        pairs = [(a.strip(), b.strip()) for a, b in zip(firsts, seconds, strict=True)]
        room = self.max_length - self.tokenizer.num_special_tokens_to_add(True)
        unique = list(dict.fromkeys(first for first, _ in pairs))
        # At most max_length tokens of each: enough to tell whether it has half the room or less.
        first_tokens = dict(zip(unique, (len(e) for e in self.tokenizer.encode_batch_fast(unique, add_special_tokens=False))))
        cuts = [_cut(b, (room - first_tokens[a]) * CUT_CHARS_PER_TOKEN) if first_tokens[a] <= room // 2 else b
                for a, b in pairs]
        encodings = self.tokenizer.encode_batch_fast([(a, cut) for (a, _), cut in zip(pairs, cuts)])
        whole = [i for i, (encoding, cut) in enumerate(zip(encodings, cuts))
                 if len(cut) < len(pairs[i][1]) and not encoding.overflowing]
        for i, encoding in zip(whole, self.tokenizer.encode_batch_fast([pairs[i] for i in whole])):
            encodings[i] = encoding
        return Encoded(ids=[np.asarray(e.ids, dtype=np.int32) for e in encodings],
                       truncated=[bool(e.overflowing) for e in encodings],
                       type_ids=[np.asarray(e.type_ids, dtype=np.int32) for e in encodings])


def _cut(text: str, limit: int) -> str:
    """The text up to its last suitable space before `limit` characters; the whole text if there is none.

    Only a single space between two visible characters will do: every pre-tokenizer (BERT's,
    byte-level BPE's, Metaspace) ends a piece there and starts the next with it. Not in or beside a
    run of whitespace: byte-level BPE merges a run as one piece, and Metaspace keeps newlines inside
    the word before them.
    """
    if len(text) <= limit:
        return text
    space = text.rfind(" ", 0, limit)
    while space > 0 and (text[space - 1].isspace() or text[space + 1].isspace()):
        space = text.rfind(" ", 0, space)
    return text[:space] if space > 0 else text


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
