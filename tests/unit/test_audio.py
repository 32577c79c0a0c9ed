import numpy as np

from app.audio import AUDIBLE_LEVEL, trim_leading_quiet

RATE = 1000  # one sample a millisecond


def test_the_quiet_before_the_first_audible_sample_is_cut_to_what_is_kept_and_faded_in():
    quiet = np.full(100, 0.005, np.float32)
    voice = np.full(50, 0.3, np.float32)
    trimmed = trim_leading_quiet(np.concatenate([quiet, voice]), RATE, keep_ms=20)
    assert len(trimmed) == 20 + 50
    assert trimmed[0] == 0.0 and np.all(np.diff(trimmed[:20]) > 0)  # faded in: no click at the cut
    assert np.array_equal(trimmed[20:], voice)  # the voice itself is untouched


def test_audio_that_starts_loud_or_is_never_audible_is_returned_whole():
    loud = np.full(30, 0.3, np.float32)
    assert trim_leading_quiet(loud, RATE, keep_ms=20) is loud
    soft_start = np.concatenate([np.full(10, 0.005, np.float32), loud])  # less quiet than what is kept
    assert trim_leading_quiet(soft_start, RATE, keep_ms=20) is soft_start
    hush = np.full(200, AUDIBLE_LEVEL / 2, np.float32)
    assert trim_leading_quiet(hush, RATE, keep_ms=20) is hush
