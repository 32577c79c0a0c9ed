"""The stages' ONNX Runtime sessions let idle threads sleep (``app.stages.onnx.cpu_session``)."""

from __future__ import annotations

import pytest

from app.stages.vad import SileroVad

pytestmark = pytest.mark.models


def spinning(session) -> str:
    return session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")


def options(session):
    return session.get_session_options()


def test_the_vad_session_does_not_spin_and_keeps_one_thread():
    session = SileroVad().session
    assert spinning(session) == "0"
    assert (options(session).intra_op_num_threads, options(session).inter_op_num_threads) == (1, 1)
    assert options(session).log_severity_level == 4


def test_piper_sessions_do_not_spin():
    from app.stages.tts import PiperSynthesizer

    tts = PiperSynthesizer(threads=1, urgent_threads=2)
    name = tts.voices[0]
    for model, threads in ((tts._voices[name], 1), (tts._urgent_voices[name], 2)):
        assert len(model.sessions) == 2  # the bundled voice runs in two halves (app.stages.piper_halves)
        for session in model.sessions:
            assert spinning(session) == "0"
            assert options(session).intra_op_num_threads == threads


def test_piper_on_onnx_runtimes_own_thread_count_does_not_spin():
    from app.stages.tts import PiperSynthesizer

    tts = PiperSynthesizer(threads=None)
    for session in tts._voices[tts.voices[0]].sessions:
        assert spinning(session) == "0"
        assert options(session).intra_op_num_threads == 0  # ONNX Runtime's default count
    assert not tts._urgent_voices  # as before: no second session without a bound
