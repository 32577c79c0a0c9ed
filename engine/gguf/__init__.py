"""Parley's own GGUF loader: any llama.cpp, Ollama or LM Studio ``.gguf`` becomes a Hugging Face folder that
reads its tensors from the GGUF.

``reader`` opens and checks the file (gguf-py), ``archs`` undoes what llama.cpp's converter did to
each architecture (tensor names, Q/K permutation, Gemma's w + 1 norms, the config from the
metadata), ``convert`` writes the folder, ``tensors`` reads the weights in place (``dequant``: the legacy
block types with torch), ``index`` knows the folder without gguf-py. ``engine/weights.py`` caches the
result by content. The package's names load on first use: ``engine.gguf.index`` needs no gguf-py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.gguf.archs import FAMILIES
    from engine.gguf.convert import convert_gguf
    from engine.gguf.index import GGUFError

__all__ = ["FAMILIES", "GGUFError", "convert_gguf"]


def __getattr__(name: str):
    if name == "FAMILIES":
        from engine.gguf.archs import FAMILIES

        return FAMILIES
    if name == "convert_gguf":
        from engine.gguf.convert import convert_gguf

        return convert_gguf
    if name == "GGUFError":
        from engine.gguf.index import GGUFError

        return GGUFError
    raise AttributeError(f"module 'engine.gguf' has no attribute {name!r}")
