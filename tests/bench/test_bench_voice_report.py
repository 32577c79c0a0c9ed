"""`parley bench voice` reporting, without a server or models: the summary, the chart, and the run
without matplotlib (the ``plot`` extra)."""

from __future__ import annotations

import builtins
import json

import pytest

from app import protocol
from app.bench import voice
from app.bench.voice import TurnRecord, plot, summarize


def record(client: int, turn: int, heard_ms: float | None, server_ms: float, question: str = "Why is the sky blue?"):
    return TurnRecord(
        client=client,
        turn=turn,
        question=question,
        transcript=question if turn % 2 == 0 else "why is this guy blue",
        reply="Because of Rayleigh scattering.",
        speech_s=1.5,
        at_client=protocol.TurnMetrics(
            voice_to_voice_ms=heard_ms, reply_audio_s=2.0, underruns=turn, underrun_s=0.04 * turn
        ),
        server=protocol.TurnMetrics(
            endpoint_ms=300.0,
            asr_final_ms=100.0,
            asr_compute_ms=150.0,
            llm_ttft_ms=60.0,
            tts_first_audio_ms=90.0,
            voice_to_voice_ms=server_ms,
            rtf=4.0,
            speculative=turn == 0,
        ),
    )


RECORDS = [record(0, 0, 600.0, 550.0), record(0, 1, 800.0, 750.0), record(1, 0, None, 500.0)]


def test_summary_takes_voice_to_voice_from_the_client_and_stages_from_the_server():
    summary = summarize(RECORDS, clients=2)
    assert summary["turns"] == 3 and summary["turns_with_audio"] == 2
    assert summary["voice_to_voice_ms_p50"] == pytest.approx(700.0)  # heard at the client
    assert summary["server_voice_to_voice_ms_p50"] == pytest.approx(550.0)
    for name in protocol.LATENCY_FIELDS:
        assert f"{name}_p50" in summary and f"{name}_p95" in summary
    assert summary["endpoint_ms_p95"] == pytest.approx(300.0)
    assert summary["asr_speed_p50"] == pytest.approx(10.0)  # 1.5 s of speech in 150 ms
    assert summary["rtf_min"] == 4.0 and summary["underruns"] == 1
    assert summary["underrun_s"] == pytest.approx(0.04) and summary["underrun_s_max"] == pytest.approx(0.04)
    assert summary["transcripts_correct"] == 2 and summary["speculative_turns"] == 2
    json.dumps(summary)


def test_per_turn_json_uses_the_turn_metrics_names():
    row = RECORDS[0].to_json()
    assert row["server"]["llm_ttft_ms"] == 60.0 and "voice_to_voice_ms" in row["at_client"]
    assert set(row["server"]) <= set(protocol.TurnMetrics.model_fields)
    assert "voice_to_voice_ms" not in RECORDS[2].to_json()["at_client"]  # no audio: the figure is left out


def test_chart_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "voice.png"
    assert plot(RECORDS, summarize(RECORDS, 2), path) is True
    assert path.read_bytes().startswith(b"\x89PNG")


def test_without_matplotlib_the_chart_is_skipped_and_the_json_still_written(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    async def fake_run(url, clients, turns, workload):
        return RECORDS

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(voice, "run", fake_run)
    monkeypatch.setattr(voice, "build_workload", lambda *args: voice.Workload())  # fake_run speaks nothing
    summary_path = tmp_path / "summary.json"
    code = voice.main(["--url", "ws://127.0.0.1:9/ws", "--out", str(tmp_path), "--json", str(summary_path)])
    assert code == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if "chart skipped" in line]
    assert len(skipped) == 1 and "pip install -e '.[plot]'" in skipped[0]
    assert not (tmp_path / "voice-plain-1c.png").exists()
    assert len(json.loads((tmp_path / "voice-plain-1c-turns.json").read_text())) == 3
    assert json.loads(summary_path.read_text())["turns"] == 3


@pytest.mark.models
def test_workloads_cut_at_the_acoustic_end_and_pause_mid_sentence():
    from app.bench.samples import speech_bounds

    plain = voice.build_workload("plain", None, [1.0], 0.7)
    for _, audio in plain.questions:
        start, end = speech_bounds(audio)
        assert end == len(audio)  # the clip ends where the speech does: voice-to-voice starts there
    paused = voice.build_workload("pauses", 20.0, [1.0, 1.2], 0.7)
    assert len(paused.questions) == len(voice.PAUSED_QUESTIONS) >= 10
    for _, audio in paused.questions:
        gaps = _silent_runs(audio)
        assert max(gaps) >= 0.65  # the stretched pause, inside the sentence
    assert paused.noise_rms > 0
    channels = voice.build_workload("backchannels", None, [1.0], 0.7)
    assert [text for text, _ in channels.over_reply] == [*voice.BACKCHANNELS, voice.INTERRUPTION]


def _silent_runs(audio, frame=160):
    import numpy as np

    quiet = np.sqrt(np.mean(audio[: len(audio) // frame * frame].reshape(-1, frame) ** 2, axis=1)) < 1e-3
    runs, run = [], 0
    for q in quiet:
        run = run + 1 if q else 0
        runs.append(run * frame / 16000)
    return runs


def test_summary_reports_the_spread_and_the_turns_that_waited_the_mid_clause_silence():
    waited = record(1, 1, 1900.0, 1850.0)
    waited.server = waited.server.model_copy(update={"endpoint_ms": 1210.0})
    summary = summarize([*RECORDS, waited], clients=2)
    assert summary["long_endpoints"] == 1  # 1210 ms; the others' 300 ms endpoints did not wait
    assert summary["voice_to_voice_ms_max"] == 1900.0
    assert (
        summary["voice_to_voice_ms_p50"] < summary["voice_to_voice_ms_p90"] < summary["voice_to_voice_ms_p95"] < 1900.0
    )
    assert summary["endpoint_ms_max"] == 1210.0 and summary["server_voice_to_voice_ms_max"] == 1850.0


def test_summary_counts_the_turns_the_history_weighing_chose_for(capsys):
    """What the default policy did to the conversation: weighed, left out, and chosen from the words heard early."""
    early, late, kept = record(0, 1, 400.0, 380.0), record(0, 2, 500.0, 480.0), record(1, 1, 450.0, 430.0)
    early.server = early.server.model_copy(
        update={"history_gain_nats": -0.4, "history_left_out": True, "history_weighed_early": True}
    )
    late.server = late.server.model_copy(update={"history_gain_nats": 0.2, "history_left_out": True})
    kept.server = kept.server.model_copy(update={"history_gain_nats": 2.5})
    summary = summarize([*RECORDS, early, late, kept], clients=2)
    assert (summary["weighed_turns"], summary["history_left_out"], summary["weighed_from_words_heard"]) == (3, 2, 1)
    voice.print_table(summary)
    assert "conversation weighed in 3 turns, left out of 2; 1 chosen by the words heard" in capsys.readouterr().out
