"""`parley bench quality` without a server or models: answer matching, the defects found in hand-written
transcripts, the summary, the question set's own consistency, and the typed user on a scripted connection."""

from __future__ import annotations

import json
from collections import deque

import pytest

from app import protocol
from app.bench import quality, quality_score
from app.bench.quality import TypedUser
from app.bench.quality_score import (
    TurnRecord,
    answers_earlier,
    is_short,
    mentions,
    near_copy,
    normalize,
    repeats_cut_reply,
    score_conversation,
    score_turn,
    summarize,
)
from app.bench.quality_set import (
    CONVERSATIONS,
    QUESTIONS,
    SCORED,
    Ask,
    alone_questions,
    chat,
    closing,
    fact,
    follow_up,
    interrupt,
    recall,
    tell,
)
from app.config import Settings
from app.voice.history import history_window


# ------------------------------------------------------------------ matching
@pytest.mark.parametrize(
    ("reply", "answers", "expected"),
    [
        ("The capital of France is PARIS!", ("paris",), True),
        ("Chromosomes are in cells.", ("rome",), False),  # whole words only
        ("There are seven days in a week.", ("7",), True),
        ("A week has 7 days.", ("7",), True),
        ("Seventy days.", ("7",), False),
        ("Twenty-four hours.", ("24",), True),
        ("It boils at one hundred degrees.", ("100",), True),
        ("It boils at a hundred degrees.", ("100",), True),
        ("It has eight legs.", ("80",), False),
        ("Hens lay eggs.", ("egg",), True),
        ("Cows say moo.", ("quack", "quacking"), False),
        ("Ducks go quacking.", ("quack", "quacking"), True),
        ("The king of the jungle is the lion.", ("king of the jungle",), True),
        ("", ("paris",), False),
    ],
)
def test_an_answer_is_matched_as_whole_words_any_case_numbers_as_digits_or_words(reply, answers, expected):
    assert mentions(reply, answers) is expected


def test_numbers_in_words_become_one_number_each():
    assert normalize("one hundred and five, twenty four, one two") == ["105", "24", "1", "2"]
    assert normalize("zero and ninety-nine") == ["0", "and", "99"]


def test_a_near_copy_is_the_same_words_or_the_same_opening():
    earlier = "The capital of France is Paris, a city famous for its art and food."
    assert near_copy(earlier, earlier)
    assert near_copy("The capital of France is Paris, a city famous for its art and wine.", earlier)  # one word
    assert near_copy("The capital of France is Paris, a city of lights and long summer evenings.", earlier)
    assert not near_copy("Bees make honey from the nectar of flowers.", earlier)
    assert not near_copy("The capital of Italy is Rome.", "The capital of France is Paris.")  # 4 of 8 words
    assert not near_copy("", earlier)


def test_a_reply_after_a_cancel_repeats_it_when_it_opens_with_the_cut_words():
    cut = "Once upon a time, a dragon"
    assert repeats_cut_reply("Once upon a time, a dragon named Ember lived in a cave.", cut)
    assert not repeats_cut_reply("The planet we live on is Earth.", cut)
    assert not repeats_cut_reply("Once upon a time.", "Once upon")  # too short a cut to tell


def test_a_reply_answers_an_earlier_question_only_when_it_lacks_its_own_answer():
    earlier = [fact("What is the capital of Italy?", "rome"), tell("My name is Maya.")]
    spain = follow_up("And what about Spain?", "What is the capital of Spain?", "madrid")
    assert answers_earlier("The capital of Italy is Rome.", spain, earlier) == 0
    assert answers_earlier("Madrid, not Rome.", spain, earlier) is None  # it has the right answer
    assert answers_earlier("I don't know.", spain, earlier) is None
    rome_trip = fact("How far is Rome from Paris?", "1400")
    assert answers_earlier("Rome is far.", rome_trip, earlier) is None  # the question says "Rome" itself
    name = recall("What is my name?", "maya")
    assert answers_earlier("Rome.", name, [*earlier, name]) == 0
    assert answers_earlier("Maya, I think.", spain, [*earlier, name]) is None  # a recalled name is no answer


