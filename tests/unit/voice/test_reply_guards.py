"""Each reply guard counts its firings in the turn's ``TurnMetrics`` (``guard_*``), which ``parley bench quality`` sums.

The guards' behaviour is checked in test_conversation.py; here only that each firing is counted, once,
under its own name, and that a reply no guard touched carries no count on the wire.
"""

from __future__ import annotations

from app import protocol

QUESTION = "How are you today?"


async def turn_metrics(conversation, pieces: list[str]) -> protocol.TurnMetrics:
    conv = conversation(llm_pieces=pieces)
    await conv.type(QUESTION)
    await conv.settle()
    return conv.of(protocol.TurnDone)[-1].metrics


async def test_a_piece_said_again_counts_as_a_repeat(conversation):
    loop = "I am not sure about today. "
    metrics = await turn_metrics(conversation, ["Good question. ", loop, "It depends. ", loop, loop])
    assert metrics.guard_repeat == 1 and metrics.guard_loop is None


async def test_a_repeat_at_the_very_end_of_the_reply_counts_too(conversation):
    metrics = await turn_metrics(conversation, ["I'm not today. ", "I'm not today."])  # caught at the flush
    assert metrics.guard_repeat == 1 and metrics.guard_loop is None


async def test_a_loop_inside_a_sentence_counts_as_a_loop(conversation):
    metrics = await turn_metrics(conversation, ["Sure thing. ", "You want a big", *[" ol'"] * 8, " party."])
    assert metrics.guard_loop == 1 and metrics.guard_repeat is None


async def test_a_reply_no_guard_cut_sends_no_guard_counts(conversation):
    metrics = await turn_metrics(conversation, ["Yes, indeed. ", "It is Paris. ", "Yes, indeed."])  # two words: speech
    assert metrics.guard_repeat is None and metrics.guard_loop is None
    wire = protocol.encode(protocol.TurnDone(turn_id=1, text="", metrics=metrics))
    assert "guard_" not in wire


def test_the_guard_fields_are_named_for_the_benchmark_to_sum():
    assert protocol.GUARD_FIELDS == ("guard_repeat", "guard_loop")
    assert not set(protocol.GUARD_FIELDS) & set(protocol.LATENCY_FIELDS)
