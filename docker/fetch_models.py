"""Fetch hub-named models into the data volume on first start (with progress), then run the command.

Parley itself never touches a model hub: every model setting is ``bundled`` or a local path.
In the container, a setting may name a hub model instead (``PARLEY_ASR_MODEL=large-v3``,
``PARLEY_LLM_MODEL=Qwen/Qwen2.5-7B-Instruct``, ``PARLEY_TTS_VOICE=coqui/XTTS-v2``): this
script downloads it once into ``$HF_HOME`` (the ``/data`` volume), showing progress, replaces
the setting with the local folder, and ``exec``s the server. Later starts find the files in the
cache and only print where they are.

    python fetch_models.py parley serve --host 0.0.0.0
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# the names Parley resolves without a hub (engine/weights.py): the bundled packages and the set-up's mirrored models
PARLEY_NAMES = frozenset({"bundled", "bundled-multilingual", "auto", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"})
WHISPER_FILES = ["config.json", "preprocessor_config.json", "model.bin", "tokenizer.json", "vocabulary.*"]
LLM_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
XTTS_FILES = ["config.json", "model.pth", "vocab.json", "speakers_xtts.pth", "dvae.pth", "mel_stats.pth"]


def say(message: str) -> None:
    print(f"[parley-entrypoint] {message}", file=sys.stderr, flush=True)


def is_hub_name(value: str) -> bool:
    """Not a name Parley knows itself ('bundled', 'auto', a mirrored model fetched by the set-up) and not an
    existing file or folder: a name to fetch."""
    return bool(value) and value not in PARLEY_NAMES and not Path(value).exists()


def whisper_repo(name: str) -> str:
    """faster-whisper size names (large-v3, turbo, ...) to their CTranslate2 repos; repo ids pass through."""
    from faster_whisper.utils import _MODELS

    return _MODELS.get(name, name)


def planned(env: dict[str, str]) -> list[tuple[str, str, str, list[str]]]:
    """(setting, what, repo, file patterns) for each setting that names a hub model."""
    plan = []
    asr = env.get("PARLEY_ASR_MODEL", "bundled")
    if is_hub_name(asr):
        plan.append(("PARLEY_ASR_MODEL", "ASR (faster-whisper)", whisper_repo(asr), WHISPER_FILES))
    llm = env.get("PARLEY_LLM_MODEL", "auto")
    if env.get("PARLEY_LLM_BACKEND", "engine") in ("engine", "transformers") and is_hub_name(llm):
        plan.append(("PARLEY_LLM_MODEL", "LLM", llm, LLM_FILES))
    if env.get("PARLEY_TTS_BACKEND", "piper") == "coqui":
        voice = env.get("PARLEY_TTS_VOICE", "bundled")
        if voice == "bundled" or is_hub_name(voice):
            plan.append(
                (
                    "PARLEY_TTS_VOICE",
                    "TTS (Coqui XTTS-v2)",
                    "coqui/XTTS-v2" if voice == "bundled" else voice,
                    XTTS_FILES,
                )
            )
    return plan


def fetch(env: dict[str, str]) -> dict[str, str]:
    """Download what ``planned`` lists; returns the settings to override with local folders."""
    from huggingface_hub import snapshot_download

    overrides = {}
    for setting, what, repo, patterns in planned(env):
        if "XTTS" in what and env.get("COQUI_TOS_AGREED") != "1":
            raise SystemExit(
                "XTTS-v2 weights are under the Coqui Public Model License (non-commercial use only): "
                "set COQUI_TOS_AGREED=1 to accept it and fetch them"
            )
        say(f"{what}: {repo} -> {env.get('HF_HOME', '~/.cache/huggingface')} (downloaded once, then cached)")
        started = time.monotonic()
        path = snapshot_download(repo, allow_patterns=patterns)  # tqdm progress bars on stderr
        say(f"{what}: ready in {path} ({time.monotonic() - started:.0f} s); {setting}={path}")
        overrides[setting] = path
    return overrides


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: fetch_models.py COMMAND [ARGS...]")
    overrides = fetch(dict(os.environ))
    if not overrides:
        say("no hub models to fetch (bundled or local models)")
    os.environ.update(overrides)
    say(f"exec {' '.join(argv)}")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
