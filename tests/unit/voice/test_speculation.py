"""The speculative reply on its own: a scripted reply factory, stand-in replies, no models.

When the conversation speculates (a pause, not a filler, the setting on) and what reaches the
client is checked in test_conversation; here, which tail text starts, keeps or cancels a held reply.
"""

from __future__ import annotations

from fakes import StandInReply

from app.stages.base import TurnEndVerdict
from app.voice.context import Fitted
from app.voice.reply_factory import Weighing, weigh_heard
from app.voice.speculation import Speculation
from app.voice.utterance import TailText


class HeldReply(StandInReply):
    """A stand-in reply that also records how it was started."""

    speech_end = 0.0

    def timed(self, *, speech_end: float, commit: float = 0.0, **figures) -> None:
        self.speech_end = speech_end

    def start(
        self,
        messages: list[dict],
        *,
        released: bool,
        alone: list[dict] | None = None,
        alone_acts_only=False,
        turn_end=None,
        weighed=None,
    ) -> None:
        self.log.append("start (released)" if released else "start (held)")
        self.messages, self.alone, self.turn_end, self.weighed = messages, alone, turn_end, weighed


class Scene:
    """A ``Speculation`` over a factory (the scene) whose prompts are cut when longer than ``max_chars``, in the turn's
    ``language``."""

    def __init__(self, max_chars: int = 100) -> None:
        self.max_chars = max_chars
        self.language = "en"
        self.made: list[HeldReply] = []
        self.languages: list[str | None] = []
        self.heard: dict[str, float] = {}  # what the words heard so far of each text gained from the conversation
        self.speculation = Speculation(self, self)
        self.weighs = True  # whether replies may be written from the words alone (``alone_prompt``)
        self.undecided_both = True  # ``history_relevance_spoken`` "both"
        self.reads_turn_end = True  # whether the LLM can read the end-of-turn verdict from a reply's prefill

    def heard_gain(self, text: str, related: list[dict]) -> float | None:
        return self.heard.get(text)

    def prompt(self, user_text: str) -> Fitted:
        cut = max(0, len(user_text) - self.max_chars)
        return Fitted([{"role": "user", "content": user_text[: self.max_chars]}], truncated_chars=cut)

    def alone_prompt(self, user_text: str, related: list[dict]) -> list[dict] | None:
        if not self.weighs:
            return None
        return [{"role": "system", "content": f"Answer in {self.language}."}, {"role": "user", "content": user_text}]

    def weigh(self, related: list[dict], alone: list[dict] | None, heard_gain: float | None, *, spoken) -> Weighing:
        assert spoken  # a speculation answers speech
        return weigh_heard(related, alone, heard_gain, threshold=0.9, margin=0.5, undecided_both=self.undecided_both)

    def take_turn_end(self, verdict: TurnEndVerdict | None, messages: list[dict]) -> TurnEndVerdict | None:
        if verdict is None or not self.reads_turn_end:
            return None
        verdict.take(len(messages))
        return verdict

    def new(self, turn_id: int, user_text: str) -> HeldReply:
        self.languages.append(self.language)
        self.made.append(HeldReply(turn_id, user_text))
        return self.made[-1]

    async def pause(self, text: str, speech_end: float = 5.0, verdict: TurnEndVerdict | None = None) -> None:
        await self.speculation.start(TailText(turn_id=1, text=text, speech_end=speech_end, verdict=verdict))


async def test_a_tail_starts_a_held_reply_in_the_turn_s_language():
    scene = Scene()
    scene.language = "de"
    await scene.pause("Wie spät ist es?", speech_end=7.5)
    [reply] = scene.made
    assert reply.log == ["start (held)"] and reply.speech_end == 7.5
    assert reply.messages == [{"role": "user", "content": "Wie spät ist es?"}]
    # the reply may weigh the words without the conversation too (``Reply.start``), in the same language
    assert reply.alone == [
        {"role": "system", "content": "Answer in de."},
        {"role": "user", "content": "Wie spät ist es?"},
    ]
    assert scene.languages == ["de"] and scene.speculation.running


async def test_the_same_text_is_not_speculated_again():
    scene = Scene()
    await scene.pause("What is the capital of France?")
    await scene.pause("What is the capital of France?")
    assert len(scene.made) == 1 and scene.made[0].log == ["start (held)"]


