"""Barge-in on its own: scripted words for the speech so far, a stand-in reply, no models.

The whole conversation's barge-in (the VAD, the tracker's transcription, the interrupt sent)
is checked in test_conversation; here, when the unit hears and when it stops.
"""

from __future__ import annotations

import asyncio

from fakes import StandInReply

from app.config import Settings
from app.voice.barge_in import BARGE_IN_RECHECK_MS, BargeIn
from app.voice.turn_state import TurnState


class Scene:
    """A ``BargeIn`` over ``state.reply`` (the session's ``TurnState``); the scene is the utterance tracker: the user's words
    so far are ``words`` (or wait for ``gate`` when it is set)."""

    def __init__(self, words: str = "Wait, stop.") -> None:
        self.state = TurnState(Settings())
        self.state.tracker = self
        self.state.reply = StandInReply()
        self.words = words
        self.gate: asyncio.Event | None = None
        self.heard = 0  # transcriptions asked for
        self.stops = 0
        self.barge_in = BargeIn(self.state, self._stop)

    async def transcribe_speech_so_far(self) -> str:
        self.heard += 1
        if self.gate is not None:
            await self.gate.wait()
        return self.words

    async def _stop(self) -> None:
        self.stops += 1

    async def speaking(self, speech_ms: float, confirm: bool = True) -> None:
        await self.barge_in.speaking(speech_ms, confirm=confirm)
        for _ in range(5):  # let the check run
            await asyncio.sleep(0)


async def test_words_over_a_playing_reply_stop_it_after_hearing_them():
    scene = Scene("Wait, what about London?")
    scene.barge_in.speech_started(reply_playing=True)
    await scene.speaking(400)
    assert (scene.heard, scene.stops) == (1, 1)


async def test_a_backchannel_is_heard_but_does_not_stop_the_reply():
    scene = Scene("Mm-hmm, yeah.")
    await scene.speaking(400)
    assert (scene.heard, scene.stops) == (1, 0)


async def test_without_confirmation_the_reply_stops_unheard():
    scene = Scene("Mm-hmm, yeah.")
    await scene.speaking(400, confirm=False)
    assert (scene.heard, scene.stops) == (0, 1)


async def test_nothing_happens_without_a_reply_playing():
    scene = Scene()
    scene.state.reply = None
    await scene.speaking(400, confirm=False)
    scene.state.reply = StandInReply()
    scene.state.reply.playing = False  # played out
    await scene.speaking(800)
    assert (scene.heard, scene.stops) == (0, 0)


async def test_the_words_are_heard_again_only_after_more_speech():
    scene = Scene("Yeah.")
    await scene.speaking(400)
    await scene.speaking(400 + BARGE_IN_RECHECK_MS - 20)
    assert scene.heard == 1
    scene.words = "Yeah, but wait, what about London?"
    await scene.speaking(400 + BARGE_IN_RECHECK_MS)
    assert (scene.heard, scene.stops) == (2, 1)


async def test_one_check_at_a_time():
    scene = Scene()
    scene.gate = asyncio.Event()  # the transcription takes a while
    await scene.speaking(400)
    await scene.speaking(400 + 2 * BARGE_IN_RECHECK_MS)
    assert (scene.heard, scene.stops) == (1, 0)
    scene.gate.set()
    await scene.speaking(400 + 2 * BARGE_IN_RECHECK_MS)  # asked while the check still runs: then it stops the reply
    assert (scene.heard, scene.stops) == (1, 1)


async def test_a_reply_replaced_while_the_words_were_heard_is_not_stopped():
    scene = Scene()
    scene.gate = asyncio.Event()
    await scene.speaking(400)
    scene.state.reply = StandInReply(turn_id=2)  # the turn moved on meanwhile
    scene.gate.set()
    await scene.speaking(0)
    assert (scene.heard, scene.stops) == (1, 0)


async def test_a_new_utterance_is_judged_from_its_start():
    scene = Scene("Yeah.")
    await scene.speaking(1000)
    scene.barge_in.speech_started(reply_playing=True)
    await scene.speaking(400)  # less than 1000 + the recheck: heard only because the utterance is new
    assert scene.heard == 2


def test_only_a_backchannel_begun_over_a_playing_reply_is_no_turn():
    scene = Scene()
    scene.barge_in.speech_started(reply_playing=True)
    assert scene.barge_in.only_backchannel("Mm-hmm.")
    assert not scene.barge_in.only_backchannel("What about London?")
    scene.barge_in.speech_started(reply_playing=False)
    assert not scene.barge_in.only_backchannel("Mm-hmm.")  # "yeah" as an answer is a turn


async def test_close_cancels_a_check_in_progress():
    scene = Scene()
    scene.gate = asyncio.Event()
    await scene.speaking(400)
    await scene.barge_in.close()
    scene.gate.set()
    await scene.speaking(0)
    assert (scene.heard, scene.stops) == (1, 0)
