"""Parley's LLM serving engine. Must not import ``app``.

The public names are imported lazily so that ``import engine.weights`` (used by set-up
steps) does not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput
    from engine.sampling import SamplingParams

_EXPORTS = {
    "AsyncLLMEngine": "engine.async_engine",
    "EngineConfig": "engine.config",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling",
}

__all__ = ["AsyncLLMEngine", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
