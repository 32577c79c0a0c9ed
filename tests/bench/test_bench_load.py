"""`parley bench load`'s verdicts, on made-up users (the ramp itself runs against a real server by hand)."""

from app.bench.load import User, summarize


def test_served_in_real_time_needs_every_reply_fast_enough_and_a_low_p95():
    good = User(0, 0.0, turns=3, voice_to_voice_ms=[500, 600, 700], rtf=[3.0, 2.5, 4.0])
    slow = User(1, 20.0, turns=3, voice_to_voice_ms=[500, 600, 2500], rtf=[3.0, 2.5, 4.0])
    behind = User(2, 40.0, turns=3, voice_to_voice_ms=[500, 600, 700], rtf=[3.0, 0.9, 4.0])
    failed = User(3, 60.0, turns=2, voice_to_voice_ms=[500, 600], rtf=[3.0, 3.0], failed=["turn 3: timeout"])
    refused = User(4, 80.0, refused="the server is answering slowly")
    assert [u.served_in_real_time(2000) for u in (good, slow, behind, failed, refused)] == [
        True,
        False,
        False,
        False,
        False,
    ]
    summary = summarize([good, slow, behind, failed, refused], 2000)
    assert summary["users_admitted"] == 4 and summary["users_refused"] == 1
    assert summary["users_served_in_real_time"] == 1 and summary["failed_turns"] == 1
    assert summary["refusals"] == ["the server is answering slowly"]
