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
    assert protocol.GUARD_FIELDS == ("guard_repeat", "guard_loop", "guard_runaway", "guard_length")
    assert not set(protocol.GUARD_FIELDS) & set(protocol.LATENCY_FIELDS)


async def test_the_32_second_chain_of_numbers_ends_the_reply_and_only_what_was_said_is_kept(conversation):
    chain = "This guy is a 2018-2020-10-01-12-12-20-20-21-20-22-23-24-25-26-27-28-29-30-31-32-33-34-35-36-37-38"
    conv = conversation(llm_pieces=["Good question. ", *[chain[i : i + 3] for i in range(0, len(chain), 3)]])
    await conv.type("What color is this guy on a clear day?")
    await conv.settle()
    done = conv.of(protocol.TurnDone)[-1]
    assert done.metrics.guard_runaway == 1 and "2018" not in done.text
    assert done.text == "Good question. This guy is a"  # what was said: the page and the history get it
    assert conv.session.history[-1] == {"role": "assistant", "content": done.text}


async def test_a_long_reply_ends_at_a_sentence_once_its_speech_budget_is_spent(conversation):
    sentences = [f"Point {n} is a sentence of some length that takes a while to say. " for n in range(12)]
    conv = conversation(llm_pieces=sentences, reply_speech_s=8.0)
    await conv.type("Tell me about Paris.")
    await conv.settle()
    done = conv.of(protocol.TurnDone)[-1]
    assert done.metrics.guard_length == 1 and done.text.endswith(".")
    assert 8 * 16 - 5 <= len(done.text) <= 8 * 16 * 1.25  # the budget (16 characters a second), within its overrun
    assert conv.session.history[-1]["content"] == done.text


def test_each_guard_is_counted_in_the_server_s_metrics():
    from prometheus_client import generate_latest

    from app.server.metrics import VoiceMetrics

    metrics = VoiceMetrics()
    metrics.observe_turn(protocol.TurnMetrics(guard_runaway=1))
    metrics.observe_turn(protocol.TurnMetrics(guard_length=1, guard_loop=2))
    text = generate_latest(metrics.registry).decode()
    assert 'parley_reply_guards_total{guard="runaway"} 1.0' in text
    assert 'parley_reply_guards_total{guard="loop"} 2.0' in text and 'guard="repeat"' not in text
