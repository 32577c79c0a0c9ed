"""What a model is, read from its own files in milliseconds: architecture, size, and whether its template has tools.

Why: the conversation policy (``app/policy.py``) follows the model, not its file name: a renamed file, an Ollama
blob (``sha256-…``) or a converted folder is the same model. Loading a GGUF to learn this takes seconds (gguf-py
maps every tensor), so the GGUF header is read here directly: its key/value metadata (the big vocabulary arrays
are skipped, not decoded) and its tensor shapes (the parameter count). A Hugging Face folder gives the same from
``config.json``, ``tokenizer_config.json`` and the safetensors headers.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engine.gguf.index import has_index, index_parameters
from engine.weights import AUTO_MODEL, BUNDLED_MODEL, known_model_file

GGUF_MAGIC = b"GGUF"
# GGUF value types (gguf/constants.py GGUFValueType): fixed sizes, 8 = string, 9 = array
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_WANTED = {"general.architecture", "general.name", "general.size_label", "tokenizer.chat_template"}
_MAX_COUNT = 1 << 32  # a count past this is a damaged header, not a model


@dataclass(frozen=True)
class ModelTraits:
    """``architecture``: GGUF's name (``llama``, ``qwen2``; a folder's ``model_type``). ``parameters``: counted from
    the tensor shapes. ``tool_template``: the chat template renders tools (a model trained to call them)."""

    architecture: str
    parameters: int
    tool_template: bool
    name: str = ""

    def describe(self) -> str:
        tools = "a chat template with tools" if self.tool_template else "no tools in its chat template"
        size = f"{self.parameters / 1e9:.2f}B" if self.parameters >= 1e9 else f"{self.parameters / 1e6:.0f}M"
        return f"{self.name or self.architecture} ({self.architecture}, {size} parameters, {tools})"


def traits_of(model: str) -> ModelTraits | None:
    """The traits of ``model`` as ``llm_model`` names it (a name, a folder or a file); None when it is not on this
    machine or its files cannot be read (the caller then treats it as unknown)."""
    path = known_model_file(model) if model == BUNDLED_MODEL or "/" not in model else None
    path = path or Path(model).expanduser()
    try:
        stat = path.stat()
    except OSError:
        return None
    try:
        return _cached_traits(str(path), stat.st_size, stat.st_mtime_ns)
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return None


def served_traits(model: str) -> ModelTraits | None:
    """The traits of the model a remote server serves, as ``llm_model`` names it: None at ``auto`` (the server may
    serve anything), else read from this machine's copy (``traits_of``)."""
    return None if model == AUTO_MODEL else traits_of(model)


@functools.lru_cache(maxsize=16)
def _cached_traits(path: str, size: int, mtime_ns: int) -> ModelTraits:
    folder = Path(path)
    if folder.is_dir():
        return _folder_traits(folder)
    with open(folder, "rb") as f:
        return gguf_traits(f)


def gguf_traits(f: BinaryIO) -> ModelTraits:
    """Traits from a GGUF's header (ValueError if it is not one)."""
    if f.read(4) != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    (version,) = struct.unpack("<I", f.read(4))
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    tensors, kvs = struct.unpack("<QQ", f.read(16))
    if tensors > _MAX_COUNT or kvs > _MAX_COUNT:
        raise ValueError("damaged GGUF header")
    found: dict[str, object] = {}
    for _ in range(kvs):
        key = _string(f)
        (kind,) = struct.unpack("<I", f.read(4))
        if key in _WANTED and kind == _STRING:
            found[key] = _string(f)
        else:
            _skip_value(f, kind)
    parameters = 0
    for _ in range(tensors):
        _skip_string(f)
        (dims,) = struct.unpack("<I", f.read(4))
        count = 1
        for size in struct.unpack(f"<{dims}Q", f.read(8 * dims)):
            count *= size
        parameters += count
        f.read(12)  # the storage type (u32) and the data offset (u64)
    template = str(found.get("tokenizer.chat_template", ""))
    return ModelTraits(
        architecture=str(found.get("general.architecture", "")),
        parameters=parameters,
        tool_template="tools" in template,
        name=str(found.get("general.name", "")),
    )


def _folder_traits(folder: Path) -> ModelTraits:
    config = json.loads((folder / "config.json").read_text())
    template = ""
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file():
        template = str(json.loads(tokenizer_config.read_text()).get("chat_template") or "")
    if (folder / "chat_template.jinja").is_file():
        template += (folder / "chat_template.jinja").read_text()
    parameters = sum(_safetensors_parameters(p) for p in folder.glob("*.safetensors"))
    if not parameters and has_index(folder):  # a GGUF's folder reading the GGUF itself
        parameters = index_parameters(folder)
    name = str(config.get("_name_or_path") or folder.name)
    return ModelTraits(str(config.get("model_type", "")), parameters, "tools" in template, name)


def _safetensors_parameters(path: Path) -> int:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(min(length, 100 << 20)))
    total = 0
    for name, tensor in header.items():
        if name != "__metadata__":
            count = 1
            for size in tensor.get("shape", ()):
                count *= int(size)
            total += count
    return total


def _string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    if length > 1 << 26:
        raise ValueError("damaged GGUF string")
    return f.read(length).decode("utf-8")


def _skip_string(f: BinaryIO) -> None:
    (length,) = struct.unpack("<Q", f.read(8))
    f.seek(length, 1)


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind in _FIXED:
        f.seek(struct.calcsize(_FIXED[kind]), 1)
    elif kind == _STRING:
        _skip_string(f)
    elif kind == _ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if count > _MAX_COUNT:
            raise ValueError("damaged GGUF array")
        if item in _FIXED:
            f.seek(struct.calcsize(_FIXED[item]) * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")
