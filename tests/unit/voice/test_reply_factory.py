"""How a turn's reply is made: its prompt in the turn's language, fitted by the settings of the moment, its own request id."""

from __future__ import annotations

import asyncio
import functools

from fakes import FakeStages, ManualClock, ScriptedASR, run_inline
from harness import ScriptedLLM

from app.config import Settings
from app.voice.history import History
from app.voice.prefs import Preferences
from app.voice.reply import ReplyWiring
from app.voice.reply_factory import ReplyFactory, Weighing
from app.voice.turn_state import TurnState


class Scene:
    """A factory in a session's stead: the scene holds its ``TurnState`` and hears how replies end (``ReplyListener``)."""

    def __init__(self, **settings) -> None:
        self.state = TurnState(Settings(system_prompt="Be brief.", **settings))
        self.models = FakeStages(ScriptedASR(), ScriptedLLM(["Paris."]))
        self.history = History(8)
        self.completed, self.metrics = [], []
        self.on_metrics = None
        wiring = ReplyWiring(self.models, self._send, self._send, ManualClock(), run_inline, listener=self)
        prefs = Preferences(self.settings.system_prompt, self.models.asr, self.models.tts)
        self.factory = ReplyFactory(self.models, self.state, self.history, prefs, wiring, session_id="s1")

    @property
    def settings(self) -> Settings:
        return self.state.settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self.state.settings = settings

    def prompt(self, text: str, language: str):
        self.state.language = language
        return self.factory.prompt(text)

    def reply_complete(self, reply) -> None:
        self.completed.append(reply)

    def reply_failed(self, reply) -> None:
        pass

    def turn_metrics(self, metrics) -> None:
        if self.on_metrics is not None:
            self.on_metrics(metrics)

    async def _send(self, item) -> None:
        pass


def test_the_prompt_asks_for_the_turn_s_language_after_the_history():
    scene = Scene()
    scene.history.remember({"role": "user", "content": "Hi."})
    scene.history.remember({"role": "assistant", "content": "Hello!"})
    english = scene.prompt("What time is it?", "en").messages
    assert english == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What time is it?"},
    ]
    german = scene.prompt("Wie spät ist es?", "de").messages
    assert german[0]["content"] == "Be brief. The user speaks German: answer in German."


def test_the_settings_of_the_moment_fit_the_prompt():
    scene = Scene(llm_context_tokens=300, llm_max_tokens=200)
    long_turn = " ".join(["word"] * 150)
    assert scene.prompt(long_turn, "en").truncated_chars > 0
    scene.settings = scene.settings.model_copy(update={"llm_context_tokens": 1000})  # tuned live
    assert scene.prompt(long_turn, "en").truncated_chars == 0


async def test_each_reply_has_its_own_request_and_reports_to_whoever_listens_by_then():
    scene = Scene()
    first = scene.factory.new(1, "Hi.")
    again = scene.factory.new(1, "Hi.")  # a re-speculation of the same turn
    assert (first.request_id, again.request_id) == ("s1-1-1", "s1-1-2")
    scene.on_metrics = scene.metrics.append  # set after the factory was made, as the server does
    reply = scene.factory.new(2, "Hi.")
    reply.start(scene.prompt("Hi.", "en").messages, released=True)
    for _ in range(30):
        await asyncio.sleep(0)
    assert scene.completed == [reply] and len(scene.metrics) == 1


def test_the_words_heard_so_far_choose_one_prompt_only_when_clearly_on_one_side():
    scene = Scene(history_relevance_nats=0.9, history_relevance_margin_nats=0.5, history_relevance_spoken="both")
    related = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And Spain?"}]
    alone = [{"role": "system", "content": "Be brief. (alone)"}, {"role": "user", "content": "And Spain?"}]
    weigh = functools.partial(scene.factory.weigh, spoken=True)
    # no weighing (the setting off, tools, a remote LLM: ``alone_prompt`` gave None): the conversation
    assert weigh(related, None, 3.0) == Weighing(related)
    # clearly related / clearly standing alone: the one prompt, with the gain it was chosen on
    assert weigh(related, alone, 1.45) == Weighing(related, gain=1.45)
    assert weigh(related, alone, 0.35) == Weighing(alone, gain=0.35)
    assert weigh(related, alone, -2.0) == Weighing(alone, gain=-2.0)
    # nearer the threshold than the margin, or nothing heard that stands for the words: the reply weighs both
    for heard in (1.35, 0.45, 0.9, None):
        assert weigh(related, alone, heard) == Weighing(related, alone)
    scene.settings = scene.settings.model_copy(update={"history_relevance_margin_nats": 0.0})
    assert weigh(related, alone, 0.9) == Weighing(related, gain=0.9)  # margin 0: always, on the threshold kept


def test_a_spoken_turn_the_words_heard_did_not_choose_for_keeps_the_conversation_unless_set_to_weigh_both():
    scene = Scene(history_relevance_nats=0.9)  # history_relevance_spoken "heard", the default
    related = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    alone = [{"role": "system", "content": "Be brief. (alone)"}, {"role": "user", "content": "Why is the sky blue?"}]
    for heard in (None, 1.0):
        assert scene.factory.weigh(related, alone, heard, spoken=True) == Weighing(related)
        assert scene.factory.weigh(related, alone, heard, spoken=False) == Weighing(related, alone)  # typed: both
    assert scene.factory.weigh(related, alone, -0.5, spoken=True) == Weighing(alone, gain=-0.5)
