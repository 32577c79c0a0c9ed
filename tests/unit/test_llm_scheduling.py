"""The LLM's scheduling hooks are one capability apart (``LocalScheduling``): the in-process engine has it,
other backends have not, and a conversation on an LLM without it answers alike, skipping the hooks."""

from __future__ import annotations

import pytest

from app import protocol
from app.config import Settings
from app.stages.base import LocalScheduling, scheduling_of
from app.stages.llm import EngineChatLLM, OpenAIChatLLM, TransformersChatLLM
from app.stages.registry import set_open_sessions

QUESTION = "What is the capital of France?"
# WordTTS: a quarter second a word, so the fourth piece leaves more than YIELD_AHEAD_S of audio ahead
PIECES = ["Paris is the capital of France. ", "It lies on the Seine. ", "It is big and very old. ", "Many live there. "]


def test_only_the_in_process_engine_has_local_scheduling():
    # every hook: an engine missing one would have all of them skipped
    assert issubclass(EngineChatLLM, LocalScheduling)
    assert not issubclass(TransformersChatLLM, LocalScheduling)
    assert not issubclass(OpenAIChatLLM, LocalScheduling)
    assert scheduling_of(OpenAIChatLLM("http://127.0.0.1:1/v1")) is None


@pytest.mark.parametrize("llm_scheduling", [True, False])
async def test_a_conversation_answers_alike_with_or_without_local_scheduling(conversation, llm_scheduling):
    conv = conversation(
        llm_pieces=PIECES, turn_probability=0.95, first_piece_priority=True, llm_scheduling=llm_scheduling
    )
    conv.asr.partial = "What is the capital of"  # partials while speaking: the words so far are prefilled
    await conv.speak(1.6, QUESTION)
    await conv.silence_until(lambda: bool(conv.of(protocol.TurnDone)))
    await conv.settle()
    assert not conv.of(protocol.Error)
    assert conv.of(protocol.TurnDone)[-1].text == "".join(PIECES).strip()
    assert conv.session.models.tts.urgent[0] and conv.session.models.turn.heard_seconds
    llm = conv.llm  # the scripted LLM records each hook the session called
    used = [bool(llm.pauses), bool(llm.yields), bool(llm.warmed)]
    assert used == ([True, True, True] if llm_scheduling else [False, False, False])
    assert llm.cores_lent == 0


def test_the_solo_mode_without_local_scheduling_changes_only_the_session_side():
    class Models:
        llm, solo = OpenAIChatLLM("http://127.0.0.1:1/v1"), False

    models = Models()
    set_open_sessions(models, Settings(), 1)
    assert models.solo is True
