"""``VadStream``'s decision rule on scripted probabilities (no model): where speech, quiet and silence begin."""

from __future__ import annotations

import numpy as np

from app.stages.base import VadConfig
from app.stages.vad import WINDOW, VadStream


class ScriptedProbabilities:
    """Gives the listed speech probabilities, one per window."""

    def __init__(self, probabilities: list[float]) -> None:
        self._next = iter(probabilities)

    def probability(self, window_with_context, state):
        return next(self._next), state


def run(probabilities: list[float]) -> tuple[VadStream, list[tuple[int | None, int | None]]]:
    """The stream after the windows, and (quiet_start, silence_start) after each one."""
    stream = VadStream(ScriptedProbabilities(probabilities), VadConfig(min_speech_ms=64, min_silence_ms=96))
    seen = []
    for _ in probabilities:
        stream.feed(np.zeros(WINDOW, np.float32))
        seen.append((stream.quiet_start, stream.silence_start))
    return stream, seen


def test_quiet_begins_under_the_speech_threshold_a_window_before_the_silence():
    stream, seen = run([0.9, 0.9, 0.9, 0.45, 0.2, 0.1, 0.1])
    assert seen[2] == (None, None)
    assert seen[3] == (3 * WINDOW, None)  # 0.45: not speech enough to go on, not yet silence (0.35)
    assert seen[4] == (3 * WINDOW, 4 * WINDOW)
    assert not stream.speaking and stream.quiet_start is None  # the end: 96 ms of silence


def test_a_window_over_the_speech_threshold_ends_the_quiet_a_window_between_does_not():
    _, seen = run([0.9, 0.9, 0.4, 0.45, 0.9, 0.2, 0.4, 0.9])
    assert seen[2] == seen[3] == (2 * WINDOW, None)
    assert seen[4] == (None, None)
    assert seen[5] == seen[6] == (5 * WINDOW, 5 * WINDOW)  # 0.4 after silence: still quiet, still silence
    assert seen[7] == (None, None)


def test_no_quiet_before_speech_starts():
    _, seen = run([0.1, 0.2, 0.9, 0.9])
    assert all(quiet is None for quiet, _ in seen)