def test_a_reply_under_three_words_is_short_unless_it_answers_thanks_or_goodbye():
    assert is_short("Paris.", fact("What is the capital of France?", "paris"))
    assert is_short("", chat("How are you?"))
    assert not is_short("It is Paris.", fact("What is the capital of France?", "paris"))
    assert not is_short("Goodbye!", closing("Thanks, goodbye!"))


# ------------------------------------------------------------------ a hand-written conversation
def transcript(*turns: tuple[Ask, str], guards: dict[int, dict[str, int]] | None = None) -> list[TurnRecord]:
    records = [
        TurnRecord(0, index, ask, reply, written=reply, guards=(guards or {}).get(index, {}))
        for index, (ask, reply) in enumerate(turns)
    ]
    return records


ITALY = fact("What is the capital of Italy?", "rome")
SPAIN = follow_up("And what about Spain?", "What is the capital of Spain?", "madrid")
WEEK = fact("How many days are in a week?", "7")
NAME = recall("What is my name?", "maya")
STORY = interrupt("Tell me a long story about a dragon.")
EARTH = fact("What planet do we live on?", "earth")


def scored_conversation() -> list[TurnRecord]:
    records = transcript(
        (chat("Hi! How are you today?"), "I'm doing well, thank you for asking!"),
        (tell("My name is Maya."), "Nice to meet you, Maya!"),
        (ITALY, "The capital of Italy is Rome."),
        (SPAIN, "The capital of Italy is Rome."),  # a copy, and the earlier question's answer
        (NAME, "Your name is Maya."),
        (WEEK, "Seven."),  # right, but short
        (STORY, "Once upon a time, a dragon named Ember"),
        (EARTH, "Once upon a time, a dragon named Ember lived on Earth."),  # right, and says the cut reply again
        (closing("Thanks, goodbye!"), "Bye!"),
        guards={3: {"guard_repeat": 1, "guard_loop": 0}, 7: {"guard_repeat": 0, "guard_loop": 1}},
    )
    records[6].interrupted = True
    records[6].reply = "Once upon"  # what was heard of it
    records[3].asked_in_full = "What is the capital of Spain?"  # the server's rewrite (setting follow_ups)
    score_conversation(records)
    return records


def test_each_defect_of_a_hand_written_conversation_is_found_where_it_is():
    records = scored_conversation()
    assert [r.right for r in records] == [None, None, True, False, True, True, None, True, None]
    assert [r.copy_of for r in records] == [None, None, None, 2, None, None, None, None, None]
    assert [r.answers_turn for r in records] == [None, None, None, 2, None, None, None, None, None]
    assert [r.short for r in records] == [False, False, False, False, False, True, False, False, False]
    assert [r.repeats_cut_reply for r in records] == [None] * 7 + [True, None]


def test_a_goodbye_may_be_short_but_not_a_copy():
    records = transcript(
        (ITALY, "The capital of Italy is Rome."),
        (closing("Thanks!"), "You're welcome."),
        (closing("Goodbye!"), "The capital of Italy is Rome."),
    )
    score_conversation(records)
    assert [r.short for r in records] == [False, False, False]
    assert [r.copy_of for r in records] == [None, None, 0]


def test_each_turn_is_described_on_one_line_with_what_is_wrong_with_it():
    records = scored_conversation()
    assert quality_score.describe(records[3]) == (
        "c1 t4  follow_up And what about Spain? -> 'The capital of Italy is Rome.'  [WRONG, copies t3, answers t3, repeat]"
    )
    assert quality_score.describe(TurnRecord(None, 0, ITALY, "Rome.", right=True)).startswith("alone t1  fact")


def test_a_conversation_without_defects_has_none():
    records = transcript(
        (ITALY, "Rome is the capital of Italy."),
        (SPAIN, "Spain's capital is Madrid."),
        (STORY, "Once upon a time, a dragon"),
        (EARTH, "We live on planet Earth."),
    )
    score_conversation(records)
    assert all(r.copy_of is None and r.answers_turn is None and not r.short for r in records)
    assert records[3].repeats_cut_reply is False and records[1].right


