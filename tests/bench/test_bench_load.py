"""`parley bench load`'s verdicts, on made-up users (the ramp itself runs against a real server by hand)."""

from app.bench.load import User, levels, real_time_capacity, summarize


def user(index: int, joined_at: float, turns: list[tuple[float, float, float]]) -> User:
    made = User(index, joined_at)
    for at, ms, rtf in turns:
        made.record(at, ms, rtf)
    return made


def test_served_in_real_time_needs_every_reply_fast_enough_and_a_low_p95():
    good = user(0, 0.0, [(5, 500, 3.0), (10, 600, 2.5), (15, 700, 4.0)])
    slow = user(1, 20.0, [(25, 500, 3.0), (30, 600, 2.5), (35, 2500, 4.0)])
    behind = user(2, 40.0, [(45, 500, 3.0), (50, 600, 0.9), (55, 700, 4.0)])
    failed = user(3, 60.0, [(65, 500, 3.0), (70, 600, 3.0)])
    failed.failed.append("turn 3: timeout")
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


def test_capacity_is_the_most_users_at_once_whose_turns_were_all_real_time():
    # alone: fast; with a second user: still fast; with a third: p95 over the threshold
    first = user(0, 0.0, [(5, 900, 2.0), (10, 1000, 2.0), (15, 1100, 1.8), (25, 1500, 1.5), (35, 2600, 1.2)])
    second = user(1, 20.0, [(24, 1200, 1.6), (28, 1400, 1.4), (33, 1300, 1.3), (44, 2900, 1.0)])
    third = user(2, 30.0, [(36, 2500, 1.1), (41, 2400, 0.9)])
    report = levels([first, second, third], 2000)
    assert [(level["users"], level["turns"], level["real_time"]) for level in report] == [
        (1, 3, True),
        (2, 3, True),
        (3, 5, False),
    ]
    assert real_time_capacity(report) == 2
    assert summarize([first, second, third], 2000)["real_time_capacity"] == 2


def test_a_level_with_too_few_turns_is_not_shown_to_be_real_time():
    alone = user(0, 0.0, [(5, 900, 2.0), (10, 900, 2.0)])
    assert real_time_capacity(levels([alone], 2000)) == 0
