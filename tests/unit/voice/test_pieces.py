"""The piece cutter on its own: deltas in, pieces out, and the two guards (a loop said once, a piece said again)."""

from __future__ import annotations

from app.voice.pieces import PieceCutter


def cut(deltas: list[str], said: list[str] | None = None) -> tuple[list[str], PieceCutter]:
    cutter = PieceCutter(said if said is not None else [], first_clause_chars=0, first_piece_words=30)
    pieces: list[str] = []
    for delta in deltas:
        pieces += cutter.push(delta)
        if cutter.stopped:
            break
    return pieces + cutter.flush(), cutter


def test_sentences_come_out_whole_and_are_remembered_as_said():
    said: list[str] = []
    pieces, cutter = cut(["Paris is the capital", " of France. It is", " lovely."], said)
    assert pieces == ["Paris is the capital of France.", "It is lovely."] and said == pieces
    assert not cutter.stopped


def test_a_piece_said_before_is_not_said_again_and_ends_the_text():
    pieces, cutter = cut(["I am not sure. ", "I am not sure. ", "Anyway."], ["Hello there."])
    assert pieces == ["I am not sure."] and cutter.repeated and not cutter.looping


def test_a_loop_is_said_once():
    pieces, cutter = cut(["The answer is 2018 2018 " + "the thing the thing the thing the thing the thing"])
    assert cutter.looping and not cutter.repeated
    assert " ".join(pieces).count("the thing") == 1