def test_the_summary_counts_each_figure_in_conversation_and_alone():
    talk = scored_conversation()
    alone = [
        TurnRecord(None, 0, ITALY, "Rome."),
        TurnRecord(None, 1, WEEK, "A week has five days."),  # wrong alone, right in the conversation
        TurnRecord(None, 2, EARTH, "Earth.", guards={"guard_repeat": 1, "guard_loop": 0}),
        TurnRecord(None, 3, Ask(SPAIN.in_full, "follow_up", SPAIN.answers), "It is Madrid, in the centre."),
    ]
    for record in alone:
        score_turn(record)
    summary = summarize([talk], alone)
    assert summary["facts_right_in_conversation"] == 3 and summary["facts_asked_in_conversation"] == 3
    assert summary["facts_right_alone"] == 2 and summary["facts_asked_alone"] == 3
    assert summary["facts_wrong_alone_right_in_conversation"] == 1
    assert summary["facts_right_alone_wrong_in_conversation"] == 0
    assert (summary["user_facts_recalled"], summary["user_facts_asked"]) == (1, 1)
    assert (summary["follow_ups_right"], summary["follow_ups_asked"]) == (0, 1)
    assert (summary["follow_ups_in_full_right_alone"], summary["follow_ups_in_full_asked_alone"]) == (1, 1)
    assert summary["follow_ups_asked_in_full"] == 1 and summary["questions_asked_in_full_not_follow_ups"] == 0
    assert summary["copied_replies"] == 1 and summary["answers_to_an_earlier_question"] == 1
    assert summary["questions_in_conversation"] == 5
    assert summary["short_replies_in_conversation"] == 1 and summary["short_replies_alone"] == 2
    assert summary["replies_repeating_the_cancelled_one"] == 1 and summary["cancelled_replies"] == 1
    assert summary["cancelled_replies_cut"] == 1
    assert summary["guard_repeat_in_conversation"] == 1 and summary["guard_loop_in_conversation"] == 1
    assert summary["guard_repeat_alone"] == 1 and summary["guard_loop_alone"] == 0
    assert summary["replies_cut_by_a_guard_in_conversation"] == 2
    # the cancelled reply is no reply's length: 7 5 6 6 4 1 11 1 words
    assert summary["words_per_reply_median_in_conversation"] == 5.5
    json.dumps(summary)
    quality_score.print_table(summary)


# ------------------------------------------------------------------ the question set
def test_the_set_asks_at_least_40_facts_in_conversation_and_alone():
    facts = [ask for conversation in CONVERSATIONS for ask in conversation if ask.kind == "fact"]
    assert len(facts) >= 40 and len({ask.text for ask in facts}) == len(facts)
    alone = alone_questions()
    assert {ask.text for ask in facts} <= {ask.text for ask in alone}
    assert sum(ask.kind == "follow_up" for ask in alone) == sum(
        ask.kind == "follow_up" for conversation in CONVERSATIONS for ask in conversation
    )


@pytest.mark.parametrize("number", range(len(CONVERSATIONS)))
def test_no_answer_of_a_conversation_answers_another_of_its_questions(number):
    scored = [ask for ask in CONVERSATIONS[number] if ask.kind in SCORED]
    for ask in scored:
        assert ask.answers and all(normalize(answer) for answer in ask.answers)
        for other in scored:
            if other is not ask:
                assert not any(mentions(answer, other.answers) for answer in ask.answers), (ask.text, other.text)


@pytest.mark.parametrize("number", range(len(CONVERSATIONS)))
def test_each_turn_kind_stands_where_it_can_be_scored(number):
    asks = CONVERSATIONS[number]
    assert asks[-1].kind == "closing"
    for index, ask in enumerate(asks):
        if ask.kind == "follow_up":
            assert asks[index - 1].kind in QUESTIONS and ask.in_full
        if ask.kind == "interrupt":
            assert asks[index + 1].kind in QUESTIONS  # the reply after the cancel is checked


