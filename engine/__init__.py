"""The embedding runtime: token ids in, vectors out, on the CPU or an NVIDIA GPU.

It knows token ids, offsets and vectors. It never imports pyarrow, fsspec, a tokenizer or an HTTP
layer; pipelines/ and embedctl/ do that and drive it through Engine.step().
"""

from engine.batch import Packer, PackedBatch
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import UserError
from engine.lazy import LazyTensor

__all__ = ["Engine", "EngineConfig", "LazyTensor", "Packer", "PackedBatch", "UserError"]
