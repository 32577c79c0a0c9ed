"""Turn-taking policy alone: no models, no audio."""

import pytest

from app.voice.history import history_window
from app.voice.playback import ReplyPlayback
from app.voice.turns import (
    Endpointer,
    PartialStabilizer,
    is_backchannel,
    is_filler,
    looks_unfinished,
)


def test_partials_show_agreed_words_and_only_grow():
    stabilizer = PartialStabilizer()
    shown = [
        stabilizer.update(h)
        for h in [
            "What",
            "What is the",
            "What is the capital",
            "What is the capital of",
            "What is the capital of France?",
        ]
    ]
    assert shown == [None, None, "What is", "What is the", "What is the capital"]


def test_a_word_cut_at_the_end_of_the_audio_is_not_fixed():
    stabilizer = PartialStabilizer()
    assert stabilizer.update("how a rain") is None
    assert stabilizer.update("how a rainbow forms") == "how a"
    assert stabilizer.update("how a rainbow forms in") == "how a rainbow"


def test_partial_that_would_shrink_or_change_is_not_shown():
    stabilizer = PartialStabilizer()
    stabilizer.update("tell me a story")
    assert stabilizer.update("tell me a story now") == "tell me a"
    assert stabilizer.update("tell me") is None
    assert stabilizer.update("sell me a story now") is None


def test_unfinished_clauses():
    assert looks_unfinished("I want to go to Paris and")
    assert looks_unfinished("What is the capital of")
    assert looks_unfinished("Well,")
    assert looks_unfinished("So I was thinking...")
    assert looks_unfinished("I want to visit Paris and.")  # Whisper's period on cut-off audio
    assert not looks_unfinished("What is the capital of France?")
    assert not looks_unfinished("Tell me a joke")
    assert not looks_unfinished("")


def test_fillers_are_not_turns():
    assert is_filler("")
    assert is_filler("Mm.")
    assert is_filler("Hmm, uh")
    assert not is_filler("Mm, yes please")


def test_endpointer_waits_longer_mid_clause():
    endpointer = Endpointer(silence_ms=400, unfinished_silence_ms=1200)
    assert endpointer.required_silence_ms("What time is it?") == 400
    assert endpointer.required_silence_ms("I need to buy milk and") == 1200


def test_playback_heard_text_and_underruns():
    playback = ReplyPlayback(sample_rate=1000)
    playback.on_send(1000, now=10.0)  # 1 s of audio at t=10
    playback.add_piece("One two three four.")
    playback.on_send(1000, now=10.5)  # in time
    playback.add_piece("Five six seven eight.")
    assert playback.underruns == 0
    assert playback.heard_text(now=11.5) == "One two three four. Five six"
    assert playback.heard_text(now=13.0) == "One two three four. Five six seven eight."
    playback.on_send(500, now=14.0)  # the 2 s sent by 10.5 ran dry at 12.0: 2 s of silence
    assert playback.underruns == 1 and abs(playback.underrun_s - 2.0) < 1e-9
    assert playback.playing(now=14.2) and not playback.playing(now=14.6)


def test_client_playback_report_wins_over_the_estimate():
    playback = ReplyPlayback(sample_rate=1000)
    playback.on_send(2000, now=0.0)
    playback.add_piece("A long sentence of eight words right here.")
    playback.reported_played_s = 0.5
    assert playback.heard_text(now=5.0) == "A long"


def test_played_a_moment_before_the_client_s_report_is_wound_back():
    # The user began speaking at 10.3; the client's report (0.5 s played) came at 10.6
    playback = ReplyPlayback(sample_rate=1000)
    playback.on_send(2000, now=10.0)
    playback.report(0.5, now=10.6)
    assert playback.played_s(10.3) == pytest.approx(0.2)
    assert playback.played_s(10.6) == playback.played_s(11.0) == pytest.approx(0.5)
    assert playback.played_s(9.0) == 0.0
    assert ReplyPlayback(sample_rate=1000).played_s(10.3) == 0.0


def _chat(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": str(i)} for i in range(n)]


def test_history_window_jumps_and_starts_at_a_user_message():
    assert history_window(_chat(5), 0) == []
    assert history_window(_chat(8), 8) == _chat(8)
    starts = [history_window(_chat(n), 8)[0]["content"] for n in range(9, 21)]
    # 9..12 messages keep the start at message 4, 13..16 at 8, 17..20 at 12
    assert starts == ["4"] * 4 + ["8"] * 4 + ["12"] * 4
    assert all(len(history_window(_chat(n), 8)) <= 8 for n in range(30))
    odd = _chat(9)
    odd.insert(4, {"role": "assistant", "content": "x"})  # an assistant message where the window would start
    assert history_window(odd, 8)[0]["role"] == "user"


def test_english_word_cues_apply_to_english_only():
    assert looks_unfinished("I would like to visit Paris and")
    assert looks_unfinished("I would like to visit Paris and", "en")
    assert not looks_unfinished("Ich möchte nach Paris und", "de")  # the model hears the rest
    assert looks_unfinished("Ich möchte nach Paris,", "de")  # punctuation counts in every language
    assert looks_unfinished("我想去巴黎，", "zh")
    assert not is_filler("你好") and not is_filler("Hola")


def test_backchannels_are_short_acknowledgements_even_when_whisper_repeats_them():
    for said in ["Mm-hmm.", "Yeah.", "Right.", "I see.", "Got it.", "Uh-huh", "Yeah, right."]:
        assert is_backchannel(said), said
    assert is_backchannel("Yeah Yeah Yeah Yeah Yeah Yeah Yeah Yeah Yeah Yeah")  # tiny.en on one "yeah" in noise
    assert is_backchannel("Yeah, right. Yeah, right. Yeah, right.")
    for said in ["Wait, stop.", "Yeah, but what about London?", "No.", "Tell me more.", "In a month."]:
        assert not is_backchannel(said), said