@pytest.mark.parametrize("number", range(len(CONVERSATIONS)))
def test_a_told_fact_is_asked_back_while_still_in_the_default_history_window(number):
    asks = CONVERSATIONS[number]
    limit = Settings().max_history_messages
    history = []
    for ask in asks:
        if ask.kind == "recall":
            told = [earlier for earlier in asks if earlier.kind == "tell" and mentions(earlier.text, ask.answers)]
            assert len(told) == 1, ask.text
            window = history_window([*history, {"role": "user", "content": ask.text}], limit)
            assert {"role": "user", "content": told[0].text} in window, ask.text
        history += [{"role": "user", "content": ask.text}, {"role": "assistant", "content": "a reply"}]


# ------------------------------------------------------------------ the typed user, on a scripted connection
class ScriptedConnection:
    """Answers each typed text with a reply's events (its audio unless a ``config`` turned ``reply_audio`` off); a
    cancel cuts the reply in progress."""

    output_sample_rate = 1000

    def __init__(self, replies: dict[str, str], guards: dict[str, dict[str, int]] | None = None) -> None:
        self.replies, self.guards = replies, guards or {}
        self.sent: list = []
        self.incoming: deque = deque()
        self.turn_id = 0
        self.closed = False
        self.reply_audio = True

    async def send_text(self, text: str) -> None:
        self.sent.append(protocol.UserText(text=text))
        self.turn_id += 1
        reply, turn = self.replies[text], self.turn_id
        metrics = protocol.TurnMetrics(**self.guards.get(text, {}))
        audio = [
            protocol.AudioStart(turn_id=turn, sample_rate=self.output_sample_rate),
            b"\0\0" * 500,  # 0.5 s
            b"\0\0" * 250,
        ]
        self.incoming += [
            protocol.Transcript(turn_id=turn, text=text, final=True),
            protocol.AssistantText(turn_id=turn, delta=reply),
            *(audio if self.reply_audio else []),
            protocol.TurnDone(turn_id=turn, text=reply, metrics=metrics),
        ]

    async def send(self, message) -> None:
        self.sent.append(message)
        if isinstance(message, protocol.SessionConfig):
            self.reply_audio = self.reply_audio if message.reply_audio is None else message.reply_audio
            self.incoming.append(
                protocol.ConfigApplied(
                    system_prompt="-", voice="-", language="en", barge_in=True, half_duplex=False, reply_audio=False
                )
            )
        if isinstance(message, protocol.Cancel):
            self.incoming.clear()  # what was not sent yet never is
            heard = self.replies[self.sent[-2].text].split()[0]
            self.incoming += [
                protocol.Interrupt(turn_id=self.turn_id),
                protocol.TurnDone(turn_id=self.turn_id, text=heard, interrupted=True),
            ]

    async def recv(self, timeout_s: float | None = None):
        if not self.incoming:
            raise TimeoutError
        return self.incoming.popleft()

    async def close(self) -> None:
        self.closed = True


async def test_a_turn_waits_for_its_turn_done_then_says_the_reply_was_heard_in_full():
    connection = ScriptedConnection({"What is two plus two?": "Two plus two is four."})
    answer = await TypedUser(connection).ask("What is two plus two?")
    assert answer.reply == "Two plus two is four." and not answer.interrupted
    assert connection.sent[-1] == protocol.Playback(turn_id=1, played_ms=750.0)


async def test_a_cancelled_turn_is_cut_after_its_first_audio_and_keeps_what_was_written():
    text = "Tell me a long story about a dragon."
    connection = ScriptedConnection({text: "Once upon a time, a dragon baked bread."})
    answer = await TypedUser(connection).ask_and_cancel(text)
    assert isinstance(connection.sent[-1], protocol.Cancel) and answer.audio_samples == 500
    assert answer.interrupted and answer.reply == "Once"
    assert "".join(answer.written) == "Once upon a time, a dragon baked bread."
    assert not any(isinstance(message, protocol.Playback) for message in connection.sent)  # heard only in part


