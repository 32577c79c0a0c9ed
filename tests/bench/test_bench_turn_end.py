"""`parley bench turn-end` without models: the labelled set, the scores and the fit."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from app.bench.turn_end import UTTERANCES, Judged, fit_weights, held_out_accuracy, score, split_marked
from app.voice.turns import Endpointer, looks_unfinished


def test_the_set_holds_every_kind_of_sentence_each_with_a_mid_clause_pause_point():
    kinds = Counter(kind for kind, _ in UTTERANCES)
    assert len(UTTERANCES) >= 60 and set(kinds) == {"question", "command", "statement"} and min(kinds.values()) >= 15
    for _, marked in UTTERANCES:
        assert marked.count("|") == 1, marked
        whole, before = split_marked(marked)
        assert whole.startswith(before) and len(before) < len(whole) and whole[-1] in ".?"
    # some pauses follow a word the words' own cue knows ("for", "to"), others only the LLM can tell
    cued = sum(looks_unfinished(split_marked(marked)[1]) for _, marked in UTTERANCES)
    assert 0.3 < cued / len(UTTERANCES) < 0.8


def judged(complete: bool, audio: float, text: float, transcript: str = "Set a timer for ten minutes.") -> Judged:
    return Judged("command", complete, transcript, 1.0, transcript, looks_unfinished(transcript), audio, text)


# the sound misjudges both commands; the LLM reads them right
RECORDS = [
    judged(True, 0.05, 0.4),
    judged(True, 0.9, 0.3),
    judged(False, 0.97, 1e-9, "Read me the latest."),
    judged(False, 0.05, 1e-8, "I would like to hear"),
]


def test_scores_each_signal_alone_combined_and_the_endpoint_with_and_without_the_llm():
    summary = score(RECORDS, Endpointer())
    table = summary["all"]
    assert table["audio"] == {"complete_ok": 1, "complete": 2, "paused_ok": 1, "paused": 2, "accuracy": 0.5}
    assert table["text"]["accuracy"] == table["combined"]["accuracy"] == 1.0
    assert table["endpoint_today"]["complete_ok"] == 1 and table["endpoint_today"]["paused_ok"] == 1
    assert table["endpoint_combined"]["accuracy"] == 1.0
    weights = Endpointer().weights  # the combination without the sound is 0.5 there
    assert summary["text_threshold"] == pytest.approx(10 ** (-weights.bias / weights.text))
    json.dumps(summary)


def test_the_fit_separates_what_the_text_separates():
    weights = fit_weights(RECORDS * 5)
    assert weights.text > 0
    assert score(RECORDS, Endpointer(weights=weights))["all"]["combined"]["accuracy"] == 1.0


def pair(sentence: str, whole_text_p: float, paused_text_p: float) -> list[Judged]:
    """One utterance said whole and paused, as the bench records them (whole first)."""
    return [
        Judged("command", True, sentence, 1.0, sentence, False, 0.5, whole_text_p),
        Judged("command", False, sentence[:5], 1.0, sentence[:5], False, 0.5, paused_text_p),
    ]


def test_held_out_accuracy_judges_each_utterance_with_weights_fitted_without_it():
    telling = [r for n in range(20) for r in pair(f"sentence {n}", 0.5, 1e-8)]
    assert held_out_accuracy(telling, Endpointer()) == 1.0
    # when the text says the opposite on half the utterances, weights fitted on the others cannot judge them
    misleading = [r for n in range(20) for r in pair(f"sentence {n}", *((0.5, 1e-8) if n % 2 else (1e-8, 0.5)))]
    assert held_out_accuracy(misleading, Endpointer()) <= 0.6
