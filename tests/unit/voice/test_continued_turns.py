"""Continued turns on their own: ``ContinuedTurns`` with a stand-in reply, a manual clock and recorded calls.

The whole conversation's continued turns (VAD, tracker, the reply's audio) are checked in
test_continuation; here, what the unit holds, withdraws, releases and asks the session to do.
"""

from __future__ import annotations

from fakes import ManualClock, StandInReply

from app import protocol
from app.config import Settings
from app.voice.continuation import ContinuationRule, ContinuedTurns
from app.voice.history import History
from app.voice.turn_state import TurnState

FIRST, WHOLE = "I want to visit Paris.", "I want to visit Paris. And London."
ANSWER = {"role": "assistant", "content": "Paris is lovely."}


class Scene:
    """``ContinuedTurns`` beside a session's stand-in: its reply, history and the calls it gets."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.history = History(8)
        self.state = TurnState(Settings())
        self.state.tracker = self  # the tracker told to go on with a turn (``continue_turn``)
        self.sent: list[protocol.ServerMessage] = []
        self.continued: list[tuple[int, str]] = []  # (turn id, text) the tracker was told to go on with
        self.started: list[tuple[int, str]] = []  # turns answered afresh
        self.turns = ContinuedTurns(
            ContinuationRule(window_ms=1500, heard_ms=500),
            self.state,
            history=self.history,
            clock=self.clock,
            send_json=self._send,
            start_turn=self._start_turn,
        )

    def continue_turn(self, turn_id: int, text: str) -> None:
        self.continued.append((turn_id, text))

    async def _send(self, message: protocol.ServerMessage) -> None:
        self.sent.append(message)

    async def _start_turn(self, turn_id: int, text: str, *, speech_end: float, commit: float) -> None:
        self.started.append((turn_id, text))

    async def spoken_turn_answered(self, *, heard_s: float = 0.0) -> StandInReply:
        """Turn 1 was committed from speech now, and its reply plays (recorded in the history)."""
        await self.turns.committed(1)
        self.state.reply = StandInReply(1, FIRST, commit=self.clock.now(), heard_s=heard_s)
        self.history.remember({"role": "user", "content": FIRST})
        self.history.remember(ANSWER)
        return self.state.reply

    def withdrawn(self) -> list[int]:
        return [m.turn_id for m in self.sent if isinstance(m, protocol.TurnContinued)]


async def test_speech_right_after_a_spoken_turn_holds_its_reply_and_goes_on_with_the_turn():
    scene = Scene()
    reply = await scene.spoken_turn_answered()
    await scene.turns.speech_started(onset=scene.clock.now() + 0.3)
    assert scene.turns.holding and reply.log == ["hold"]
    assert scene.continued == [(1, FIRST)]
    assert scene.history.messages == []  # taken back until the new words are known
    assert scene.turns.new_words(WHOLE) == "And London."


async def test_speech_too_late_or_after_too_much_was_heard_or_after_a_typed_turn_is_a_new_turn():
    scene = Scene()
    reply = await scene.spoken_turn_answered()
    await scene.turns.speech_started(onset=scene.clock.now() + 1.6)  # past the 1500 ms window
    heard = Scene()
    heard_reply = await heard.spoken_turn_answered(heard_s=0.6)  # past the 500 ms heard
    await heard.turns.speech_started(onset=heard.clock.now() + 0.3)
    typed = Scene()
    typed.state.reply = StandInReply(1, FIRST, commit=typed.clock.now())  # no spoken turn was committed
    await typed.turns.speech_started(onset=typed.clock.now() + 0.3)
    for each, its_reply in ((scene, reply), (heard, heard_reply), (typed, typed.state.reply)):
        assert not each.turns.holding and its_reply.log == [] and each.continued == []
        assert each.turns.new_words(WHOLE) == WHOLE


async def test_the_turn_committed_again_withdraws_the_held_reply():
    scene = Scene()
    reply = await scene.spoken_turn_answered()
    await scene.turns.speech_started(onset=scene.clock.now() + 0.3)
    await scene.turns.committed(1)
    assert reply.log == ["hold", "cancel"] and scene.state.reply is None
    assert scene.withdrawn() == [1] and not scene.turns.holding
    await scene.turns.end()  # nothing is left to end
    assert scene.started == [] and reply.log == ["hold", "cancel"]


async def test_nothing_added_gives_the_turn_back_and_releases_its_reply():
    scene = Scene()
    reply = await scene.spoken_turn_answered()
    await scene.turns.speech_started(onset=scene.clock.now() + 0.3)
    await scene.turns.end()  # a cough
    assert reply.log == ["hold", "release"] and not scene.turns.holding
    assert scene.history.messages == [{"role": "user", "content": FIRST}]  # the reply records itself when done
    assert scene.withdrawn() == []


async def test_words_over_the_held_reply_withdraw_it_and_a_cough_after_that_answers_the_turn_again():
    scene = Scene()
    reply = await scene.spoken_turn_answered()
    await scene.turns.speech_started(onset=scene.clock.now() + 0.3)
    assert await scene.turns.withdraw_if_held()
    assert reply.log == ["hold", "cancel"] and scene.state.reply is None and scene.withdrawn() == [1]
    assert not await scene.turns.withdraw_if_held()  # already withdrawn: the session interrupts nothing held
    await scene.turns.end()  # the words turned out to be nothing: the stopped reply is made again
    assert scene.started == [(1, FIRST)] and scene.withdrawn() == [1]


async def test_only_the_held_reply_is_withdrawn():
    scene = Scene()
    assert not await scene.turns.withdraw_if_held()  # nothing held
    await scene.spoken_turn_answered()
    await scene.turns.speech_started(onset=scene.clock.now() + 0.3)
    scene.state.reply = StandInReply(2, "Something else.")  # (the session's reply is another one)
    assert not await scene.turns.withdraw_if_held()
    assert scene.withdrawn() == [] and scene.turns.holding


async def test_typed_input_makes_the_held_turn_an_ordinary_one_again():
    scene = Scene()
    await scene.spoken_turn_answered()
    await scene.turns.speech_started(onset=scene.clock.now() + 0.3)
    scene.turns.abandon()
    assert not scene.turns.holding and scene.history.messages == [{"role": "user", "content": FIRST}]
    withdrawn = Scene()
    await withdrawn.spoken_turn_answered()
    await withdrawn.turns.speech_started(onset=withdrawn.clock.now() + 0.3)
    await withdrawn.turns.withdraw_if_held()
    withdrawn.turns.abandon()  # the client already dropped it: the turn is not remembered
    assert withdrawn.history.messages == [] and withdrawn.started == []


async def test_a_held_turn_left_without_a_verdict_is_ended_when_the_next_speech_starts():
    scene = Scene()
    reply = await scene.spoken_turn_answered()
    await scene.turns.speech_started(onset=scene.clock.now() + 0.3)
    scene.clock.advance(5.0)
    await scene.turns.speech_started(onset=scene.clock.now())  # far too late to continue again
    assert reply.log == ["hold", "release"] and not scene.turns.holding