async def test_a_run_resets_before_each_conversation_and_question_and_sums_the_guards(monkeypatch):
    talk = (fact("What is two plus two?", "4"), interrupt("Tell me a story."), fact("What do bees make?", "honey"))
    replies = {
        "What is two plus two?": "Four.",
        "Tell me a story.": "Once upon a time.",
        "What do bees make?": "Honey.",
    }
    # (the metrics each turn_done carries: a guard fired, the reply was written without the conversation)
    connection = ScriptedConnection(replies, guards={"What do bees make?": {"guard_loop": 1, "history_left_out": True}})

    async def connect(url):
        return connection

    monkeypatch.setattr(quality, "open_connection", connect)
    done = await quality.run("ws://test/ws", (talk,), seed=0, say=lambda line: None, actions=(), how_tos=())
    conversations, alone = done.conversations, done.alone
    assert done.actions == [] and done.how_tos == []
    resets = sum(isinstance(message, protocol.Reset) for message in connection.sent)
    assert resets == 1 + 2 and connection.closed  # one conversation, two facts alone
    # replies come as text only, but for the cancelled one: spoken, so that it is cut where it was heard
    configs = [(i, m.reply_audio) for i, m in enumerate(connection.sent) if isinstance(m, protocol.SessionConfig)]
    story = connection.sent.index(protocol.UserText(text="Tell me a story."))
    assert [audio for _, audio in configs] == [False, True, False] and configs[1][0] == story - 1
    assert not any(isinstance(m, protocol.Playback) for m in connection.sent)  # no audio, nothing to report
    assert [r.reply for r in conversations[0]] == ["Four.", "Once", "Honey."]
    assert conversations[0][1].interrupted and conversations[0][2].repeats_cut_reply is False
    assert sorted(r.ask.text for r in alone) == ["What do bees make?", "What is two plus two?"]
    assert all(r.right for r in alone)
    summary = summarize(conversations, alone)
    assert summary["guard_loop_in_conversation"] == 1 and summary["guard_loop_alone"] == 1
    assert summary["fact_without_the_conversation"] == 1 and summary["follow_up_without_the_conversation"] == 0


def test_an_action_is_right_only_when_its_tool_completed_with_what_was_asked_and_a_decline_claims_nothing():
    from app.bench.quality_actions import ActionAsk, ActionRecord, summarize_actions

    timer = ActionAsk("Set a timer for 10 minutes.", "set_timer", ("10 minutes",), "tune")
    lights = ActionAsk("Turn on the kitchen lights.", None)

    def done(name: str, output: str, status: str = "completed") -> protocol.ToolDone:
        return protocol.ToolDone(turn_id=1, call_id="c", name=name, status=status, output=output)

    set_right = ActionRecord(timer, "Done.", [done("set_timer", '{"set": "a timer for 10 minutes"}')])
    refused = ActionRecord(timer, "How long?", [done("set_timer", '{"error": "the user did not say how long"}')])
    made_up = ActionRecord(lights, "I turned on the lights.", [done("set_timer", '{"set": "a timer for 10 minutes"}')])
    claimed = ActionRecord(lights, "I've turned on the kitchen lights for you.", [])
    honest = ActionRecord(lights, "Sorry, I cannot control lights.", [done("play_lights", "{}", "failed")])
    assert set_right.right and not refused.right
    assert not made_up.right and not claimed.right and claimed.claim_without_action and honest.right
    summary = summarize_actions([set_right, refused, made_up, claimed, honest])
    assert summary["actions_right_tune"] == 1 and summary["actions_asked_tune"] == 2
    assert summary["declined_right_held_out"] == 1 and summary["declines_asked_held_out"] == 3
    assert summary["claims_without_action_held_out"] == 1
    assert "action_audio_s_max" not in summary  # typed: no audio
    spoken = [ActionRecord(timer, "Done.", [], heard="Set a timer for 10 minutes.", audio_s=s) for s in (2.0, 21.5)]
    summary = summarize_actions(spoken)
    assert summary["action_audio_s_max"] == 21.5 and summary["action_replies_over_20_s_of_audio"] == 1
    assert spoken[0].to_json()["heard"] == "Set a timer for 10 minutes." and "heard" not in set_right.to_json()
    km = ActionAsk("How many kilometers is 5 miles?", "convert_units", ("8.04",), also=("calculate",))
    assert ActionRecord(km, "", [done("calculate", '{"result": 8.047, "say": "5 miles is about 8.047 km"}')]).right
    assert not ActionRecord(km, "", [done("calculate", '{"result": 8}')]).right
    assert not ActionRecord(timer, "", [done("calculate", '{"set": "a timer for 10 minutes"}')]).right


