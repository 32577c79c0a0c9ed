"""`parley bench wyoming` without servers or models: the corpus it writes, and its figures and ratios."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from app.audio import ASR_SAMPLE_RATE, read_wav
from app.bench.samples import trim_to_speech
from app.bench.wyoming import (
    PARLEY,
    RATES,
    TEXTS,
    Record,
    build_corpus,
    corpus_plan,
    ratio,
    speech_rms,
    summarize,
    verdict,
)


def fake_voice(text: str, rate: float) -> np.ndarray:
    """A stand-in for the bundled voice: silence, a tone as long as the text and the rate make it, silence."""
    seconds = 0.02 * len(text) * rate
    t = np.arange(int(seconds * ASR_SAMPLE_RATE)) / ASR_SAMPLE_RATE
    tone = 0.4 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    silence = np.zeros(ASR_SAMPLE_RATE // 2)
    return np.concatenate([silence, tone, silence]).astype(np.float32)


def test_the_plan_cycles_the_rates_and_says_no_text_twice_at_the_same_rate():
    plan = corpus_plan(15)
    assert [rate for _, rate in plan[:6]] == [*RATES, *RATES]
    assert [text for text, _ in plan[:12]] == list(TEXTS) and len(set(TEXTS)) == 12
    assert len(set(plan)) == 15  # samples 13-15 repeat texts 1-3, each at another rate


def test_the_corpus_is_matched_wav_and_txt_pairs_at_16_khz_with_the_noise_asked(tmp_path):
    samples = build_corpus(tmp_path, 4, snr_db=20.0, seed=7, speak=fake_voice)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"00{i}.{ext}" for i in range(1, 5) for ext in ("txt", "wav")]
    for sample, (text, rate) in zip(samples, corpus_plan(4), strict=True):
        assert (sample.text, sample.rate) == (text, rate)
        assert (tmp_path / f"{sample.sample_id}.txt").read_text().strip() == text
        with wave.open(str(tmp_path / f"{sample.sample_id}.wav"), "rb") as wav:
            assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (ASR_SAMPLE_RATE, 1, 2)
        noisy, _ = read_wav(tmp_path / f"{sample.sample_id}.wav")
        clean = trim_to_speech(fake_voice(text, rate))  # trimmed to the speech, then the noise added
        assert len(noisy) == len(clean) and sample.duration_s == pytest.approx(len(clean) / ASR_SAMPLE_RATE)
        noise = noisy - clean
        snr = 20 * np.log10(speech_rms(clean) / np.sqrt(np.mean(noise**2)))
        assert snr == pytest.approx(20.0, abs=0.5)


def test_the_noise_is_seeded(tmp_path):
    first = build_corpus(tmp_path / "a", 2, snr_db=10.0, seed=1, speak=fake_voice)
    build_corpus(tmp_path / "b", 2, snr_db=10.0, seed=1, speak=fake_voice)
    build_corpus(tmp_path / "c", 2, snr_db=10.0, seed=2, speak=fake_voice)
    wav = f"{first[0].sample_id}.wav"
    assert (tmp_path / "a" / wav).read_bytes() == (tmp_path / "b" / wav).read_bytes()
    assert (tmp_path / "a" / wav).read_bytes() != (tmp_path / "c" / wav).read_bytes()


def test_wyoming_bench_reads_the_corpus_in_order(tmp_path):
    corpus = pytest.importorskip("wyoming_bench.stt.corpus")
    samples = build_corpus(tmp_path, 3, snr_db=None, speak=fake_voice)
    loaded = corpus.load_corpus(tmp_path)
    assert [(s.sample_id, s.reference, s.rate, s.width, s.channels) for s in loaded] == [
        (sample.sample_id, sample.text, ASR_SAMPLE_RATE, 2, 1) for sample in samples
    ]


def stt(server: str, round_no: int, total_ms: float, errors: int = 0, words: int = 5, ok: bool = True) -> Record:
    return Record("stt", "non_streaming", server, round_no, "001", ok, "" if ok else "timed out", None, total_ms,
                  errors, words)  # fmt: skip


def test_the_summary_leaves_the_warm_up_and_failures_out_and_pools_the_wer():
    records = [
        stt(PARLEY, -1, 5000.0, errors=5),  # the warm-up: not counted
        stt(PARLEY, 0, 100.0, errors=1, words=5),
        stt("peer", 0, 300.0, errors=0, words=5),
        stt(PARLEY, 0, 200.0, errors=0, words=15),
        stt("peer", 0, 500.0, errors=2, words=15),
        stt(PARLEY, 0, 9000.0, ok=False),
    ]
    entry = summarize(records)["stt non_streaming"]
    parley, peer = entry["servers"][PARLEY], entry["servers"]["peer"]
    assert (parley["ok"], parley["failed"], peer["ok"], peer["failed"]) == (2, 1, 2, 0)
    assert parley["total_ms"] == {"mean": 150.0, "p50": 150.0, "p95": pytest.approx(195.0)}
    assert parley["first_ms"] == {"mean": None, "p50": None, "p95": None}
    assert parley["wer"] == pytest.approx(1 / 20) and peer["wer"] == pytest.approx(2 / 20)
    assert entry["peer"] == "peer"
    assert entry["ratio"] == {"total_ms": pytest.approx(400 / 150), "first_ms": None}


def test_the_ratio_is_peer_over_parley_and_says_which_way():
    assert ratio(300.0, 100.0) == 3.0 and verdict(3.0) == "Parley is 3.0× faster"
    assert ratio(100.0, 250.0) == 0.4 and verdict(0.4) == "Parley is 2.5× slower"
    assert ratio(None, 100.0) is None and ratio(100.0, 0.0) is None and verdict(None) == "n/a"


def test_without_parley_there_is_no_ratio():
    entry = summarize([stt("peer", 0, 300.0)])["stt non_streaming"]
    assert entry["ratio"] == {} and entry["peer"] == "peer"
