"""Open a GGUF with gguf-py and check it whole before any work starts.

A damaged file fails inside gguf-py with errors such as "cannot reshape array"; here it fails
with what is wrong: not a GGUF (bad magic), an unreadable header, a tensor whose data runs past
the end of the file, a split file, or a storage type gguf-py cannot dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize

from engine.gguf import dequant
from engine.gguf.index import GGUFError

GGUF_MAGIC = b"GGUF"
_MISSING = object()


class _CheckedReader(GGUFReader):
    """gguf-py's reader, stopping at the first tensor whose data runs past the end of the file, and reading the
    header through a plain array: each of the header's ~760k slices of the ``np.memmap`` itself pays numpy's
    subclass hooks, which made opening a 151k-token vocabulary take ~10 s (~3 s this way)."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        count = int(count)
        arr = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            end = start_offs + int(offset[0]) + int(np.prod(dims, dtype=np.int64)) * type_size // block
            if end > size:
                raise GGUFError(
                    f"truncated: tensor {bytes(name).decode(errors='replace')!r} ends at byte {end}, "
                    f"past the end of the file ({size} bytes)"
                )
        super()._build_tensors(start_offs, fields)


@dataclass
class GGUFFile:
    """A checked GGUF: its metadata (read on demand) and its tensors by name, memory-mapped."""

    path: Path
    reader: GGUFReader
    tensors: dict[str, ReaderTensor]

    @property
    def arch(self) -> str:
        return self.get("general.architecture")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value; a float32 as its shortest decimal (1e-05, not 9.99999974e-06), as the HF config had it."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
            return default
        value = field.contents()
        if field.types and field.types[-1] == GGUFValueType.FLOAT32:
            value = (
                [float(str(np.float32(v))) for v in value] if isinstance(value, list) else float(str(np.float32(value)))
            )
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in torch order (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def dequantized(self, name: str) -> np.ndarray:
        """A tensor as float32 in torch order, whatever its storage type."""
        t = self.tensors[name]
        raw = self.reader.data[t.data_offset : t.data_offset + t.n_bytes]
        return dequantize_raw(raw, t.tensor_type, self.shape(name))


def dequantize_raw(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes (uint8, as stored) as a writable float32 array in torch order ``shape``."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dequant.handles(qtype):  # the legacy block types, on every core
        return dequant.dequantize_blocks(raw, qtype).numpy().reshape(shape)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = dequantize(raw, qtype)
    else:  # gguf-py dequantizes whole rows of blocks
        values = dequantize(raw.reshape(-1, shape[-1] // block * type_size), qtype)
    out = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    # an F32 tensor is a view of the read-only file
    return out if out.flags.writeable and not np.shares_memory(out, raw) else out.copy()


def open_gguf(path: Path) -> GGUFFile:
    """Read and check a GGUF's header and tensor table (the tensor data stays on disk until dequantized)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r}")
    try:
        reader = _CheckedReader(path)
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None
    except Exception as e:  # anything the parser trips on means the header is damaged
        raise GGUFError(f"{path}: damaged GGUF header or tensor table ({type(e).__name__}: {e})") from e
    gguf = GGUFFile(path, reader, {t.name: t for t in reader.tensors})
    parts = gguf.get("split.count", 1)
    if parts > 1:
        raise GGUFError(
            f"{path.name} is part of a split GGUF ({parts} files): join it first (llama-gguf-split --merge)"
        )
    _check_storage_types(gguf)
    return gguf


def _check_storage_types(gguf: GGUFFile) -> None:
    """Fail before converting anything if a tensor's storage type has no dequantizer in gguf-py."""
    for qtype in sorted({t.tensor_type for t in gguf.tensors.values()}):
        block, type_size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            first = next(n for n, t in gguf.tensors.items() if t.tensor_type == qtype)
            raise GGUFError(
                f"{gguf.path.name}: tensor {first!r} is stored as {qtype.name}, which gguf-py cannot dequantize"
            ) from None
