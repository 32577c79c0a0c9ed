"""A GGUF's tensors read in place, each dequantized when the engine's loader takes it.

Why: the float32 folder a GGUF used to become cost 4 bytes a parameter on disk (the default brain: 2.4 GB
beside its 0.5 GB GGUF) and writing it, then reading it back, was most of a first start. Now a converted
folder holds the config, the tokenizer and this index; the loader dequantizes each tensor from the
memory-mapped GGUF as it takes it, then quantizes it per channel or casts it at once, and a later int8
start reads its kept matrices (``engine.quant_cache``) and dequantizes only the norms and biases.

The index (``gguf_tensors.json``) records where each tensor lies in the file, its storage type and shape,
and what ``Family.restore`` needs to undo llama.cpp's layout changes, so a start never parses the GGUF's
header again (gguf-py takes ~10 s on a 151k-token vocabulary). The float32 safetensors are still written
on request (``write_float32_weights``) for what reads the folder itself: transformers, vLLM, a LoRA merge.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.gguf.index import gguf_of, read_index, write_index, write_json
from engine.gguf.reader import GGUFFile, dequantize_raw

log = logging.getLogger(__name__)

SHARD_BYTES = 2 << 30  # float32 bytes a shard: bounds the memory a float32 write holds at once
# the config fields Family.restore reads
_RESTORE_CONFIG = ("num_attention_heads", "num_key_value_heads")


def index_gguf(gguf: GGUFFile, config: dict, names: dict[str, str | None], out: Path) -> None:
    """Record where each weight of ``gguf`` lies (``names``: GGUF name -> HF name, None for config tensors)."""
    tensors = {}
    for name, hf in names.items():
        if hf is None:
            continue
        t = gguf.tensors[name]
        tensors[hf] = {
            "type": int(t.tensor_type),
            "offset": int(t.data_offset),
            "bytes": int(t.n_bytes),
            "shape": list(gguf.shape(name)),
        }
    index = {
        "gguf": str(gguf.path.resolve()),
        "size": gguf.path.stat().st_size,
        "arch": gguf.arch,
        "restore": {k: config[k] for k in _RESTORE_CONFIG},
        "tensors": tensors,
    }
    write_index(out, index)


class GGUFTensors:
    """The tensors of a converted folder, by HF name, each dequantized from the GGUF only when taken (``pop``):
    the same interface as ``engine.model_weights.CheckpointTensors``."""

    def __init__(self, folder: Path) -> None:
        from engine.gguf.archs import FAMILIES

        index = read_index(folder)
        self.file = gguf_of(folder)
        self._family = FAMILIES[index["arch"]]
        self._config = index["restore"]
        self._where: dict[str, dict] = dict(index["tensors"])
        self._data = np.memmap(self.file, dtype=np.uint8, mode="r")

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(list(self._where))

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name]["shape"])

    def pop(self, name: str) -> torch.Tensor:
        t = self._where.pop(name)
        raw = self._data[t["offset"] : t["offset"] + t["bytes"]]
        values = dequantize_raw(raw, GGMLQuantizationType(t["type"]), tuple(t["shape"]))
        return torch.from_numpy(np.ascontiguousarray(self._family.restore(name, values, self._config)))

    def discard(self, name: str) -> None:
        self._where.pop(name, None)


def write_float32_weights(folder: Path) -> int:
    """Write a converted folder's tensors as float32 safetensors, shard by shard; returns the bytes written.

    Each shard is written under a temporary name and renamed, the shard index last, so a reader never
    sees part of the weights (``has_float32_weights``); two processes writing at once write equal files.
    """
    from safetensors.torch import save_file

    tensors = GGUFTensors(folder)
    names = list(tensors)
    shards = _plan_shards([(n, 4 * math.prod(tensors.shape(n))) for n in names], SHARD_BYTES)
    weight_map: dict[str, str] = {}
    done = total_bytes = 0
    step = max(1, len(names) // 10)
    for k, shard in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        shard_tensors = {}
        for name in shard:
            shard_tensors[name] = tensors.pop(name).contiguous()
            total_bytes += shard_tensors[name].nbytes
            done += 1
            if done % step == 0 or done == len(names):
                log.info("%s: dequantized %d/%d tensors to float32", tensors.file.name, done, len(names))
        fd, tmp = tempfile.mkstemp(prefix=file + ".", suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            save_file(shard_tensors, tmp, metadata={"format": "pt"})
            os.replace(tmp, folder / file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        weight_map |= dict.fromkeys(shard_tensors, file)
        del shard_tensors
    if len(shards) > 1:
        write_json(
            folder / "model.safetensors.index.json", {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        )
    return total_bytes


def _plan_shards(items: list[tuple[object, int]], limit: int) -> list[list]:
    """Consecutive groups of items whose sizes add up to at most ``limit`` (an item larger than it goes alone)."""
    shards: list[list] = [[]]
    size = 0
    for item, nbytes in items:
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards
