"""Parley's own GGUF loader: any llama.cpp, Ollama or LM Studio ``.gguf`` becomes a Hugging Face folder.

``reader`` opens and checks the file (gguf-py), ``archs`` undoes what llama.cpp's converter did to
each architecture (tensor names, Q/K permutation, Gemma's w + 1 norms, the config from the
metadata), ``convert`` writes the folder. ``engine/weights.py`` caches the result by content.
"""

from engine.gguf.archs import FAMILIES
from engine.gguf.convert import convert_gguf
from engine.gguf.reader import GGUFError

__all__ = ["FAMILIES", "GGUFError", "convert_gguf"]