async def test_a_new_text_cancels_the_old_speculation():
    scene = Scene()
    await scene.pause("Tell me about Paris.")
    await scene.pause("Tell me about Paris. And London too.")
    old, new = scene.made
    assert old.log == ["start (held)", "cancel"] and new.log == ["start (held)"]


async def test_an_over_long_prompt_is_not_speculated():
    scene = Scene(max_chars=20)
    await scene.pause("Tell me about Paris.")  # 20 characters: fits
    await scene.pause("Tell me about Paris, and London.")
    [fitting] = scene.made
    assert fitting.log == ["start (held)", "cancel"] and not scene.speculation.running


async def test_a_commit_with_the_same_text_adopts_the_held_reply():
    scene = Scene()
    await scene.pause("What is the capital of France?")
    reply = await scene.speculation.take("What is the capital of France?")
    assert reply is scene.made[0] and reply.log == ["start (held)"]  # handed over still held: the session releases it
    assert not scene.speculation.running


async def test_a_commit_with_other_text_cancels_the_held_reply():
    scene = Scene()
    await scene.pause("What is the capital")
    assert await scene.speculation.take("What is the capital of France?") is None
    assert scene.made[0].log == ["start (held)", "cancel"] and not scene.speculation.running


async def test_cancel_and_take_without_a_speculation_do_nothing():
    scene = Scene()
    await scene.speculation.cancel()
    assert await scene.speculation.take("Hi.") is None
    assert not scene.made and not scene.speculation.running


async def test_a_plain_reply_takes_the_end_of_turn_verdict_to_read_from_its_prefill():
    """One prefill for the reply and the verdict (``TurnEndVerdict``): taken by the reply written from the
    conversation, also one that weighs the words alone beside it (read from the conversation's prompt); not where the
    LLM cannot read it, nor for a tail that offers none: then the tracker asks the LLM apart."""
    scene = Scene()
    scene.weighs = False
    offered = TurnEndVerdict()
    await scene.pause("What time is it?", verdict=offered)
    assert scene.made[-1].turn_end is offered and offered.taken and offered.position == 1

    scene.weighs = True
    offered = TurnEndVerdict()
    await scene.pause("What time is it now?", verdict=offered)
    assert scene.made[-1].alone is not None
    assert scene.made[-1].turn_end is offered and offered.taken and offered.position == 1

    scene.weighs, scene.reads_turn_end = False, False
    offered = TurnEndVerdict()
    await scene.pause("What time is it in Oslo?", verdict=offered)
    assert scene.made[-1].turn_end is None and not offered.taken

    scene.reads_turn_end = True
    await scene.pause("Is it late?")
    assert scene.made[-1].turn_end is None


async def test_an_over_long_tail_takes_no_verdict():
    scene = Scene(max_chars=10)
    offered = TurnEndVerdict()
    await scene.pause("Tell me everything about the history of Rome.", verdict=offered)
    assert not scene.made and not offered.taken


async def test_words_heard_while_the_user_spoke_start_the_reply_on_one_prompt_which_reads_the_verdict():
    """Where the words heard so far clearly chose (``ReplyFactory.weigh``), the reply starts on that prompt alone,
    and reads the end-of-turn verdict from it, the words-alone prompt too; where they did not, it weighs both and
    reads the verdict from the conversation's prompt."""
    scene = Scene()
    scene.heard = {"And Spain?": 2.4, "What time is it?": -0.6, "How tall is it?": 1.1}
    offered = TurnEndVerdict()
    await scene.pause("And Spain?", verdict=offered)
    related = scene.made[-1]
    assert related.messages == [{"role": "user", "content": "And Spain?"}] and related.alone is None
    assert related.weighed == 2.4 and related.turn_end is offered and offered.position == 1

    offered = TurnEndVerdict()
    await scene.pause("What time is it?", verdict=offered)
    alone = scene.made[-1]
    assert alone.messages == [
        {"role": "system", "content": "Answer in en."},
        {"role": "user", "content": "What time is it?"},
    ]
    assert alone.alone is None and alone.weighed == -0.6 and alone.turn_end is offered and offered.position == 2

    offered = TurnEndVerdict()
    await scene.pause("How tall is it?", verdict=offered)  # 1.1: within the margin of 0.9
    both = scene.made[-1]
    assert both.messages == [{"role": "user", "content": "How tall is it?"}] and both.alone is not None
    assert both.weighed is None and both.turn_end is offered and offered.position == 1
