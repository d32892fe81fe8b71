"""embedctl: a fast text-embedding engine and the command line that re-indexes vector databases with it.

Library use: `model = embedctl.load(); vectors = model.embed(texts)`. The command line is
embedctl.cli; the runtime is the `engine` package and the flows are `pipelines`.
The library's names load on first use, so that the console script (embedctl.__main__) starts at once
and catches a Ctrl-C that comes while the command line's own libraries load.
"""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from embedctl.api import Embedder, load
    from engine.errors import UserError

_LAZY = {"Embedder": "embedctl.api", "load": "embedctl.api", "UserError": "engine.errors"}
__all__ = ["Embedder", "UserError", "load"]


def __dir__() -> list[str]:  # the lazy names too, for completion in a REPL or an editor
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'embedctl' has no attribute {name!r}")
