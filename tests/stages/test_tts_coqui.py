"""The optional Coqui XTTS-v2 backend: importable without Coqui, and a clear error when it is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.stages.tts_coqui import INSTALL_HINT, CoquiSynthesizer, CoquiUnavailable


def test_module_imports_without_coqui_and_never_imports_it():
    code = "import sys, app.stages.tts_coqui; assert 'TTS' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_instantiating_without_coqui_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "TTS", None)  # as if coqui-tts were not installed (import raises ImportError)
    with pytest.raises(CoquiUnavailable, match="Coqui TTS is not available") as error:
        CoquiSynthesizer("/models/XTTS-v2")
    assert INSTALL_HINT in str(error.value) and "parley[coqui]" in INSTALL_HINT
