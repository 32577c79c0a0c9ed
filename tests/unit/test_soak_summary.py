"""`parley bench soak`'s report, without a server: the growth over the second half is what a leak shows as
(the first rounds fill pools and caches once), and its slope per 100 rounds is a least-squares fit."""

from __future__ import annotations

from argparse import Namespace

from app.bench.soak import summarize

ARGS = Namespace(spoken=1, typed=3, hang_ups=3, malformed=40, stuck_every=10)


def _samples(rss: list[float]) -> list[dict]:
    return [{"round": i + 1, "rss_mb": v, "settled": True, "seconds": i} for i, v in enumerate(rss)]


def test_a_warm_up_then_flat_is_flat():
    summary = summarize(_samples([900, 1100, 1150, 1150, 1151, 1150, 1150, 1151]), ARGS)
    assert summary["growth_second_half_mb"] == 0 and abs(summary["slope_mb_per_100_rounds"]) < 30
    assert summary["rss_after_first_round_mb"] == 900 and summary["rss_max_mb"] == 1151
    assert summary["stuck_readers"] == 1 and summary["all_settled"]


def test_a_leak_shows_as_its_slope():
    summary = summarize(_samples([1000 + 2 * i for i in range(40)]), ARGS)
    assert summary["slope_mb_per_100_rounds"] == 200 and summary["growth_second_half_mb"] == 38
