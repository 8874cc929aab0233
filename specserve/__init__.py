"""specserve: an LLM inference server built around speculative decoding."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "ServerArgs", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        from specserve.engine import Engine
        return Engine
    if name == "ServerArgs":
        from specserve.config import ServerArgs
        return ServerArgs
    if name == "SamplingParams":
        from specserve.core import SamplingParams
        return SamplingParams
    raise AttributeError(name)
