"""The piece cutter on its own: deltas in, pieces out, and the guards (a loop said once, a piece said again, a
runaway of any shape, the speech budget)."""

from __future__ import annotations

import pytest

from app.voice.pieces import PieceCutter
from app.voice.runaway import SPOKEN_CHARS_PER_S, PromptEcho, SpeechBudget, runaway_at, speech_budget_s


def cut(
    deltas: list[str], said: list[str] | None = None, budget_s: float | None = None, first_clause_chars: int = 0
) -> tuple[list[str], PieceCutter]:
    said = said if said is not None else []
    budget = SpeechBudget(budget_s)
    cutter = PieceCutter(said, first_clause_chars=first_clause_chars, first_piece_words=3, budget=budget)
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
    assert pieces == ["I am not sure."] and cutter.stop == "repeat"


def test_a_loop_is_said_once():
    pieces, cutter = cut(["The answer is 2018 2018 " + "the thing the thing the thing the thing the thing"])
    assert cutter.stop == "loop"
    assert " ".join(pieces).count("the thing") == 1


# the reply heard as 32 s of numbers with a 6 s stall: a misheard question, the bundled model, streamed token by token
RUNAWAY = "This guy is a 2018-2020-10-01-12-12-20-20-21-20-22-23-24-25-26-27-28-29-30-31-32-33-34-35-36-37-38-39-40"


def test_the_32_second_chain_of_numbers_is_cut_before_it_is_said():
    tokens = [RUNAWAY[i : i + 3] for i in range(0, len(RUNAWAY), 3)]
    pieces, cutter = cut(tokens)
    assert cutter.stop == "runaway"
    assert " ".join(pieces) == "This guy is a"  # what came before it, and none of the numbers
    assert sum(len(t) for t in tokens[: tokens.index(next(t for t in tokens if "-" in t)) + 20]) < 100  # cut early


@pytest.mark.parametrize(
    ("text", "shape", "kept"),
    [
        (
            "Sure: " + ", ".join(str(n) for n in range(1, 30)) + ".",
            "counting",
            "Sure: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12",
        ),
        ("Here you go: " + "a1b2c3d4" * 8, "unbroken", "Here you go:"),
        (  # the next tool's schema after a call, as the default brain wrote it through vLLM
            'Okay, {"name": "set_timer", "arguments": {"type": "object", "properties": {"duration": {"type": "string"',
            "data",
            "Okay,",
        ),
        (  # after a failed conversion's error, as the default brain wrote it (5 s of speech)
            'I see. ```json\n["error", "I could not understand the quantity \'100\'"]',
            "data",
            "I see.",
        ),
        ('Done. ["error", "no such unit"]', "data", "Done."),
        (
            " ".join(
                f"I am here to help you with that {w}." for w in "one two three four five six seven eight".split()
            ),
            "repetitive",
            None,
        ),
    ],
)
def test_a_runaway_of_any_shape_is_found(text, shape, kept):
    found = runaway_at(text)
    assert found is not None and found.shape == shape
    if kept is not None:
        assert text[: found.at].strip() == kept


@pytest.mark.parametrize(
    "speech",
    [
        "Count with me: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. Well done!",
        "Call 555-123-4567 before 10:30 on 2024-01-01; it costs 12.50 dollars.",
        "The water cycle moves water between the oceans, the air and the land. Water evaporates, rises, cools into "
        "clouds and falls again as rain or snow, then flows back to the sea through rivers and the ground.",
        "Anticonstitutionnellement and Donaudampfschifffahrtsgesellschaft are long words.",
        'She said "wait": then left. The set {1, 2} has two items; [see page 3] for "more".',
        'The words ["yes" and "no"] are short; so is {"ok"}.',
        "Use two backticks `` or one ` in text.",
    ],
)
def test_speech_is_not_a_runaway(speech):
    assert runaway_at(speech) is None
    assert cut([speech])[1].stop is None


def test_a_reply_ends_at_the_first_sentence_end_after_its_budget():
    sentences = [
        "Paris is the capital of France and its largest city. ",
        "It sits on the river Seine in the north of the country. ",
        "The city is known for its museums, cafes and the Eiffel Tower. ",
        "About two million people live in the city itself. ",
        "Many more live in the towns around it. ",
        "It has been a centre of art and science for centuries. ",
    ]
    pieces, cutter = cut(sentences, budget_s=10)  # ~3.5 s of speech each
    assert cutter.stop == "length" and len(pieces) == 3  # 3 x ~55 characters pass 10 s x 16 characters a second
    assert sum(len(p) + 1 for p in pieces) / SPOKEN_CHARS_PER_S < 10 * 1.25


def test_a_run_on_reply_ends_past_its_budget_even_without_a_sentence_end():
    words = (
        "first you mix the flour with sugar and a pinch of salt then you whisk two eggs into warm milk with melted "
        "butter and pour the wet bowl into the dry one stirring gently until no lumps remain after that you heat a "
        "pan over medium flame add oil ladle the batter wait for bubbles flip it once cook the other side serve hot"
    ).split()
    pieces, cutter = cut([w + " " for w in words], budget_s=5, first_clause_chars=16)  # the voice's pieces
    assert cutter.stop == "length" and sum(len(p) + 1 for p in pieces) / SPOKEN_CHARS_PER_S <= 5 * 1.25


def test_an_english_request_for_something_long_gets_the_long_budget_and_only_in_english():
    assert speech_budget_s("Tell me a story about a dragon.", "en", 15, 60) == 60
    assert speech_budget_s("Explain it step by step.", "en", 15, 60) == 60
    assert speech_budget_s("How do I make pancakes?", "en", 15, 60) == 15
    assert speech_budget_s("Tell me a story about a dragon.", "de", 15, 60) == 15
    assert speech_budget_s("Tell me a story about a dragon.", None, 15, 60) == 15


def test_the_tools_instructions_said_back_are_cut_where_they_begin():
    instructions = "To control the home, call its tools. For a device, pass its name and its domain."
    echo = PromptEcho(instructions)
    said_back = "Sure. To control the home, call its tools. For a device, pass its name"
    found = runaway_at(said_back, echo)
    assert found is not None and found.shape == "echo" and said_back[: found.at] == "Sure. "
    assert runaway_at("To control the home, call its tools. For a lamp,", echo) is None  # nine words in a row
    assert runaway_at("Turned on the kitchen light; call its tools for a device.", echo) is None
    assert PromptEcho("too short to echo").at("too short to echo") is None
