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


def test_the_growth_is_split_by_the_allocators_view():
    samples = _samples([1000, 1100, 1160])
    for sample, in_use, held in zip(samples, (300, 380, 390), (20, 30, 60), strict=True):
        sample.update(heap_in_use_mb=in_use, heap_free_held_mb=held, heap_mmapped_mb=5)
    growth = summarize(samples, ARGS)["growth_from_round_1_mb"]
    assert growth == {"rss_mb": 160, "heap_in_use_mb": 90, "heap_free_held_mb": 40, "heap_mmapped_mb": 0}


def test_the_server_exports_its_heap_as_glibc_sees_it():
    """``parley_heap_bytes`` (read by the soak) grows with a live allocation and says so in /metrics."""
    import ctypes

    import pytest

    from app.server.metrics import VoiceMetrics, heap_bytes

    before = heap_bytes()
    if before is None:
        pytest.skip("this libc has no mallinfo2 (glibc 2.33+)")
    block = ctypes.create_string_buffer(64 * 1024)  # under glibc's mmap threshold: an arena allocation
    after = heap_bytes()
    assert after["in_use"] - before["in_use"] >= 64 * 1024
    text = VoiceMetrics().render(0).decode()
    assert 'parley_heap_bytes{kind="in_use"}' in text and "process_resident_memory_bytes" in text
    del block
