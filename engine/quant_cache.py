"""Quantized weights kept between starts.

Why: an int8 engine on the CPU quantizes every layer linear and the vocabulary as it loads
(``engine.quant.quantize_per_channel``). For the default brain that is ~0.5 G weights read (then from a 2.4 GB
float32 folder, now dequantized from the GGUF: ``engine.gguf.tensors``) and quantized on every start: most of the
LLM's load, and so of a server's start. The first start
of a checkpoint keeps the int8 rows and their scales (~0.5 GB); a later start of the same checkpoint with the
same settings reads them back and never reads the float weights of those matrices. The tensors are the very
ones the quantization made, so the model is the same bit for bit (``tests/engine/test_quant_cache.py``).
Measured on the 2-core AMD EPYC VM, default settings, quiet, twice each: the LLM's load 15.4 / 14.4 s before,
4.3 / 4.5 s with the matrices kept; the server ready (``parley serve``, launch to ``/healthz``) 29.8 / 29.5 s ->
19.2 / 19.7 s (~7 s of the rest is the first prompt's prefill, ``app.skills`` ``warm_first_prompt``).

Where: ``cache_dir()/quantized/<checkpoint folder>-<key>/int8.safetensors``. The key is the checkpoint's weight
files (resolved path, size, modification time), the dtype the weights are cast to before quantizing, torch's
version and ``FORMAT_VERSION``: a changed file or setting is quantized again. Written under a temporary name and
renamed (a crash, or a start beside this one, never leaves half a file that reads as whole); a cache that cannot
be read or written (a read-only home, a full disk) only makes the next start as slow as this one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from engine.quant import Quantized

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILE_NAME = "int8.safetensors"
# a checkpoint smaller than this quantizes in well under a second: not kept (the tests' tiny models)
MIN_CHECKPOINT_BYTES = 64 << 20
# safetensors lays tensors end to end after its header, 8-byte aligned at best, and reads them in place; torch's
# AVX-512 int8pack kernel loads whole 64-byte lines as aligned and died (a segfault) on such rows, on a second
# start with the fused kernels off. A tensor read off its line is copied into torch's own (64-byte aligned) memory.
ALIGNMENT = 64


class QuantCache:
    """The (q, scale) of each quantized matrix of one checkpoint, by name: those found on disk, and those made
    by this start (written by ``save``)."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self._found: dict[str, torch.Tensor] = {}
        self._made: dict[str, torch.Tensor] = {}
        if file.is_file():
            try:
                from safetensors.torch import load_file

                self._found = load_file(str(file))
            except Exception as e:  # a damaged file is made again, not a failed start
                log.warning("quantized weights at %s unreadable (%s): quantizing again", file, e)

    @classmethod
    def for_checkpoint(
        cls, folder: Path, files: list[Path], dtype: torch.dtype, root: Path | None = None
    ) -> QuantCache | None:
        """The cache of the checkpoint ``folder`` whose weights are ``files``, quantized from ``dtype`` (None for
        a checkpoint under ``MIN_CHECKPOINT_BYTES``)."""
        if sum(file.stat().st_size for file in files) < MIN_CHECKPOINT_BYTES:
            return None
        if root is None:
            from engine.weights import cache_dir

            root = cache_dir()
        parts = [f"v{FORMAT_VERSION}", str(dtype), torch.__version__.split("+")[0]]
        for file in files:
            resolved = file.resolve()
            stat = resolved.stat()
            parts.append(f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}")
        key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
        return cls(root / "quantized" / f"{folder.resolve().name}-{key}" / FILE_NAME)

    @property
    def found(self) -> int:
        """How many matrices were read from disk."""
        return len(self._found) // 2

    def get(self, name: str, device: torch.device) -> Quantized | None:
        q, scale = self._found.get(f"{name}.q"), self._found.get(f"{name}.scale")
        if q is None or scale is None:
            return None
        return _aligned(q.to(device)), _aligned(scale.to(device))

    def put(self, name: str, quantized: Quantized) -> None:
        q, scale = quantized
        self._made[f"{name}.q"], self._made[f"{name}.scale"] = q, scale

    def save(self) -> None:
        """Write what was found and made, when this start made anything (atomically; failures only logged)."""
        if not self._made:
            return
        from safetensors.torch import save_file

        tensors = {k: v.detach().to("cpu").contiguous() for k, v in {**self._found, **self._made}.items()}
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.file.name + ".", dir=self.file.parent)
            os.close(fd)
            try:
                save_file(tensors, tmp, metadata={"format": str(FORMAT_VERSION)})
                os.replace(tmp, self.file)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            log.warning("could not keep the quantized weights at %s (%s): the next start quantizes again", self.file, e)
            return
        log.info("kept %d quantized matrices at %s", len(tensors) // 2, self.file)
        self._made.clear()


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it in memory of its own where its data does not start on a 64-byte line (CPU)."""
    if tensor.device.type != "cpu" or tensor.data_ptr() % ALIGNMENT == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
