"""embedctl: a fast text-embedding engine and the command line that re-indexes vector databases with it.

Library use: `model = embedctl.load(); vectors = model.embed(texts)`. The command line is
embedctl.cli; the runtime is the `engine` package and the flows are `pipelines`.
"""

from embedctl.api import Embedder, load
from engine.errors import UserError

__all__ = ["Embedder", "UserError", "load"]
