"""The Python API: a model that turns a list of texts into a numpy array.

    import embedctl
    model = embedctl.load()                      # all-MiniLM-L6-v2, shipped offline
    vectors = model.embed(["first text", "second text"])   # float32 [2, 384]
    queries = model.embed_query(["what is a vector database"])  # the model's query prompt first, if it has one

It is the engine plus the model's tokenizer; `embedctl index` runs the same pieces as a pipeline.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping, Sequence, Set as AbstractSet
from typing import TYPE_CHECKING

import numpy as np

from engine import EngineConfig
from engine.errors import UserError
from pipelines.tokenize import TextTokenizer, resolve_prompt

if TYPE_CHECKING:  # importing embedctl (as its command line does) must not import torch
    from engine import Engine

# The engine's options as its messages name them on the command line, and a value given after one: --device is
# always followed by its value, whatever it is (cuda:0,cuda:1, gpu); the others by one quoted, a number, or one of
# the names that dtype and attention take, else by the message's next words.
_CLI_OPTION = re.compile(r"--(?:(device) ('[^']*'|\S+?)(?=[:;,]?(?:\s|$))"
                         r"|(attention|dim|dtype|lanes|max-batch-tokens|max-length|max-seqs|normalize|model)\b"
                         r"(?: ('[^']*'|\d+\b|(?:auto|sdpa|varlen|flashinfer|triton|bf16|fp16|fp32|b?float(?:16|32))\b))?)")


_LONE_SURROGATE = ("holds a lone surrogate (a \\ud800-\\udfff code point, as an unpaired JSON escape decodes to), "
                   "which is not valid Unicode and no tokenizer takes; remove it, e.g. "
                   "text.encode('utf-8', 'replace').decode()")


class Embedder:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)

    @property
    def dim(self) -> int:
        return self.engine.dim

    def embed(self, texts: str | Sequence[str], *, prompt: str | None = None,
              prompt_name: str | None = None) -> np.ndarray:
        """float32 [len(texts), dim] (int8 for a model whose vectors are int8), in order, or for one text (a str) its
        vector [dim], as sentence-transformers' encode() gives them; texts longer than the max length are
        truncated. Threads may call it at once (their calls run one after another).

        As encode(): `prompt`, or the model's prompt named `prompt_name`, or its default prompt (default_prompt_name)
        goes before every text. Both are keyword-only: encode()'s second positional argument is prompt_name, so
        embed(texts, "query") would otherwise put the word "query" before every text. embed_query and
        embed_document put the prompt first that `embedctl score` puts before queries and `embedctl index` before
        documents."""
        return self._embed(texts, self._prompt(None, prompt, prompt_name))

    def embed_query(self, texts: str | Sequence[str], *, prompt: str | None = None,
                    prompt_name: str | None = None) -> np.ndarray:
        """embed() with the prompt `embedctl score` puts before queries: the model's query prompt, else none (as
        sentence-transformers' encode_query, which since v6 never falls back to the default prompt); `prompt` or
        `prompt_name` instead, as --query-prompt and --query-prompt-name give it there."""
        return self._embed(texts, self._prompt("query", prompt, prompt_name))

    def embed_document(self, texts: str | Sequence[str], *, prompt: str | None = None,
                       prompt_name: str | None = None) -> np.ndarray:
        """embed() with the prompt `embedctl index` puts before documents: the model's document prompt, else its
        passage or corpus prompt, else none; `prompt` or `prompt_name` instead, as --doc-prompt and
        --doc-prompt-name give it there. (sentence-transformers 6's encode_document looks for the same names, but
        finds the empty document prompt it gives every model first, so it never uses a passage or corpus prompt.)"""
        return self._embed(texts, self._prompt("document", prompt, prompt_name))

    def _prompt(self, role: str | None, prompt: object, prompt_name: object) -> str:
        for name, value in (("prompt", prompt), ("prompt_name", prompt_name)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} is {type(value).__name__}, not a string")
        if prompt is not None and not _encodable(prompt):
            raise UserError(f"the prompt {_LONE_SURROGATE}")
        return resolve_prompt(self.engine.files, role, prompt, prompt_name)

    def _embed(self, texts: str | Sequence[str], prompt: str) -> np.ndarray:
        if self.engine.num_labels:  # its engine and tokenizer still serve pipelines.score's rerank()
            raise UserError(f"{self.engine.files.name} is a cross-encoder: it scores query-document pairs and has no "
                            "vectors to embed; load an embedding model, and rerank with this one through `embedctl "
                            "score --reranker` or serve's /rerank")
        if isinstance(texts, str):
            return self._embed([texts], prompt)[0]
        if isinstance(texts, (bytes, bytearray)):
            raise TypeError("embed() takes a list of texts, not bytes; decode them and wrap the text in a list")
        if isinstance(texts, (AbstractSet, Mapping)):  # no order to match the rows to; a dict would give its keys'
            fix = "list(d.values()) for its texts" if isinstance(texts, Mapping) else "sorted(s) for an order you know"
            raise TypeError(f"embed() takes a list of texts, not a {type(texts).__name__}, whose order the rows could "
                            f"not be matched to; pass a list, e.g. {fix}")
        try:
            texts = list(texts)
        except TypeError:
            raise TypeError(f"embed() takes a list of texts, not {type(texts).__name__}") from None
        if (bad := next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)) is not None:
            raise TypeError(f"texts[{bad}] is {type(texts[bad]).__name__}, not a string; embed() takes a list of texts")
        if (bad := next((i for i, text in enumerate(texts) if not _encodable(text)), None)) is not None:
            raise UserError(f"texts[{bad}] {_LONE_SURROGATE}")
        return self.engine.embed(self.tokenizer.encode([prompt + text for text in texts] if prompt else texts).ids)


def load(model: str | os.PathLike[str] | None = None, **options: object) -> Embedder:
    """Load `model` (a local directory, a hub id, or None for all-MiniLM-L6-v2).

    options are EngineConfig fields, e.g. device="cuda", dtype="bf16", dim=256, normalize=False.
    Bad ones raise embedctl.UserError, whose message names the problem and the fix.
    """
    from engine import Engine

    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"load() takes a model directory or hub id as a string or path, not {type(model).__name__}")
    known = [field.name for field in dataclasses.fields(EngineConfig)]
    for name in options.keys() - set(known):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(known)}"
        raise UserError(f"load() has no option {name!r}; {hint}")
    try:
        return Embedder(Engine.load(None if model is None else os.fspath(model), EngineConfig(**options)))
    except UserError as error:  # its fix in load()'s terms: dim=1000, not --dim 1000
        raise UserError(_CLI_OPTION.sub(_as_argument, str(error))) from None


def _as_argument(match: re.Match) -> str:
    """--device cpu as device='cpu', --dim 256 as dim=256, a bare --normalize as normalize=True."""
    name, value = (match.group(1) or match.group(3)).replace("-", "_"), match.group(2) or match.group(4)
    if value is None:
        return {"normalize": "normalize=True", "model": "load()'s model argument"}.get(name, name)
    if value.startswith("'") or re.fullmatch(r"\d+", value):
        return f"{name}={value}"
    return f"{name}={value!r}"


def _encodable(text: str) -> bool:
    """Whether text is valid Unicode (no lone surrogate), as a tokenizer takes it; ASCII at once."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