def test_the_action_set_has_two_halves_and_each_tool_of_the_default_skills():
    from app.bench.quality_actions import ACTIONS

    for half in ("tune", "held_out"):
        mine = [a for a in ACTIONS if a.half == half]
        assert {a.tool for a in mine} >= {"set_timer", "set_reminder", "get_time", "calculate", "convert_units", None}
    assert len({a.text for a in ACTIONS}) == len(ACTIONS)


def test_a_how_to_is_answered_when_it_names_what_any_answer_would_and_is_for_the_ear_without_markup():
    from app.bench.quality_howto import HOW_TOS, HowTo, HowToRecord, summarize_how_tos

    eggs = HowTo("How do I boil an egg?", ("water", "minutes", "boil"))
    spoken = HowToRecord(eggs, "Put the egg in boiling water for about nine minutes, then cool it.")
    listed = HowToRecord(eggs, "Here's how:\n1. Boil water.\n2. Add the egg.", guards={"guard_length": 1})
    bold = HowToRecord(eggs, "**Step one:** put it in water.")
    declined = HowToRecord(eggs, "Sorry, I can't help with that.")
    assert spoken.on_topic and not spoken.markup
    assert listed.on_topic and listed.markup and bold.markup
    assert not declined.on_topic and not declined.markup
    assert not HowToRecord(eggs, "Pasta takes 10 minutes or so.").markup  # a number is not a list
    summary = summarize_how_tos([spoken, listed, bold, declined])
    assert summary["how_tos_on_topic"] == 3 and summary["how_tos_asked"] == 4
    assert summary["how_tos_with_markup"] == 2 and summary["how_tos_ended_by_length_guard"] == 1
    assert len({h.text for h in HOW_TOS}) == len(HOW_TOS) >= 10 and all(h.expect for h in HOW_TOS)


async def test_a_run_asks_each_how_to_in_a_fresh_conversation(monkeypatch):
    from app.bench.quality_howto import HowTo

    connection = ScriptedConnection({"How do I cook rice?": "Simmer one cup of rice in two cups of water."})

    async def connect(url):
        return connection

    monkeypatch.setattr(quality, "open_connection", connect)
    rice = HowTo("How do I cook rice?", ("water", "simmer"))
    done = await quality.run("ws://test/ws", (), seed=0, say=lambda line: None, actions=(), how_tos=(rice,))
    assert [r.reply for r in done.how_tos] == ["Simmer one cup of rice in two cups of water."]
    assert done.how_tos[0].on_topic and isinstance(connection.sent[-2], protocol.Reset)


def test_several_seeds_are_distinct_and_their_spread_is_each_figure_s_min_median_max():
    assert quality.seeds_of(None) == [None] and quality.seeds_of("0,1, 2") == [0, 1, 2]
    for bad in ("1,1", "-1", ",", "a"):
        with pytest.raises(ValueError):
            quality.seeds_of(bad)
    runs = [{"facts": 30, "p50": 1.7, "half": "tune", "flag": True}, {"facts": 28, "p50": 1.9}, {"facts": 31}]
    assert quality.spread(runs) == {"facts": {"min": 28, "median": 30, "max": 31}}
    with pytest.raises(SystemExit):
        quality.main(["--seeds", "0,1", "--url", "ws://127.0.0.1:1/ws"])  # a seed needs its own server
