"""A GGUF's converted folder and its index of the GGUF's tensors, read without gguf-py (or numpy, or torch).

The index (``gguf_tensors.json``) records where each tensor lies in the GGUF, its storage type and shape, and
what ``Family.restore`` needs to undo llama.cpp's layout changes; ``engine.gguf.tensors`` writes it and reads
the tensors. Apart from that module because what only asks *which kind of folder is this* (the engine's loader
choosing its reader, the policy counting parameters, the cache finding a folder) runs where gguf-py may not
be installed (a GPU image that loads Hugging Face folders only).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

INDEX_FILE = "gguf_tensors.json"
INDEX_VERSION = 1


class GGUFError(ValueError):
    """A .gguf Parley cannot load, and why."""


def has_index(folder: Path) -> bool:
    """Whether ``folder`` is a GGUF's converted folder that reads its tensors from the GGUF."""
    return (folder / INDEX_FILE).is_file()


def has_float32_weights(folder: Path) -> bool:
    """Whether a folder holds its safetensors whole (one file, or shards with their index, written last)."""
    return (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()


def read_index(folder: Path) -> dict:
    try:
        index = json.loads((folder / INDEX_FILE).read_text())
    except (OSError, ValueError) as e:
        raise GGUFError(f"{folder / INDEX_FILE}: unreadable ({e})") from e
    if index.get("version") != INDEX_VERSION:
        raise GGUFError(f"{folder / INDEX_FILE}: index version {index.get('version')}, expected {INDEX_VERSION}")
    return index


def write_index(folder: Path, index: dict) -> None:
    write_json(folder / INDEX_FILE, {"version": INDEX_VERSION, **index})


def point_index_at(folder: Path, gguf: Path) -> None:
    """Record that the folder's GGUF now lives at ``gguf`` (the same content found under another path)."""
    index = read_index(folder)
    resolved = str(gguf.resolve())
    if index["gguf"] != resolved:
        index["gguf"] = resolved
        write_json(folder / INDEX_FILE, index)


def index_parameters(folder: Path) -> int:
    """How many parameters the indexed tensors hold."""
    return sum(math.prod(t["shape"]) for t in read_index(folder)["tensors"].values())


def gguf_of(folder: Path) -> Path:
    """The GGUF file a converted folder reads its tensors from (checked to be there, with its size)."""
    index = read_index(folder)
    path = Path(index["gguf"])
    if not path.is_file() or path.stat().st_size != index["size"]:
        raise FileNotFoundError(
            f"{folder} reads its weights from {path}, which is gone or was replaced: load the .gguf file itself "
            "(it is converted again, in seconds)"
        )
    return path


def write_json(path: Path, value: dict) -> None:
    """Write atomically: a reader sees the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)
