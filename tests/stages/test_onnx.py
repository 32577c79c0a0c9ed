"""The stages' ONNX Runtime sessions let idle threads sleep (``app.stages.onnx.cpu_session``)."""

from __future__ import annotations

import pytest

from app.stages.vad import SileroVad

pytestmark = pytest.mark.models


def spinning(session) -> str:
    return session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")


def test_the_vad_session_does_not_spin():
    assert spinning(SileroVad().session) == "0"


def test_piper_sessions_do_not_spin():
    from app.stages.tts import PiperSynthesizer

    tts = PiperSynthesizer(threads=1, urgent_threads=2)
    name = tts.voices[0]
    for voice in (tts._voices[name], tts._urgent_voices[name]):
        assert spinning(voice.session) == "0"
        assert voice.session.get_session_options().intra_op_num_threads in (1, 2)


def test_piper_on_every_core_does_not_spin():
    import os

    from app.stages.tts import PiperSynthesizer

    session = PiperSynthesizer(threads=None).voice.session
    assert spinning(session) == "0"
    assert session.get_session_options().intra_op_num_threads == (os.cpu_count() or 1)
